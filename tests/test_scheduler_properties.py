"""Random request mixes under every policy: every request finishes with the reference output."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from step_limit import StepLimit

from kvtool import _core
from test_scheduler_fake_model import Run, add, make_scheduler, reference_output, run_steps

POLICIES = list(_core.CapacitySchedulerPolicy.__members__.values())
CHUNKING_POLICIES = list(_core.ContextChunkingPolicy.__members__.values())


@dataclass
class Request:
    request_id: int
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int


@dataclass
class Workload:
    cache: dict
    scheduler: dict
    requests: list[Request]


@st.composite
def workloads(draw, policies=tuple(POLICIES), enable_block_reuse=st.booleans()) -> Workload:
    tokens_per_block = draw(st.sampled_from([2, 4, 8]))
    tokens = st.integers(0, 20)  # a small vocabulary, so prompts share blocks by chance too
    prefixes = [draw(st.lists(tokens, min_size=0, max_size=12)) for _ in range(2)]
    requests = []
    for request_id in range(draw(st.integers(1, 8))):
        prefix = prefixes[draw(st.integers(0, 1))]
        suffix = draw(st.lists(tokens, min_size=1, max_size=10))
        requests.append(Request(request_id, prefix + suffix, draw(st.integers(1, 16)), draw(st.integers(0, 4))))
    num_lifetime_blocks = max(-(-(len(r.prompt) + r.max_new_tokens) // tokens_per_block) for r in requests)
    chunked = draw(st.booleans())
    longest_prompt = max(len(r.prompt) for r in requests)
    max_num_tokens = (draw(st.integers(tokens_per_block, 24)) if chunked
                      else draw(st.integers(longest_prompt, longest_prompt + 12)))
    # Pools from exactly the largest request's lifetime (test_scheduler_cache_accounting.py) up.
    cache = dict(tokens_per_block=tokens_per_block,
                 num_primary_blocks=draw(st.integers(num_lifetime_blocks, 2 * num_lifetime_blocks + 1)),
                 num_secondary_blocks=draw(st.sampled_from([0, 3])),
                 enable_block_reuse=draw(enable_block_reuse), enable_partial_reuse=draw(st.booleans()))
    # MAX_UTILIZATION has the most paths (pause, resume): draw it more often.
    policy = draw(st.sampled_from(list(policies) + [_core.CapacitySchedulerPolicy.MAX_UTILIZATION] * 3
                                  if _core.CapacitySchedulerPolicy.MAX_UTILIZATION in policies else list(policies)))
    scheduler = dict(capacity_scheduler_policy=policy,
                     context_chunking_policy=draw(st.sampled_from(CHUNKING_POLICIES)),
                     enable_chunked_context=chunked, max_batch_size=draw(st.integers(1, 4)),
                     max_num_tokens=max_num_tokens, max_seq_len=64)
    return Workload(cache, scheduler, requests)


def run_workload(workload: Workload):
    """Runs the workload's requests, each arriving at its step, to completion; returns the
    scheduler and the Run. Checks the micro-batch limits and the cache invariants every step."""
    scheduler, model = make_scheduler(**workload.cache, **workload.scheduler)
    pending = sorted(workload.requests, key=lambda r: r.arrival_step)
    run = Run()
    limit = StepLimit(2_000, f"a workload of {len(pending)} requests arriving at steps "
                             f"{sorted({r.arrival_step for r in pending})}")
    while pending or scheduler.has_unfinished_requests():
        limit.step()
        # Requests arrive at their step, or at once when the scheduler has nothing else to do.
        while pending and (pending[0].arrival_step <= len(run.batches) or not scheduler.has_unfinished_requests()):
            r = pending.pop(0)
            add(scheduler, r.request_id, r.prompt, r.max_new_tokens)
        num_steps = len(run.batches)
        run_steps(scheduler, model, run, until=lambda run: len(run.batches) > num_steps)  # one step
    return scheduler, run


def check_every_request_finished(workload: Workload, scheduler, run) -> None:
    for r in workload.requests:
        assert run.outputs[r.request_id] == reference_output(r.prompt, r.max_new_tokens)
        stats = scheduler.request_stats(r.request_id)
        assert stats.state == _core.RequestState.FINISHED
        assert stats.num_generated_tokens == r.max_new_tokens
    assert scheduler.cache_manager.stats().primary.num_used_blocks == 0
    assert scheduler.cache_manager.check_invariants() == []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_every_request_finishes_with_exactly_max_new_tokens(workload: Workload):
    scheduler, run = run_workload(workload)
    # Coverage of the interesting paths (pytest --hypothesis-show-statistics).
    event(f"paused: {any(len(batch.paused_request_ids) > 0 for batch in run.batches)}")
    event(f"chunked: {any(r.is_context and not r.samples for batch in run.batches for r in batch.requests)}")
    event(f"reused: {any(scheduler.request_stats(r.request_id).num_reused_blocks > 0 for r in workload.requests)}")
    check_every_request_finished(workload, scheduler, run)


# With or without block reuse: the cache manager's available blocks shrink only by the blocks it
# hands out, so the reservations of admitted requests always hold.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(policies=(_core.CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
                           _core.CapacitySchedulerPolicy.STATIC_BATCH)))
def test_guaranteed_no_evict_and_static_batch_never_pause(workload: Workload):
    scheduler, run = run_workload(workload)
    event(f"reuse: {workload.cache['enable_block_reuse']}, "
          f"reused: {any(scheduler.request_stats(r.request_id).num_reused_blocks > 0 for r in workload.requests)}")
    assert all(len(batch.paused_request_ids) == 0 for batch in run.batches)
    assert all(scheduler.request_stats(r.request_id).num_pauses == 0 for r in workload.requests)
    check_every_request_finished(workload, scheduler, run)
