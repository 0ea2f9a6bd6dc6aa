"""`kvtool calibrate`: time real engine steps of a plan over a grid of step shapes and fit the cost model.

Each grid point is a workload run through a real kvtool.LLM (the engine of `kvtool bench`): a prompt
with a cached prefix (new tokens x cached context), several prompts after the same cached prefix in
one step, a batch of prompts decoding together (decode
rows x KV read), and batches that arrive in two waves (context chunks beside decode rows). Every
step is timed around ``Engine.step`` (scheduling, copies, forward, sampling: what a simulated step
replaces) and its shape is read from the batch the scheduler handed out. Block copies are timed on
the KV pools themselves, a block count at a time each way, and fitted on their own; the forward's
terms are fitted on the steps, every fourth distinct point held out to measure the error.
"""

from __future__ import annotations

import datetime
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtool.runtime.request import Request
from kvtool.simulate.cost_model import (CostModel, FitReport, StepShape, fit_coefficients, relative_errors,
                                        step_shape)


@dataclass(frozen=True)
class CalibrationGrid:
    """The points measured: new tokens x cached context for single prompts, batch size x prompt length
    for decoding batches, block counts for copies; ``repeats`` runs of each."""

    new_tokens: tuple[int, ...] = (32, 128, 512, 1024, 2048)
    cached_tokens: tuple[int, ...] = (0, 512, 1536)
    shared_prefix_batch_size: int = 3  # prompts after one cached prefix, computed in one step (new tokens <= 512)
    decode_batch_sizes: tuple[int, ...] = (1, 4, 8, 16)
    decode_context_tokens: tuple[int, ...] = (128, 1024, 2048)
    num_decode_steps: int = 4
    copy_block_counts: tuple[int, ...] = (1, 8, 32)
    repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("new_tokens", "decode_batch_sizes", "decode_context_tokens", "copy_block_counts"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"CalibrationGrid.{name} must be positive integers, got {values!r}")
        if any(not isinstance(v, int) or v < 0 for v in self.cached_tokens) or not self.cached_tokens:
            raise ValueError(f"CalibrationGrid.cached_tokens must be integers >= 0, got {self.cached_tokens!r}")
        if self.repeats < 1 or self.num_decode_steps < 1:
            raise ValueError("CalibrationGrid.repeats and num_decode_steps must be >= 1")


QUICK_GRID = CalibrationGrid(new_tokens=(16, 64, 256), cached_tokens=(0, 128), shared_prefix_batch_size=2,
                             decode_batch_sizes=(1, 4),
                             decode_context_tokens=(64, 256), num_decode_steps=3, copy_block_counts=(1, 8), repeats=2)


class _StepRecorder:
    """Stands in for the engine's executor (its ModelRunner): records the shape of each batch it executes."""

    def __init__(self, runner, bytes_per_token: int) -> None:
        self.runner = runner
        self._bytes_per_token = bytes_per_token
        self.last_shape: StepShape | None = None

    def execute_step(self, batch, requests, generators):
        self.last_shape = step_shape(batch.requests, batch.copy_ops.num_tokens, self._bytes_per_token)
        return self.runner.execute_step(batch, requests, generators)

    def make_generator(self, params):
        return self.runner.make_generator(params)


@dataclass
class Calibration:
    """The measured steps (shape, seconds) and copies (bytes, seconds)."""

    steps: list[tuple[StepShape, float]]
    copies: list[tuple[int, float]]


def _random_prompt(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(num_tokens)]


