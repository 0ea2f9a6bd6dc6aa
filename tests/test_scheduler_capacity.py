"""Capacity policies: which requests hold KV cache blocks, and when a running one is paused."""

from __future__ import annotations

import pytest

from kvtool import _core
from test_scheduler_fake_model import add, distinct_prompt, make_scheduler, reference_output, run_steps

GNE = _core.CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
MAX_UTILIZATION = _core.CapacitySchedulerPolicy.MAX_UTILIZATION
STATIC_BATCH = _core.CapacitySchedulerPolicy.STATIC_BATCH
State = _core.RequestState


def scheduled_ids(batch) -> set[int]:
    return {r.request_id for r in batch.requests}


def test_guaranteed_no_evict_admits_only_what_fits_for_whole_lifetime():
    # 8 blocks of 4 tokens. Each request: 8 prompt tokens (2 blocks) + 8 new = 16 tokens (4 blocks)
    # over its lifetime, so two lifetimes fill the pool although three prompts would fit now.
    scheduler, model = make_scheduler(num_primary_blocks=8, capacity_scheduler_policy=GNE)
    prompts = {i: distinct_prompt(i, 8) for i in range(3)}
    for request_id, prompt in prompts.items():
        add(scheduler, request_id, prompt, 8)
    run = run_steps(scheduler, model, until=lambda run: len(run.batches) == 1)
    assert scheduled_ids(run.batches[0]) == {0, 1}
    assert scheduler.request_state(2) == State.QUEUED
    assert scheduler.num_running_requests() == 2 and scheduler.num_queued_requests() == 1

    run = run_steps(scheduler, model, run)
    first_step_of_2 = min(i for i, batch in enumerate(run.batches) if 2 in scheduled_ids(batch))
    assert first_step_of_2 > min(run.finish_steps[0], run.finish_steps[1])
    assert {i: run.outputs[i] for i in prompts} == {i: reference_output(p, 8) for i, p in prompts.items()}


@pytest.mark.parametrize("policy", [GNE, MAX_UTILIZATION], ids=["guaranteed_no_evict", "max_utilization"])
def test_a_queued_request_that_does_not_fit_holds_back_the_ones_behind_it(policy):
    # 8 blocks of 4 tokens. A runs (2 prompt blocks, 4 over its lifetime); B, next in line, needs 7
    # prompt blocks (8 over its lifetime): it waits for A. C would fit beside A, but comes after B.
    scheduler, model = make_scheduler(num_primary_blocks=8, capacity_scheduler_policy=policy, max_batch_size=4)
    prompts = {0: distinct_prompt(0, 8), 1: distinct_prompt(1, 28), 2: distinct_prompt(2, 4)}
    add(scheduler, 0, prompts[0], 8)
    add(scheduler, 1, prompts[1], 1)
    add(scheduler, 2, prompts[2], 4)
    run = run_steps(scheduler, model, until=lambda run: len(run.batches) == 1)
    assert scheduled_ids(run.batches[0]) == {0}
    assert [scheduler.request_state(i) for i in (1, 2)] == [State.QUEUED, State.QUEUED]
    run = run_steps(scheduler, model, run)
    first_step = {i: min(k for k, batch in enumerate(run.batches) if i in scheduled_ids(batch)) for i in prompts}
    assert first_step[2] >= first_step[1] > 0
    assert {i: run.outputs[i] for i in prompts} == {0: reference_output(prompts[0], 8),
                                                    1: reference_output(prompts[1], 1),
                                                    2: reference_output(prompts[2], 4)}


def test_max_utilization_admits_what_fits_now():
    # The same workload: MAX_UTILIZATION starts all three, since their prompts fit now.
    scheduler, model = make_scheduler(num_primary_blocks=8, capacity_scheduler_policy=MAX_UTILIZATION)
    for request_id in range(3):
        add(scheduler, request_id, distinct_prompt(request_id, 8), 8)
    run = run_steps(scheduler, model, until=lambda run: len(run.batches) == 1)
    assert scheduled_ids(run.batches[0]) == {0, 1, 2}


def test_guaranteed_no_evict_never_pauses():
    scheduler, model = make_scheduler(num_primary_blocks=10, capacity_scheduler_policy=GNE, max_batch_size=6)
    prompts = {i: distinct_prompt(i, 5 + 2 * i) for i in range(6)}
    for request_id, prompt in prompts.items():
        add(scheduler, request_id, prompt, 12 - request_id)
    seen_states = {i: [] for i in prompts}

    def record_states(run):
        for i in prompts:
            state = scheduler.request_state(i)
            if not seen_states[i] or seen_states[i][-1] != state:
                seen_states[i].append(state)
        return False

    run = run_steps(scheduler, model, until=record_states)
    assert all(list(batch.paused_request_ids) == [] for batch in run.batches)
    for request_id, prompt in prompts.items():
        assert scheduler.request_stats(request_id).num_pauses == 0
        assert State.PAUSED not in seen_states[request_id]
        assert run.outputs[request_id] == reference_output(prompt, 12 - request_id)
    # The pool was the limit: not everything ran at once.
    assert max(len(batch.requests) for batch in run.batches) < len(prompts)


