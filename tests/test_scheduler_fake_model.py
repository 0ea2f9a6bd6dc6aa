"""A fake model that executes the scheduler's batches against a token-level KV store.

It is the independent reference for the scheduler tests: the "KV" of a position is the token
and position written there, kept in the very blocks the batch names (copy ops included). The
sampler reads the whole history back from the block table, so a wrong block table, a wrong
num_cached_tokens, a reused block holding other tokens or a skipped copy changes the output
against the pure-Python reference, which needs no cache at all.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from step_limit import StepLimit

from kvtool import _core


def next_token(history: list[int]) -> int:
    """The fake sampler: a deterministic function of the whole token history."""
    value = 0
    for token in history:
        value = (value * 31 + token + 1) % 1_000_003
    return value % 997


def reference_output(prompt: list[int], max_new_tokens: int) -> list[int]:
    """What the fake model generates with no cache and no scheduler."""
    history = list(prompt)
    for _ in range(max_new_tokens):
        history.append(next_token(history))
    return history[len(prompt):]


class FakeModel:
    """Executes scheduled batches: runs copy ops, writes (token, position) into block slots, samples."""

    def __init__(self, cache_config: _core.CacheConfig) -> None:
        self.tokens_per_block = cache_config.tokens_per_block
        tpb = self.tokens_per_block
        # pool -> [num_blocks][tokens_per_block] of (token, position) or None
        self.pools = {
            _core.PoolKind.PRIMARY: [[None] * tpb for _ in range(cache_config.num_primary_blocks)],
            _core.PoolKind.SECONDARY: [[None] * tpb for _ in range(cache_config.num_secondary_blocks)],
        }

    def execute(self, batch) -> tuple[list[int], list[int]]:
        """Returns (request ids that sampled, their sampled tokens), in batch order."""
        tpb = self.tokens_per_block
        for op in batch.copy_ops.to_list():
            src = self.pools[op.src_pool][op.src_block_id]
            dst = self.pools[op.dst_pool][op.dst_block_id]
            dst[: op.num_tokens] = src[: op.num_tokens]
        primary = self.pools[_core.PoolKind.PRIMARY]
        # Every request writes its new KV before any reads, as one forward does.
        for r in batch.requests:
            block_ids = r.block_ids
            for i, token in enumerate(r.token_ids.tolist()):
                position = r.num_cached_tokens + i
                primary[block_ids[position // tpb]][position % tpb] = (token, position)
        request_ids, token_ids = [], []
        for r in batch.requests:
            if not r.samples:
                continue
            block_ids = r.block_ids
            num_tokens = r.num_cached_tokens + len(r.token_ids)
            assert len(block_ids) == -(-num_tokens // tpb), "the block table must cover exactly the step's tokens"
            history = []
            for position in range(num_tokens):
                slot = primary[block_ids[position // tpb]][position % tpb]
                assert slot is not None and slot[1] == position, (
                    f"request {r.request_id}: no KV for position {position} in block {block_ids[position // tpb]}")
                history.append(slot[0])
            request_ids.append(r.request_id)
            token_ids.append(next_token(history))
        return request_ids, token_ids


@dataclass
class Run:
    """What a run to completion produced."""

    batches: list = field(default_factory=list)               # every ScheduledBatch, in order
    outputs: dict = field(default_factory=lambda: defaultdict(list))  # request id -> sampled tokens
    finish_steps: dict = field(default_factory=dict)          # request id -> index of the step that finished it


def check_batch_limits(batch, config: _core.SchedulerConfig) -> None:
    assert len(batch.requests) <= config.max_batch_size
    num_tokens = sum(len(r.token_ids) for r in batch.requests)
    assert batch.num_tokens == num_tokens <= config.max_num_tokens
    assert len({r.request_id for r in batch.requests}) == len(batch.requests)
    kinds = [r.is_context for r in batch.requests]
    assert kinds == sorted(kinds, reverse=True), "context chunks come before generation requests"
    for r in batch.requests:
        if not r.is_context:
            assert len(r.token_ids) == 1 and r.samples


def run_steps(scheduler: _core.Scheduler, model: FakeModel, run: Run | None = None, *,
              max_steps: int = 10_000, until=None) -> Run:
    """Runs schedule -> execute -> complete_step until nothing is unfinished (or until(run) is true),
    checking the micro-batch limits and the cache invariants at every step."""
    run = run or Run()
    config = scheduler.config
    limit = StepLimit(max_steps, f"the fake model's run of {scheduler.num_queued_requests()} queued and "
                                 f"{scheduler.num_running_requests()} running requests")
    while scheduler.has_unfinished_requests() and not (until is not None and until(run)):
        limit.step()
        batch = scheduler.schedule()
        assert len(batch.requests) > 0, "an empty batch while requests are unfinished: the scheduler is stuck"
        check_batch_limits(batch, config)
        request_ids, token_ids = model.execute(batch)
        finished = scheduler.complete_step(np.array(request_ids, dtype=np.int64), np.array(token_ids, dtype=np.int32))
        for request_id, token_id in zip(request_ids, token_ids):
            run.outputs[request_id].append(token_id)
        for request_id in finished:
            run.finish_steps[request_id] = len(run.batches)
        run.batches.append(batch)
        assert scheduler.cache_manager.check_invariants() == []
    return run


def make_scheduler(*, tokens_per_block: int = 4, num_primary_blocks: int = 64, num_secondary_blocks: int = 0,
                   enable_block_reuse: bool = True, enable_partial_reuse: bool = True,
                   **scheduler_kwargs) -> tuple[_core.Scheduler, FakeModel]:
    cache_config = _core.CacheConfig(tokens_per_block=tokens_per_block, num_primary_blocks=num_primary_blocks,
                                     num_secondary_blocks=num_secondary_blocks,
                                     enable_block_reuse=enable_block_reuse,
                                     enable_partial_reuse=enable_partial_reuse)
    scheduler = _core.Scheduler(cache_config, _core.SchedulerConfig(**scheduler_kwargs))
    return scheduler, FakeModel(cache_config)


def distinct_prompt(request_id: int, length: int) -> list[int]:
    """A prompt no other request id shares a block with."""
    return [(request_id * 1009 + i * 7) % 997 + 1000 for i in range(length)]


def add(scheduler: _core.Scheduler, request_id: int, prompt: list[int], max_new_tokens: int, **kwargs) -> None:
    scheduler.add_request(request_id, np.array(prompt, dtype=np.int32), max_new_tokens, **kwargs)


def test_fake_model_reproduces_the_reference_when_nothing_is_constrained():
    scheduler, model = make_scheduler()
    prompts = {i: distinct_prompt(i, 5 + 3 * i) for i in range(4)}
    for request_id, prompt in prompts.items():
        add(scheduler, request_id, prompt, 6)
    run = run_steps(scheduler, model)
    for request_id, prompt in prompts.items():
        assert run.outputs[request_id] == reference_output(prompt, 6)


def test_fake_model_output_changes_with_a_wrong_block_table():
    scheduler, model = make_scheduler()
    prompts = {0: distinct_prompt(0, 8), 1: distinct_prompt(1, 8)}
    for request_id, prompt in prompts.items():
        add(scheduler, request_id, prompt, 3)
    run = run_steps(scheduler, model, until=lambda run: len(run.batches) == 1)  # both contexts computed
    batch = scheduler.schedule()
    expected = {i: reference_output(p, 2)[1] for i, p in prompts.items()}
    assert dict(zip(*copy.deepcopy(model).execute(batch))) == expected
    # Reading request 0's history from request 1's blocks (and vice versa) must change the samples.
    swapped = dict(zip(*copy.deepcopy(model).execute(_SwappedBlocks(batch))))
    assert swapped[0] != expected[0] and swapped[1] != expected[1]
    assert run.outputs == {i: reference_output(p, 1) for i, p in prompts.items()}


class _SwappedBlocks:
    """A batch whose first two requests exchanged block tables."""

    class _Request:
        def __init__(self, r, block_ids):
            self.request_id, self.is_context, self.samples = r.request_id, r.is_context, r.samples
            self.num_cached_tokens, self.token_ids, self.block_ids = r.num_cached_tokens, r.token_ids, block_ids

    def __init__(self, batch):
        a, b = batch.requests[0], batch.requests[1]
        self.copy_ops = batch.copy_ops
        self.requests = [self._Request(a, b.block_ids), self._Request(b, a.block_ids)]
