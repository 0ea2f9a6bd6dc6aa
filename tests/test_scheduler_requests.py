"""Requests through the scheduler: input errors, finishing, the step protocol and invariants."""

from __future__ import annotations

import numpy as np
import pytest

from kvtool import _core
from test_scheduler_fake_model import add, distinct_prompt, make_scheduler, reference_output, run_steps

State = _core.RequestState


def test_prompt_longer_than_max_seq_len_is_rejected_with_clear_error():
    scheduler, _ = make_scheduler(max_seq_len=128, max_num_tokens=256)
    with pytest.raises(ValueError) as error:
        add(scheduler, 7, distinct_prompt(7, 100), 30)
    message = str(error.value)
    assert "request 7" in message
    assert "100" in message and "30" in message and "130" in message and "max_seq_len 128" in message
    assert not scheduler.has_unfinished_requests()


def test_pool_smaller_than_one_request_is_rejected():
    scheduler, _ = make_scheduler(tokens_per_block=4, num_primary_blocks=4)
    with pytest.raises(ValueError) as error:
        add(scheduler, 3, distinct_prompt(3, 10), 8)
    assert str(error.value) == ("request 3: the primary pool of 4 blocks (16 tokens) cannot hold one request of "
                                "18 tokens: raise --max_tokens_in_paged_kv_cache or "
                                "--kv_cache_free_gpu_mem_fraction")
    add(scheduler, 4, distinct_prompt(4, 10), 6)  # 16 tokens: fits


@pytest.mark.parametrize("prompt, max_new_tokens, kwargs, expected", [
    ([], 4, {}, "empty prompt"),
    ([1, 2, 3], 0, {}, "max_new_tokens must be >= 1"),
    ([1, 2, 3], 4, {"extra_ids": np.array([0, 0], dtype=np.uint64)}, "2 extra_ids for 3 prompt tokens"),
    ([1, 2, 3], 4, {"priority": 101}, "priority must be in 0..100"),
])
def test_bad_request_is_rejected_naming_it(prompt, max_new_tokens, kwargs, expected):
    scheduler, _ = make_scheduler()
    with pytest.raises(ValueError, match=f"request 9.*{expected}"):
        add(scheduler, 9, prompt, max_new_tokens, **kwargs)
    assert not scheduler.has_unfinished_requests()


@pytest.mark.parametrize("prompt, max_new_tokens, kwargs, expected", [
    ([], 4, {}, "request has an empty prompt: give at least one token"),
    ([1, 2, 3], 0, {}, "request: max_new_tokens must be >= 1, got 0"),
    ([1, 2, 3], 4, {"priority": 101}, "request: priority must be in 0..100, got 101"),
    ([1] * 100, 30, {}, "request: prompt of 100 tokens + 30 output tokens = 130 tokens exceeds --max_seq_len 128: "
                        "shorten the prompt, generate fewer tokens or raise --max_seq_len"),
    ([1, 2, 3], 4, {}, None),
])
def test_request_problem_says_what_add_request_would_refuse_and_changes_nothing(prompt, max_new_tokens, kwargs,
                                                                                  expected):
    scheduler, _ = make_scheduler(max_seq_len=128, max_num_tokens=256)
    assert scheduler.request_problem(prompt, max_new_tokens, **kwargs) == expected
    assert not scheduler.has_unfinished_requests() and scheduler.num_queued_requests() == 0
    if expected is not None:
        with pytest.raises(ValueError, match="request 5"):
            add(scheduler, 5, prompt, max_new_tokens, **kwargs)


@pytest.mark.parametrize("container", [list, tuple])
def test_token_ids_convert_exactly_on_both_sides_of_cpythons_one_digit_ints(container):
    # CPython keeps ints below 2**30 in one digit (read directly); larger ones go through its C API.
    scheduler, _ = make_scheduler(vocab_size=2**30 + 1)
    assert scheduler.request_problem(container([0, 2**30 - 1, 2**30]), 1) is None
    for bad in (2**30 + 1, 2**31 - 1, -1, -(2**30)):
        problem = scheduler.request_problem(container([7, bad]), 1)
        assert problem.startswith(f"request: token id {bad} is outside the model's vocabulary")


def test_duplicate_request_id_is_rejected():
    scheduler, _ = make_scheduler()
    add(scheduler, 1, [1, 2, 3], 2)
    with pytest.raises(ValueError, match="request 1 is already known"):
        add(scheduler, 1, [4, 5, 6], 2)
    assert scheduler.num_queued_requests() == 1


def test_unknown_request_id_is_a_key_error():
    scheduler, _ = make_scheduler()
    for call in (scheduler.finish_request, scheduler.request_state, scheduler.request_stats):
        with pytest.raises(KeyError, match="request 42"):
            call(42)


def test_bad_scheduler_config_is_rejected_naming_the_field():
    cache_config = _core.CacheConfig(tokens_per_block=16, num_primary_blocks=8)
    with pytest.raises(ValueError, match="max_batch_size"):
        _core.Scheduler(cache_config, _core.SchedulerConfig(max_batch_size=0))
    with pytest.raises(ValueError, match=r"--max_num_tokens \(8\) must be >= --tokens_per_block \(16\)"):
        _core.Scheduler(cache_config, _core.SchedulerConfig(max_num_tokens=8, enable_chunked_context=True))


