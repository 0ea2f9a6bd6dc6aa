"""Micro-batch limits and chunked context: which running requests compute in a step, and how much."""

from __future__ import annotations

from kvtool import _core
from test_scheduler_fake_model import add, distinct_prompt, make_scheduler, reference_output, run_steps

FCFS = _core.ContextChunkingPolicy.FIRST_COME_FIRST_SERVED
EQUAL_PROGRESS = _core.ContextChunkingPolicy.EQUAL_PROGRESS


def chunks_of(run, request_id: int) -> list[tuple[int, int]]:
    """(num_cached_tokens, num_new_tokens) of every context chunk of a request, in order."""
    return [(r.num_cached_tokens, len(r.token_ids)) for batch in run.batches for r in batch.requests
            if r.request_id == request_id and r.is_context]


def context_done_step(run, request_id: int) -> int:
    return next(i for i, batch in enumerate(run.batches) for r in batch.requests
                if r.request_id == request_id and r.is_context and r.samples)


def test_max_batch_size_limits_requests_per_step():
    scheduler, model = make_scheduler(max_batch_size=3)
    prompts = {i: distinct_prompt(i, 4 + i) for i in range(7)}
    for request_id, prompt in prompts.items():
        add(scheduler, request_id, prompt, 3)
    run = run_steps(scheduler, model)  # checks len(batch.requests) <= 3 at every step
    assert len(run.batches[0].requests) == 3
    assert max(len(batch.requests) for batch in run.batches) == 3
    for request_id, prompt in prompts.items():
        assert run.outputs[request_id] == reference_output(prompt, 3)


def test_running_requests_never_exceed_max_batch_size():
    scheduler, model = make_scheduler(max_batch_size=2)
    for request_id in range(5):
        add(scheduler, request_id, distinct_prompt(request_id, 5), 4)
    run_steps(scheduler, model, until=lambda run: len(run.batches) == 1)
    assert scheduler.num_running_requests() == 2 and scheduler.num_queued_requests() == 3


def test_max_num_tokens_limits_tokens_per_step():
    # Without chunking: two 6-token contexts fit in 16 tokens, a third would not.
    scheduler, model = make_scheduler(max_num_tokens=16, max_batch_size=8)
    prompts = {i: distinct_prompt(i, 6) for i in range(5)}
    for request_id, prompt in prompts.items():
        add(scheduler, request_id, prompt, 4)
    run = run_steps(scheduler, model)  # checks batch.num_tokens <= 16 at every step
    assert [(r.request_id, len(r.token_ids)) for r in run.batches[0].requests] == [(0, 6), (1, 6)]
    # Next step: two generation tokens first, then the contexts that fit in the other 14 tokens.
    second = run.batches[1]
    assert [(r.request_id, r.is_context) for r in second.requests] == [(2, True), (3, True), (0, False), (1, False)]
    assert second.num_tokens == 14
    for request_id, prompt in prompts.items():
        assert run.outputs[request_id] == reference_output(prompt, 4)


def test_generation_requests_are_scheduled_before_contexts():
    # 10 tokens per step: two generating requests take 2, so a 9-token context waits.
    scheduler, model = make_scheduler(max_num_tokens=10)
    add(scheduler, 0, distinct_prompt(0, 5), 6)
    add(scheduler, 1, distinct_prompt(1, 5), 6)
    run = run_steps(scheduler, model, until=lambda run: len(run.batches) == 1)
    add(scheduler, 2, distinct_prompt(2, 9), 2)
    run = run_steps(scheduler, model, run)
    context_step_of_2 = context_done_step(run, 2)
    assert context_step_of_2 > 1
    assert all(r.request_id != 2 for batch in run.batches[1:context_step_of_2] for r in batch.requests)
    assert context_step_of_2 > min(run.finish_steps[0], run.finish_steps[1])


def test_prompt_longer_than_max_num_tokens_is_rejected_without_chunking():
    scheduler, _ = make_scheduler(max_num_tokens=8)
    try:
        add(scheduler, 5, distinct_prompt(5, 9), 1)
    except ValueError as error:
        message = str(error)
        assert "request 5" in message and "9" in message and "max_num_tokens 8" in message
        assert "enable_chunked_context" in message
    else:
        raise AssertionError("a 9-token prompt was accepted with max_num_tokens=8 and no chunking")