def measure(llm, grid: CalibrationGrid, *, seed: int = 0, on_point: Callable[[str], None] = lambda _: None
            ) -> Calibration:
    """Runs the grid through ``llm`` (a kvtool.LLM with block reuse on and a host pool, see
    calibration_llm) and returns every timed step and copy."""
    from kvtool.config import SamplingParams

    engine = llm.engine
    recorder = _StepRecorder(engine.executor, engine.bytes_per_token)
    engine.executor = recorder
    rng = random.Random(seed)
    vocab = min(llm.plan.model_config.vocab_size, 1 << 15)
    max_len = llm.max_seq_len - grid.num_decode_steps - 2
    pool_tokens = llm.pool_sizes.num_primary_blocks * llm.pool_sizes.tokens_per_block
    steps: list[tuple[StepShape, float]] = []

    def submit(requests: list[tuple[list[int], int]]) -> None:
        for prompt, max_tokens in requests:
            engine.add_request(Request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                              ignore_eos=True)))

    def run(requests: list[tuple[list[int], int]], *, later: list[tuple[list[int], int]] = (), timed: bool = True):
        submit(requests)
        num_steps = 0
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            num_steps += 1
            if timed and recorder.last_shape is not None:
                steps.append((recorder.last_shape, seconds))
            if num_steps == 1:
                submit(later)  # a second wave: its contexts run beside decode rows

    run([(_random_prompt(rng, 64, vocab), 2)], timed=False)  # first-use costs
    for _ in range(grid.repeats):
        for cached in grid.cached_tokens:
            for new in grid.new_tokens:
                if cached + new > max_len or new > llm.max_num_tokens or cached + new + 1 > pool_tokens // 2:
                    continue
                on_point(f"context: {new} new tokens after {cached} cached")
                prefix = _random_prompt(rng, cached, vocab)
                if cached:
                    run([(prefix + _random_prompt(rng, 1, vocab), 1)])
                run([(prefix + _random_prompt(rng, new, vocab), 1)])
                batch = grid.shared_prefix_batch_size
                if cached and batch > 1 and new <= 512 and batch * new <= llm.max_num_tokens:
                    # Several chunks reading the same cached prefix in one step (prompts sharing a system prompt).
                    run([(prefix + _random_prompt(rng, new, vocab), 1) for _ in range(batch)])
        for batch_size in grid.decode_batch_sizes:
            for length in grid.decode_context_tokens:
                if (batch_size > llm.max_batch_size or length > max_len
                        or batch_size * (length + grid.num_decode_steps + 1) > pool_tokens):
                    continue
                on_point(f"decode: {batch_size} requests of {length} tokens")
                prompts = [(_random_prompt(rng, length, vocab), 1 + grid.num_decode_steps) for _ in range(batch_size)]
                half = max(1, batch_size // 2)
                run(prompts[:half], later=prompts[half:])
    engine.executor = recorder.runner
    return Calibration(steps, _measure_copies(llm, grid, on_point))


def _measure_copies(llm, grid: CalibrationGrid, on_point: Callable[[str], None]) -> list[tuple[int, float]]:
    """Seconds to offload k blocks to the host pool and to onboard them back, k from the grid."""
    pools = llm.engine.executor.pools
    num_host = llm.pool_sizes.num_secondary_blocks
    block_bytes = llm.pool_sizes.block_bytes
    tokens_per_block = llm.pool_sizes.tokens_per_block
    out = []
    for count in grid.copy_block_counts:
        count = min(count, num_host, llm.pool_sizes.num_primary_blocks)
        if count < 1:
            continue
        on_point(f"copies: {count} blocks each way")
        ids = np.arange(count, dtype=np.int32)
        primary, host = np.zeros(count, np.uint8), np.ones(count, np.uint8)
        tokens = np.full(count, tokens_per_block, np.int32)
        for _ in range(max(grid.repeats, 3)):
            for src, dst in ((primary, host), (host, primary)):
                start = time.perf_counter()
                pools.execute_copies(src, ids, dst, ids, tokens)
                pools.wait_for_all_copies()
                out.append((count * block_bytes, time.perf_counter() - start))
    return out


def fit(calibration: Calibration, *, device: str, plan_digest: str | None, source: str,
        details: dict | None = None) -> CostModel:
    """The cost model: copies fitted first (seconds per byte, through the origin), then the forward's
    terms on the steps with the copies' share taken out; every fourth distinct step shape is held out
    and the error on those is the model's FitReport."""
    copy_rate = 0.0
    if calibration.copies:
        num_bytes = np.array([b for b, _ in calibration.copies], dtype=np.float64)
        seconds = np.array([s for _, s in calibration.copies], dtype=np.float64)
        copy_rate = float(np.sum(num_bytes * seconds) / np.sum(num_bytes * num_bytes))
    by_shape: dict[StepShape, list[float]] = defaultdict(list)
    for shape, seconds in calibration.steps:
        by_shape[shape].append(seconds)
    points = sorted((shape, statistics.median(times)) for shape, times in by_shape.items())
    if len(points) < 8:
        raise ValueError(f"calibration measured only {len(points)} distinct steps: the plan's limits leave no "
                         "room for the grid (raise max_seq_len / max_num_tokens or use a larger grid)")
    held_out = points[3::4]
    fitted = [p for i, p in enumerate(points) if i % 4 != 3]

    def without_copies(pairs):  # the copies' share of each step is known: fit the rest on what remains
        return ([s._replace(num_copied_bytes=0) for s, _ in pairs],
                [t - copy_rate * s.num_copied_bytes for s, t in pairs])

    coefficients, dropped = fit_coefficients(*without_copies(fitted))
    coefficients["copied_byte"] = copy_rate
    report_model = CostModel(device=device, coefficients=coefficients)
    errors = relative_errors(report_model, [s for s, _ in held_out], [t for _, t in held_out])
    report = FitReport(num_fit_points=len(fitted), num_held_out_points=len(held_out),
                       median_abs_error=float(np.median(errors)), p90_abs_error=float(np.percentile(errors, 90)),
                       max_abs_error=float(np.max(errors)), dropped_terms=dropped)
    return CostModel(device=device, coefficients=coefficients, estimated=False, source=source,
                     plan_digest=plan_digest, fit=report,
                     created_at=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                     details=details or {})