def test_finish_request_releases_blocks():
    scheduler, model = make_scheduler()
    add(scheduler, 0, distinct_prompt(0, 10), 50)
    add(scheduler, 1, distinct_prompt(1, 10), 50)
    run = run_steps(scheduler, model, until=lambda run: len(run.batches) == 3)
    used_before = scheduler.cache_manager.stats().primary.num_used_blocks
    scheduler.finish_request(0)  # e.g. EOS, decided by the runtime
    assert scheduler.request_state(0) == State.FINISHED
    assert scheduler.cache_manager.stats().primary.num_used_blocks == used_before - 3  # 12 tokens: 3 blocks
    assert scheduler.num_running_requests() == 1
    scheduler.finish_request(0)  # finishing twice changes nothing
    scheduler.finish_request(1)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.cache_manager.stats().primary.num_used_blocks == 0
    assert scheduler.cache_manager.check_invariants() == []
    assert scheduler.schedule().requests == []
    assert run.outputs[0] == reference_output(distinct_prompt(0, 10), 3)
    assert scheduler.request_stats(0).num_generated_tokens == 3


def test_finishing_a_queued_request_means_it_never_runs():
    scheduler, model = make_scheduler(max_batch_size=1)
    add(scheduler, 0, distinct_prompt(0, 4), 2)
    add(scheduler, 1, distinct_prompt(1, 4), 2)
    scheduler.finish_request(1)
    run = run_steps(scheduler, model)
    assert all(r.request_id == 0 for batch in run.batches for r in batch.requests)
    assert scheduler.request_state(1) == State.FINISHED


def test_request_finished_between_schedule_and_complete_step_is_skipped():
    scheduler, model = make_scheduler()
    add(scheduler, 0, distinct_prompt(0, 4), 5)
    add(scheduler, 1, distinct_prompt(1, 4), 5)
    batch = scheduler.schedule()
    request_ids, token_ids = model.execute(batch)
    scheduler.finish_request(1)  # cancelled while the step ran
    assert scheduler.complete_step(np.array(request_ids, dtype=np.int64), np.array(token_ids, dtype=np.int32)) == []
    run = run_steps(scheduler, model)
    assert [token_ids[0]] + run.outputs[0] == reference_output(distinct_prompt(0, 4), 5)
    assert scheduler.cache_manager.stats().primary.num_used_blocks == 0


def test_step_protocol_errors_are_reported():
    scheduler, model = make_scheduler()
    add(scheduler, 0, distinct_prompt(0, 4), 2)
    batch = scheduler.schedule()
    with pytest.raises(RuntimeError, match="complete_step"):
        scheduler.schedule()
    with pytest.raises(ValueError, match="request 5 did not sample"):
        scheduler.complete_step(np.array([5], dtype=np.int64), np.array([1], dtype=np.int32))
    with pytest.raises(ValueError, match="request 0 sampled in step 0 but no token"):
        scheduler.complete_step(np.array([], dtype=np.int64), np.array([], dtype=np.int32))
    with pytest.raises(ValueError, match="1 request ids but 2 token ids"):
        scheduler.complete_step(np.array([0], dtype=np.int64), np.array([1, 2], dtype=np.int32))
    # A rejected report changes nothing: the right one is still accepted.
    request_ids, token_ids = model.execute(batch)
    assert scheduler.complete_step(np.array(request_ids, dtype=np.int64), np.array(token_ids, dtype=np.int32)) == []


def test_generation_step_computes_the_last_token_over_all_earlier_ones():
    scheduler, model = make_scheduler(tokens_per_block=4)
    prompt = distinct_prompt(0, 7)
    add(scheduler, 0, prompt, 4)
    run = run_steps(scheduler, model)
    expected = reference_output(prompt, 4)
    generation = [batch.requests[0] for batch in run.batches[1:]]
    assert [r.num_cached_tokens for r in generation] == [7, 8, 9]
    assert [r.token_ids.tolist() for r in generation] == [[t] for t in expected[:3]]
    assert [len(r.block_ids) for r in generation] == [2, 3, 3]  # cover 8, 9, 10 tokens
    assert generation[0].token_ids.dtype == np.int32 and generation[0].block_ids.dtype == np.int32
    assert scheduler.generated_token_ids(0).tolist() == expected == run.outputs[0]


def test_invariants_hold_and_no_block_is_referenced_after_all_finish():
    scheduler, model = make_scheduler(tokens_per_block=4, num_primary_blocks=14, enable_chunked_context=True,
                                      max_num_tokens=12, capacity_scheduler_policy=_core.CapacitySchedulerPolicy.MAX_UTILIZATION)
    shared = distinct_prompt(0, 8)
    prompts = {i: (shared if i % 2 else []) + distinct_prompt(i, 3 + i) for i in range(8)}
    for request_id, prompt in prompts.items():
        add(scheduler, request_id, prompt, 6 + request_id % 3)
    run = run_steps(scheduler, model)  # checks the invariants after every step
    stats = scheduler.cache_manager.stats()
    assert stats.primary.num_used_blocks == 0
    assert stats.primary.num_free_blocks + stats.primary.num_cached_blocks == 14
    for request_id, prompt in prompts.items():
        assert scheduler.request_state(request_id) == State.FINISHED
        assert run.outputs[request_id] == reference_output(prompt, 6 + request_id % 3)