def test_chunks_are_multiples_of_tokens_per_block():
    scheduler, model = make_scheduler(tokens_per_block=4, max_num_tokens=10, enable_chunked_context=True)
    prompt = distinct_prompt(0, 23)
    add(scheduler, 0, prompt, 2)
    run = run_steps(scheduler, model)
    # 10 tokens per step, but chunks end on block boundaries: 8 + 8 + the final 7.
    assert chunks_of(run, 0) == [(0, 8), (8, 8), (16, 7)]
    assert [r.samples for batch in run.batches[:3] for r in batch.requests] == [False, False, True]
    assert run.outputs[0] == reference_output(prompt, 2)


def test_chunk_ends_on_block_boundary_beside_generation_tokens():
    # A generating request takes 1 of the 12 tokens; the context gets 8 (not 11).
    scheduler, model = make_scheduler(tokens_per_block=4, max_num_tokens=12, enable_chunked_context=True)
    add(scheduler, 0, distinct_prompt(0, 3), 4)
    run = run_steps(scheduler, model, until=lambda run: len(run.batches) == 1)
    add(scheduler, 1, distinct_prompt(1, 30), 1)
    run = run_steps(scheduler, model, run)
    assert chunks_of(run, 1)[:2] == [(0, 8), (8, 8)]
    assert all(begin % 4 == 0 for begin, _ in chunks_of(run, 1))


def test_first_come_first_served_finishes_oldest_context_first():
    scheduler, model = make_scheduler(tokens_per_block=4, max_num_tokens=12, enable_chunked_context=True,
                                      context_chunking_policy=FCFS)
    prompts = {i: distinct_prompt(i, 16) for i in range(3)}
    for request_id, prompt in prompts.items():
        add(scheduler, request_id, prompt, 2)
    run = run_steps(scheduler, model)
    assert [(r.request_id, len(r.token_ids)) for r in run.batches[0].requests] == [(0, 12)]
    assert [(r.request_id, len(r.token_ids)) for r in run.batches[1].requests] == [(0, 4), (1, 8)]
    assert context_done_step(run, 0) < context_done_step(run, 1) < context_done_step(run, 2)
    for request_id, prompt in prompts.items():
        assert run.outputs[request_id] == reference_output(prompt, 2)


def test_equal_progress_advances_every_context_before_second_chunk():
    scheduler, model = make_scheduler(tokens_per_block=4, max_num_tokens=12, enable_chunked_context=True,
                                      context_chunking_policy=EQUAL_PROGRESS)
    prompts = {i: distinct_prompt(i, 16) for i in range(3)}
    for request_id, prompt in prompts.items():
        add(scheduler, request_id, prompt, 2)
    run = run_steps(scheduler, model)
    # One block each per step; no context is ever more than one block ahead of another.
    assert [(r.request_id, len(r.token_ids)) for r in run.batches[0].requests] == [(0, 4), (1, 4), (2, 4)]
    for batch_index in range(4):
        assert {len(r.token_ids) for r in run.batches[batch_index].requests if r.is_context} == {4}
    done = {context_done_step(run, i) for i in prompts}
    assert done == {3}
    for request_id, prompt in prompts.items():
        assert run.outputs[request_id] == reference_output(prompt, 2)


def test_equal_progress_gives_leftover_budget_a_second_round():
    # 3 contexts, 20 tokens: one block each (12), then a second block for the two oldest (8).
    scheduler, model = make_scheduler(tokens_per_block=4, max_num_tokens=20, enable_chunked_context=True,
                                      context_chunking_policy=EQUAL_PROGRESS)
    for request_id in range(3):
        add(scheduler, request_id, distinct_prompt(request_id, 16), 1)
    run = run_steps(scheduler, model, until=lambda run: len(run.batches) == 1)
    assert [(r.request_id, len(r.token_ids)) for r in run.batches[0].requests] == [(0, 8), (1, 8), (2, 4)]
