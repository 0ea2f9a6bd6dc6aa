"""The cache manager's block accounting as the scheduler relies on it.

1. A cached block that a running request recomputes (the last prompt block is always computed;
   greedy outputs repeat) must not pin anything: the request's own block takes the cached node
   over, so num_available_blocks() shrinks only by blocks handed out and GUARANTEED_NO_EVICT's
   reservation holds (the scheduler never has to pause).
2. A partial-reuse copy whose source is itself evictable needs a spare block while the source is
   pinned; without one the tokens are computed, so a request that fills the pool exactly is still
   admitted when nothing else runs.
"""

from __future__ import annotations

from kvtool import _core
from test_scheduler_fake_model import add, make_scheduler, reference_output, run_steps

GNE = _core.CapacitySchedulerPolicy.GUARANTEED_NO_EVICT


def test_guaranteed_no_evict_never_pauses_when_a_request_recomputes_a_cached_block():
    scheduler, model = make_scheduler(tokens_per_block=2, num_primary_blocks=3, enable_partial_reuse=False,
                                      capacity_scheduler_policy=GNE, max_batch_size=1, max_num_tokens=4)
    add(scheduler, 0, [0, 0], 1)
    add(scheduler, 1, [0, 0], 4)  # lifetime 6 tokens = the whole pool; its first block twins request 0's
    run = run_steps(scheduler, model)
    assert run.outputs[1] == reference_output([0, 0], 4)
    assert all(len(batch.paused_request_ids) == 0 for batch in run.batches)
    assert scheduler.cache_manager.check_invariants() == []


def test_request_filling_the_pool_runs_beside_a_cached_partial_match():
    scheduler, model = make_scheduler(tokens_per_block=2, num_primary_blocks=2, capacity_scheduler_policy=GNE,
                                      max_batch_size=1, max_num_tokens=4)
    add(scheduler, 0, [0, 1], 1)
    add(scheduler, 1, [0, 0, 0], 1)  # lifetime 4 tokens = the whole pool; [0] matches request 0's block
    run = run_steps(scheduler, model)
    assert run.outputs[1] == reference_output([0, 0, 0], 1)
    assert all(len(batch.paused_request_ids) == 0 for batch in run.batches)
    assert scheduler.request_stats(1).num_reused_tokens == 0  # the partial copy gave way