def test_max_utilization_pauses_most_recent_request_and_resumes_it():
    # 14 blocks of 4 tokens. A, B, C: 8 prompt tokens + 16 new, so each would grow to 6 blocks.
    # All three start; at 17 tokens each needs a 5th block, A and B get the last two, and C,
    # started last, is paused.
    scheduler, model = make_scheduler(num_primary_blocks=14, capacity_scheduler_policy=MAX_UTILIZATION)
    prompts = {i: distinct_prompt(i, 8) for i in range(3)}
    for request_id, prompt in prompts.items():
        add(scheduler, request_id, prompt, 16)
    run = run_steps(scheduler, model)

    pause_steps = [i for i, batch in enumerate(run.batches) if len(batch.paused_request_ids) > 0]
    assert [list(run.batches[i].paused_request_ids) for i in pause_steps] == [[2]]
    pause_step = pause_steps[0]
    assert scheduled_ids(run.batches[pause_step]) == {0, 1}
    assert [scheduler.request_stats(i).num_pauses for i in range(3)] == [0, 0, 1]
    # Resumed, it recomputes its prompt + the tokens generated before the pause, less the full
    # blocks computed before the pause that are still cached.
    num_generated_before_pause = sum(1 for batch in run.batches[:pause_step] for r in batch.requests
                                     if r.request_id == 2 and r.samples)
    assert num_generated_before_pause == 9
    resume_step = min(i for i in range(pause_step + 1, len(run.batches)) if 2 in scheduled_ids(run.batches[i]))
    resumed = next(r for r in run.batches[resume_step].requests if r.request_id == 2)
    assert resumed.is_context and resumed.samples
    assert resumed.num_cached_tokens + len(resumed.token_ids) == 8 + num_generated_before_pause
    assert resumed.num_cached_tokens > 0 and resumed.num_cached_tokens % 4 == 0
    # Its generated count and max_new_tokens carry on: the same output as an unconstrained run.
    for request_id, prompt in prompts.items():
        assert run.outputs[request_id] == reference_output(prompt, 16)
        assert scheduler.request_stats(request_id).num_generated_tokens == 16
    assert scheduler.cache_manager.stats().primary.num_used_blocks == 0


def test_paused_request_resumes_without_block_reuse():
    scheduler, model = make_scheduler(num_primary_blocks=12, enable_block_reuse=False,
                                      capacity_scheduler_policy=MAX_UTILIZATION)
    prompts = {i: distinct_prompt(i, 8) for i in range(3)}
    for request_id, prompt in prompts.items():
        add(scheduler, request_id, prompt, 16)
    run = run_steps(scheduler, model)
    assert scheduler.request_stats(2).num_pauses == 1
    for request_id, prompt in prompts.items():
        assert run.outputs[request_id] == reference_output(prompt, 16)


def test_static_batch_waits_for_running_batch():
    scheduler, model = make_scheduler(capacity_scheduler_policy=STATIC_BATCH, max_batch_size=2)
    max_new_tokens = {0: 1, 1: 5, 2: 2, 3: 2}
    prompts = {i: distinct_prompt(i, 6) for i in max_new_tokens}
    for request_id, prompt in prompts.items():
        add(scheduler, request_id, prompt, max_new_tokens[request_id])
    run = run_steps(scheduler, model)
    first_step_of_second_batch = min(i for i, batch in enumerate(run.batches) if scheduled_ids(batch) & {2, 3})
    # Request 0 finished early, yet the second batch started only when request 1 was done too.
    assert run.finish_steps[0] < run.finish_steps[1] < first_step_of_second_batch
    assert scheduled_ids(run.batches[first_step_of_second_batch]) == {2, 3}
    for request_id, prompt in prompts.items():
        assert run.outputs[request_id] == reference_output(prompt, max_new_tokens[request_id])


def test_guaranteed_no_evict_refills_a_slot_as_soon_as_a_request_finishes():
    # The same workload as the static batch: here request 2 starts right after request 0 ends.
    scheduler, model = make_scheduler(capacity_scheduler_policy=GNE, max_batch_size=2)
    max_new_tokens = {0: 1, 1: 5, 2: 2, 3: 2}
    for request_id, n in max_new_tokens.items():
        add(scheduler, request_id, distinct_prompt(request_id, 6), n)
    run = run_steps(scheduler, model)
    first_step_of_2 = min(i for i, batch in enumerate(run.batches) if 2 in scheduled_ids(batch))
    assert first_step_of_2 == run.finish_steps[0] + 1 < run.finish_steps[1]
