"""Scheduler behaviour that the KV cache manager does not support yet (strict xfail: when the
manager is fixed these pass, the run reports XPASS as a failure, and the marks must go).

1. A cached block that a running request recomputes (the last prompt block is always computed;
   greedy outputs repeat) stays the parent of that request's next blocks. Unreferenced, it is
   no longer evictable (leaves go first), so num_available_blocks() shrinks although nothing was
   allocated, and GUARANTEED_NO_EVICT's reservation no longer holds: the scheduler must pause
   (or, without its fallback, fail).
2. A partial-reuse copy counts its evictable source block as needed during the copy, so a
   request that fills the pool exactly can never be added while that source stays cached, even
   though nothing else runs.
"""

from __future__ import annotations

import pytest

from kvtool import _core
from test_scheduler_fake_model import add, make_scheduler, reference_output, run_steps

GNE = _core.CapacitySchedulerPolicy.GUARANTEED_NO_EVICT


@pytest.mark.xfail(strict=True, reason="KV cache manager: a recomputed cached block pins its unreferenced "
                                       "twin, so available blocks shrink without an allocation")
def test_guaranteed_no_evict_never_pauses_when_a_request_recomputes_a_cached_block():
    scheduler, model = make_scheduler(tokens_per_block=2, num_primary_blocks=3, enable_partial_reuse=False,
                                      capacity_scheduler_policy=GNE, max_batch_size=1, max_num_tokens=4)
    add(scheduler, 0, [0, 0], 1)
    add(scheduler, 1, [0, 0], 4)  # lifetime 6 tokens = the whole pool; its first block twins request 0's
    run = run_steps(scheduler, model)
    assert run.outputs[1] == reference_output([0, 0], 4)
    assert all(len(plan.paused_request_ids) == 0 for plan in run.plans)


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="KV cache manager: a partial-reuse copy source is counted as needed, so a "
                          "request that fills the pool exactly is never added")
def test_request_filling_the_pool_runs_beside_a_cached_partial_match():
    scheduler, model = make_scheduler(tokens_per_block=2, num_primary_blocks=2, capacity_scheduler_policy=GNE,
                                      max_batch_size=1, max_num_tokens=4)
    add(scheduler, 0, [0, 1], 1)
    add(scheduler, 1, [0, 0, 0], 1)  # lifetime 4 tokens = the whole pool; [0] matches request 0's block
    run = run_steps(scheduler, model)
    assert run.outputs[1] == reference_output([0, 0, 0], 1)
