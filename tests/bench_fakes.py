"""A fake engine and LLM implementing the interface kvtool.bench drives, with deterministic timings.

The fake engine is a small independent model of the real one: it admits requests in order up
to max_batch_size, computes a whole context in one step (cost proportional to the tokens not
found in its prefix cache of full blocks, which never evicts), then emits one token per step.
Time comes from a FakeClock that each step advances, so latencies are exact numbers tests can
compute by hand.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from kvtool.config import EngineConfig
from kvtool.errors import KvtoolError
from kvtool.plan.build_options import BuildOptions
from kvtool.runtime.clock import WALL_CLOCK
from kvtool.runtime.pool_sizes import PoolSizes
from kvtool.runtime.request import MISS_REASONS, Request


class FakeClock:
    """A clock (kvtool.runtime.clock.Clock) that only moves when told to (sleep and engine steps advance it);
    calling it reads it, as the fake engine does."""

    def __init__(self, start: float = 100.0) -> None:
        self.seconds = start
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.seconds

    __call__ = now

    def advance(self, seconds: float) -> None:
        self.seconds += seconds

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.seconds += seconds


class FakeTokenizer:
    """One token per character: id = code point (ASCII text stays below the fake vocabulary)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)


class FakeEngine:
    def __init__(self, *, clock=time.perf_counter, advance=None, vocab_size: int = 1000, max_seq_len: int = 4096,
                 max_batch_size: int = 64, tokens_per_block: int = 4, step_s: float = 0.010,
                 context_s_per_token: float = 0.001, interrupt_at_step: int | None = None,
                 enable_block_reuse: bool = True, refuse_when_added=None, fail_at_step: int | None = None) -> None:
        self.clock = clock
        self.advance_clock = advance or (lambda seconds: None)
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.tokens_per_block = tokens_per_block
        self.step_s = step_s
        self.context_s_per_token = context_s_per_token
        self.interrupt_at_step = interrupt_at_step
        self.enable_block_reuse = enable_block_reuse
        # A request the pre-check passes but add_request refuses (prompt -> message or None), and a
        # step that raises: what can still go wrong during a run.
        self.refuse_when_added = refuse_when_added or (lambda prompt: None)
        self.fail_at_step = fail_at_step
        self.requests: dict[int, Request] = {}
        self.add_times: dict[int, float] = {}
        self._next_id = 0
        self._waiting: list[int] = []
        self._running: list[int] = []
        self._cached_blocks: set[tuple] = set()
        self.num_steps = 0
        self.max_in_engine = 0
        self.num_resets = 0
        self.stats = self._zero_stats()

    def request_problem(self, request: Request):
        prompt = request.prompt_token_ids
        if not prompt:
            return "the prompt is empty"
        if max(prompt) >= self.vocab_size:
            return f"token id {max(prompt)} is outside the model's vocabulary [0, {self.vocab_size})"
        max_tokens = request.sampling_params.max_tokens
        if len(prompt) + max_tokens > self.max_seq_len:
            return f"{len(prompt)} prompt tokens + {max_tokens} output tokens exceed max_seq_len {self.max_seq_len}"
        return None

    def add_request(self, request: Request):
        request.request_id = request_id = self._next_id
        self._next_id += 1
        problem = self.request_problem(request) or self.refuse_when_added(request.prompt_token_ids)
        if problem is not None:
            raise ValueError(f"request {request_id}: {problem}")
        now = self.clock()
        self.add_times[request_id] = now
        if request.arrival_time is None:
            request.arrival_time = now
        self.requests[request_id] = request
        self._waiting.append(request_id)
        self.max_in_engine = max(self.max_in_engine, len(self._waiting) + len(self._running))

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def _block_keys(self, prompt):
        tpb = self.tokens_per_block
        return [tuple(prompt[:end]) for end in range(tpb, len(prompt) + 1, tpb)]

    def step(self):
        self.num_steps += 1
        if self.interrupt_at_step is not None and self.num_steps >= self.interrupt_at_step:
            raise KeyboardInterrupt
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise KvtoolError(f"step {self.num_steps}: the engine failed")
        while self._waiting and len(self._running) < self.max_batch_size:
            self._running.append(self._waiting.pop(0))
        duration = self.step_s
        for request_id in self._running:
            request = self.requests[request_id]
            if request.first_token_time is None:
                keys = self._block_keys(request.prompt_token_ids)
                reused = 0
                # At least the last prompt token is computed, so a fully cached prompt still yields logits.
                reusable = keys[:(request.num_prompt_tokens - 1) // self.tokens_per_block]
                while self.enable_block_reuse and reused < len(reusable) and reusable[reused] in self._cached_blocks:
                    reused += 1
                request.num_reused_blocks = reused
                request.num_reused_tokens = reused * self.tokens_per_block
                # Nothing is evicted: a missed block is new, or cached but holding the last token.
                missed = keys[reused:]
                reasons = dict.fromkeys(MISS_REASONS, 0)
                if not self.enable_block_reuse:
                    reasons["reuse_off"] = len(missed)
                else:
                    reasons["last_token"] = sum(key in self._cached_blocks for key in missed)
                    reasons["never_seen"] = len(missed) - reasons["last_token"]
                request.miss_reasons = reasons
                self.stats["reused_blocks"] += reused
                self.stats["missed_blocks"] += len(missed)
                for reason, count in reasons.items():
                    self.stats[f"missed_{reason}_blocks"] += count
                duration += (request.num_prompt_tokens - request.num_reused_tokens) * self.context_s_per_token
                self._cached_blocks.update(keys)
        self.advance_clock(duration)
        now = self.clock()
        outputs = []
        for request_id in list(self._running):
            request = self.requests[request_id]
            if request.first_token_time is None:
                request.first_token_time = now
            token = (sum(request.prompt_token_ids) + request.num_output_tokens) % self.vocab_size
            request.output_token_ids.append(token)
            request.token_times.append(now)
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                request.finish_time = now
                request.finish_reason = "length"
                self._running.remove(request_id)
            outputs.append(request)
        return outputs

    def get_stats(self):
        total = self.stats["reused_blocks"] + self.stats["missed_blocks"]
        return {**self.stats, "cache_hit_rate": self.stats["reused_blocks"] / total if total else 0.0,
                "offloaded_blocks": 0, "onboarded_blocks": 0, "offloaded_bytes": 0, "onboarded_bytes": 0}

    @staticmethod
    def _zero_stats():
        return {"reused_blocks": 0, "missed_blocks": 0, **{f"missed_{reason}_blocks": 0 for reason in MISS_REASONS}}

    def reset_stats(self):
        self.num_resets += 1
        self.stats = self._zero_stats()


@dataclass
class FakeModelConfig:
    architecture: str
    vocab_size: int


@dataclass
class FakePlan:
    path: Path
    model_config: FakeModelConfig
    build_options: BuildOptions


class FakeLLM:
    """A bench target (kvtool.bench.target.Target) over a FakeEngine, timed on ``clock`` (a FakeClock, or
    the wall clock) and configured by ``config`` (what the summary row records)."""

    engine_name = "kvtool"
    endpoint = None
    report_columns: dict = {}

    def __init__(self, engine: FakeEngine | None = None, *, tokens_per_block: int = 4, clock=WALL_CLOCK,
                 config: EngineConfig | None = None, **engine_kwargs) -> None:
        self.clock = clock
        self.config = config or EngineConfig()
        if engine is None and isinstance(clock, FakeClock):
            engine_kwargs.setdefault("advance", clock.advance)
        self.engine = engine or FakeEngine(tokens_per_block=tokens_per_block, clock=clock if isinstance(
            clock, FakeClock) else time.perf_counter, **engine_kwargs)
        self.tokenizer = FakeTokenizer(self.engine.vocab_size)
        self.device_description = "fake: deterministic test engine"
        tokens_per_block = self.engine.tokens_per_block
        self.plan = FakePlan(Path("plans/fake"), FakeModelConfig("FakeForCausalLM", self.engine.vocab_size),
                             BuildOptions(tokens_per_block=tokens_per_block, max_seq_len=self.engine.max_seq_len))
        self.pool_sizes = PoolSizes(tokens_per_block, block_bytes=1024, num_primary_blocks=1024,
                                    num_secondary_blocks=0)
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True
