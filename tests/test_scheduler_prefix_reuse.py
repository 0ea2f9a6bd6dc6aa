"""Prefix reuse through the scheduler: cached tokens are not recomputed, and requests that share a
prefix and arrive together compute it once (the later ones wait for it to land)."""

from __future__ import annotations

from kvtool import _core
from test_scheduler_fake_model import add, distinct_prompt, make_scheduler, reference_output, run_steps


def first_chunk(run, request_id: int):
    return next(r for batch in run.batches for r in batch.requests if r.request_id == request_id)


def test_reused_prefix_is_not_recomputed():
    scheduler, model = make_scheduler(tokens_per_block=4)
    prefix = distinct_prompt(0, 16)
    first, second = prefix + [1, 2, 3], prefix + [4, 5, 6]
    add(scheduler, 0, first, 3)
    run = run_steps(scheduler, model)
    add(scheduler, 1, second, 3)
    run = run_steps(scheduler, model, run)
    chunk = first_chunk(run, 1)
    assert chunk.is_context and chunk.num_cached_tokens == 16
    assert chunk.token_ids.tolist() == [4, 5, 6]
    stats = scheduler.request_stats(1)
    assert (stats.num_reused_tokens, stats.num_reused_blocks, stats.num_early_reused_blocks) == (16, 4, 0)
    # The shared blocks held the right KV: same output as without a cache.
    assert run.outputs[1] == reference_output(second, 3)
    assert run.outputs[0] == reference_output(first, 3)


def test_early_reuse_within_batch():
    # Both arrive together. The first request's first chunk computes the 4-block prefix; the
    # second is admitted a step later, while the first is still in its context, and shares them.
    scheduler, model = make_scheduler(tokens_per_block=4, max_num_tokens=16, enable_chunked_context=True)
    prefix = distinct_prompt(0, 16)
    first, second = prefix + distinct_prompt(1, 8), prefix + distinct_prompt(2, 5)
    add(scheduler, 0, first, 3)
    add(scheduler, 1, second, 3)
    run = run_steps(scheduler, model)
    assert [(r.request_id, r.num_cached_tokens, len(r.token_ids)) for r in run.batches[0].requests] == [(0, 0, 16)]
    assert [(r.request_id, r.num_cached_tokens, len(r.token_ids)) for r in run.batches[1].requests] == [
        (0, 16, 8), (1, 16, 5)]
    assert scheduler.request_stats(0).num_reused_blocks == 0
    stats = scheduler.request_stats(1)
    assert (stats.num_reused_blocks, stats.num_early_reused_blocks, stats.num_reused_tokens) == (4, 4, 16)
    assert scheduler.cache_manager.stats().early_reused_blocks == 4
    assert run.outputs[0] == reference_output(first, 3)
    assert run.outputs[1] == reference_output(second, 3)


def test_requests_sharing_a_prefix_compute_it_once():
    scheduler, model = make_scheduler(tokens_per_block=4)
    prefix = distinct_prompt(0, 12)
    prompts = {i: prefix + distinct_prompt(i + 1, 3) for i in range(3)}
    for request_id, prompt in prompts.items():
        add(scheduler, request_id, prompt, 2)
    run = run_steps(scheduler, model)
    assert [r.request_id for r in run.batches[0].requests] == [0]
    assert [(r.request_id, r.num_cached_tokens) for r in run.batches[1].requests if r.is_context] == [(1, 12), (2, 12)]
    assert [scheduler.request_stats(i).num_early_reused_blocks for i in prompts] == [0, 3, 3]
    for request_id, prompt in prompts.items():
        assert run.outputs[request_id] == reference_output(prompt, 2)


def test_unrelated_request_goes_ahead_of_one_waiting_for_a_prefix():
    scheduler, model = make_scheduler(tokens_per_block=4)
    prefix = distinct_prompt(0, 12)
    add(scheduler, 0, prefix + [1], 2)
    add(scheduler, 1, prefix + [2], 2)  # waits for request 0's prefix
    add(scheduler, 2, distinct_prompt(9, 13), 2)
    run = run_steps(scheduler, model)
    assert [r.request_id for r in run.batches[0].requests] == [0, 2]
    assert first_chunk(run, 1).num_cached_tokens == 12


def test_in_batch_prefix_reuse_can_be_turned_off():
    scheduler, model = make_scheduler(tokens_per_block=4, enable_in_batch_prefix_reuse=False)
    prefix = distinct_prompt(0, 12)
    prompts = {i: prefix + distinct_prompt(i + 1, 3) for i in range(3)}
    for request_id, prompt in prompts.items():
        add(scheduler, request_id, prompt, 2)
    run = run_steps(scheduler, model)
    assert [(r.request_id, r.num_cached_tokens) for r in run.batches[0].requests] == [(0, 0), (1, 0), (2, 0)]
    assert all(scheduler.request_stats(i).num_reused_blocks == 0 for i in prompts)


def test_static_batch_computes_a_shared_prefix_within_the_batch():
    # A static batch starts together: holding a request back would leave it out of the batch.
    scheduler, model = make_scheduler(tokens_per_block=4,
                                      capacity_scheduler_policy=_core.CapacitySchedulerPolicy.STATIC_BATCH)
    prefix = distinct_prompt(0, 12)
    for request_id in range(3):
        add(scheduler, request_id, prefix + [request_id], 2)
    run = run_steps(scheduler, model)
    assert [r.request_id for r in run.batches[0].requests] == [0, 1, 2]


def test_prefix_under_another_cache_salt_is_not_waited_for():
    scheduler, model = make_scheduler(tokens_per_block=4)
    prefix = distinct_prompt(0, 12)
    add(scheduler, 0, prefix + [1], 2, cache_salt=1)
    add(scheduler, 1, prefix + [2], 2, cache_salt=2)
    run = run_steps(scheduler, model)
    assert [r.request_id for r in run.batches[0].requests] == [0, 1]
    assert scheduler.request_stats(1).num_reused_blocks == 0
