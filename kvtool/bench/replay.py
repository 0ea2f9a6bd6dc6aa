"""Drives the engine through a dataset's requests in one of the replay modes.

Each request is handed to the engine once it is due (offline: at the start; request rate: a seeded
Poisson process; a line's ``arrival_time_s``) and the in-flight limit allows (sequential: 1;
concurrency N). A later session turn waits for the previous turn and extends its prompt with it.

``trace`` replays a recorded trace (`kvtool dataset import`): every request not waiting for a
previous turn must have an ``arrival_time_s``, the earliest is due at the start and each other that
many seconds after it, times ``time_scale`` (0.5: twice as fast), with no in-flight limit unless
--concurrency caps it. Offline and sequential replays honour arrival times too where lines have them
(as offsets from the start, a line without one due at the start), so ``trace`` differs by
requiring them, starting at the first, and naming what the run measures.
The rules, and what "arrival" means for TTFT: docs/architecture.md#how-bench-measures.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtool.workloads.datasets import Dataset, DatasetRecord
from kvtool.bench.interface import BenchEngine
from kvtool.config import SamplingParams, check
from kvtool.errors import DatasetError
from kvtool.runtime.request import Request

MODES = ("offline", "sequential", "trace")


@dataclass(frozen=True)
class ReplayOptions:
    """How a run hands its dataset to the engine (see the module docstring), and which lines it
    measures: the first ``warmup`` run first, uncounted, then at most ``num_requests``."""

    mode: str = "offline"
    concurrency: int | None = None
    request_rate: float | None = None
    seed: int = 0
    warmup: int = 0
    warmup_counts_in_stats: bool = False  # keep the warm-up's cache counters
    num_requests: int | None = None
    time_scale: float = 1.0  # arrival times are multiplied by it

    def __post_init__(self) -> None:
        mode = str(self.mode).lower()
        check(mode in MODES, self, "mode", f"{self.mode!r} is unknown: use one of {list(MODES)} "
              "(and --concurrency N / --request_rate R for the other replay patterns)")
        object.__setattr__(self, "mode", mode)
        check(self.concurrency is None or self.concurrency >= 1, self, "concurrency",
              f"must be >= 1, got {self.concurrency}")
        check(mode != "sequential" or self.concurrency in (None, 1), self, "mode",
              f"sequential keeps one request in flight; it contradicts concurrency {self.concurrency}: "
              "drop one of them")
        check(self.request_rate is None or self.request_rate > 0, self, "request_rate",
              f"must be > 0 requests per second, got {self.request_rate}")
        check(mode != "trace" or self.request_rate is None, self, "mode",
              f"trace replays the dataset's arrival times; it contradicts request_rate {self.request_rate}: drop one "
              "of them")
        check(isinstance(self.time_scale, (int, float)) and not isinstance(self.time_scale, bool)
              and 0 < self.time_scale < float("inf"), self, "time_scale",
              f"must be a number > 0 (0.5 replays twice as fast, 2 half as fast), got {self.time_scale!r}")
        check(self.time_scale == 1 or self.request_rate is None, self, "time_scale",
              f"scales the dataset's arrival times, but request_rate {self.request_rate} draws its own: drop one of "
              "them")
        check(self.warmup >= 0, self, "warmup", f"must be >= 0 requests, got {self.warmup}")
        check(self.num_requests is None or self.num_requests >= 1, self, "num_requests",
              f"must be a positive integer, got {self.num_requests}")

    @property
    def max_in_flight(self) -> int | None:
        """The in-flight limit (None: unlimited)."""
        return 1 if self.mode == "sequential" else self.concurrency

    def split(self, items: Sequence) -> tuple[list, list]:
        """(warm-up, measured) items of a run. In trace mode every measured request that does not wait
        for a previous turn must have an arrival time (a DatasetError names the first without one);
        a time_scale needs one at least."""
        measured = list(items[self.warmup:])
        if self.num_requests is not None:
            measured = measured[:self.num_requests]
        timed = [r.line is not None and r.line.arrival_time_s is not None for r in entry_requests(measured)]
        if self.mode == "trace" and not all(timed):
            untimed = entry_requests(measured)[timed.index(False)]
            raise DatasetError(f"{untimed.where}: no arrival_time_s, but --mode trace replays each request at its "
                               "arrival time: import a trace with `kvtool dataset import`, or use --mode offline")
        if self.time_scale != 1 and not any(timed):
            raise DatasetError(f"--time_scale {self.time_scale:g} scales the dataset's arrival_time_s, but no measured "
                               "request has one: leave out --time_scale, or import a trace with `kvtool dataset import`")
        return list(items[:self.warmup]), measured

    def describe(self) -> str:
        parts = [self.mode] if self.concurrency is None else [f"concurrency={self.concurrency}"]
        if self.mode == "trace" and self.concurrency is not None:
            parts.insert(0, "trace")
        if self.request_rate is not None:
            parts.append(f"rate={self.request_rate:g}/s")
        if self.time_scale != 1:
            parts.append(f"time_scale={self.time_scale:g}")
        return ",".join(parts)


def bench_requests(dataset: Dataset, *, tokenizer) -> list[Request]:
    """A request per dataset line, text prompts tokenized (kvtool.bench.precheck checks them
    against the model). A later session turn holds only its new tokens until it is issued."""
    requests = []
    # Not every tokenizer has one (a Hugging Face tokenizer adds it itself).
    bos_token_id = getattr(tokenizer, "bos_token_id", None)
    sessions_seen: set[str] = set()
    # Lines alike share one SamplingParams (nothing changes it): building one costs more than the rest
    # of a request here.
    shared_params: dict[tuple, SamplingParams] = {}
    for index, line in enumerate(dataset.records):
        if line.input_ids is not None:
            # The record's tuple itself: copying 2k ids costs about 40 µs (a refcount write per id).
            token_ids = line.input_ids
        else:
            token_ids = [int(t) for t in tokenizer.encode(line.prompt)] if line.prompt else []
            if line.session_id in sessions_seen and bos_token_id is not None and token_ids[:1] == [bos_token_id]:
                # A later turn continues the conversation: no second beginning-of-sequence token mid-prompt.
                token_ids = token_ids[1:]
        if line.session_id is not None:
            sessions_seen.add(line.session_id)
        key = (line.output_tokens, line.cache_salt, line.priority)
        if key not in shared_params:
            shared_params[key] = sampling_params_for(line)
        requests.append(Request(token_ids, shared_params[key],
                                None if line.extra_ids is None else list(line.extra_ids), line=line,
                                name=line.request_id if line.request_id is not None else str(index),
                                where=dataset.where(line)))
    return requests


def poisson_due_times(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start: 0, then exponential gaps of mean 1/request_rate."""
    rng = random.Random(seed)
    due, now = [], 0.0
    for position in range(num_requests):
        if position:
            now += rng.expovariate(request_rate)
        due.append(now)
    return due


def sampling_params_for(line: DatasetRecord) -> SamplingParams:
    """Bench requests always generate exactly output_tokens tokens, greedily (as trtllm-bench does)."""
    extra = {}
    if line.priority is not None:
        extra["priority"] = line.priority
    return SamplingParams(max_tokens=line.output_tokens, temperature=0.0, ignore_eos=True,
                          cache_salt=line.cache_salt, **extra)


def session_key(request: Request) -> tuple[str, int] | None:
    line = request.line
    return None if line is None or line.session_id is None else (line.session_id, line.turn)


def entry_requests(requests: Sequence[Request]) -> list[Request]:
    """The requests issued on their own: all but the session turns whose previous turn is among
    ``requests`` (those are issued when it finishes)."""
    in_run = {session_key(r) for r in requests if session_key(r) is not None}
    return [r for r in requests if session_key(r) is None or (session_key(r)[0], session_key(r)[1] - 1) not in in_run]


class RequestRefused(DatasetError):
    """The engine refused a request in the middle of a run (the replay records an error row)."""


class Replayer:
    """Replays requests through one engine. Session history persists across runs, so a warm-up
    run can start a session that the measured run continues."""

    def __init__(self, engine: BenchEngine, options: ReplayOptions, *, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.engine = engine
        self.options = options
        self.clock = clock
        self.sleep = sleep
        # session_id -> (its last turn's prompt + generated answer, matching extra ids or None)
        self._history: dict[str, tuple[list[int], list[int] | None]] = {}

    def run(self, requests: Sequence[Request], on_finish: Callable[[Request, float], None], *,
            timed: bool = True) -> float:
        """Replays the requests to completion and returns the clock value the run started at.

        ``on_finish(request, start)`` is called as each finishes (or is refused). ``timed=False``
        ignores request rate and arrival times (warm-up). KeyboardInterrupt propagates; on_finish
        has been called for every request finished before it.
        """
        start = self.clock()
        entries = entry_requests(requests)
        entry_ids = set(map(id, entries))
        # The later turns, keyed by the turn they wait for.
        followups: dict[tuple[str, int], Request] = {
            (session_key(r)[0], session_key(r)[1] - 1): r for r in requests if id(r) not in entry_ids}
        # (seconds after the start it is due, or None: when handed over; the request), in file order.
        due = sorted(zip(self._due_times(entries, timed), entries), key=lambda p: 0.0 if p[0] is None else p[0])
        queue = deque(due)
        ready: deque[Request] = deque()
        in_flight: dict[int, Request] = {}
        limit = self.options.max_in_flight

        while queue or ready or in_flight:
            now = self.clock()
            while limit is None or len(in_flight) < limit:
                if ready:
                    request, arrival = ready.popleft(), now
                elif queue and (queue[0][0] is None or start + queue[0][0] <= now):
                    due_s, request = queue.popleft()
                    arrival = now if due_s is None else start + due_s
                else:
                    break
                try:
                    self._issue(request, arrival)
                    in_flight[request.request_id] = request
                except RequestRefused as refused:
                    # An error row; the run goes on (a later turn of the session cannot be sent either).
                    self._report_refused(request, arrival, str(refused), start, followups, on_finish)
            if not in_flight:
                if queue:  # nothing to run until the next request is due
                    self.sleep(max(0.0, start + queue[0][0] - self.clock()))
                continue  # (or every request left was refused)
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"the engine reports no unfinished request while {len(in_flight)} are in flight")
            for request in self.engine.step():
                if not request.finished or in_flight.pop(request.request_id, None) is None:
                    continue
                self._remember_session(request)
                key = session_key(request)
                if key in followups:
                    ready.append(followups.pop(key))
                on_finish(request, start)
        return start

    def _due_times(self, entries: Sequence[Request], timed: bool) -> list[float | None]:
        if not timed:
            return [None] * len(entries)
        if self.options.request_rate is not None:
            return poisson_due_times(len(entries), self.options.request_rate, self.options.seed)
        arrivals = [None if r.line is None else r.line.arrival_time_s for r in entries]
        if all(arrival is None for arrival in arrivals):
            return arrivals
        first = min(a for a in arrivals if a is not None) if self.options.mode == "trace" else 0.0
        scale = self.options.time_scale
        return [0.0 if arrival is None else (arrival - first) * scale for arrival in arrivals]

    def _with_history(self, request: Request) -> None:
        """Prepends a later session turn's conversation so far to its new tokens."""
        line = request.line
        if line is None or line.session_id not in self._history:
            return
        history_ids, history_extra = self._history[line.session_id]
        new_ids, new_extra = request.prompt_token_ids, request.extra_ids
        if history_extra is not None or new_extra is not None:
            # Extra ids are per token: 0 (a normal token) wherever a part has none.
            request.extra_ids = (history_extra or [0] * len(history_ids)) + (new_extra or [0] * len(new_ids))
        request.prompt_token_ids = history_ids + list(new_ids)

    def _issue(self, request: Request, arrival: float) -> None:
        self._with_history(request)
        request.arrival_time = arrival
        try:
            self.engine.add_request(request)
        except ValueError as error:
            raise RequestRefused(f"{request.where}: the engine refused the request ({request.num_prompt_tokens} "
                                 f"prompt tokens): {error}") from None

    def _report_refused(self, request: Request, arrival: float, message: str, start: float,
                        followups: dict[tuple[str, int], Request],
                        on_finish: Callable[[Request, float], None]) -> None:
        request.arrival_time, request.finish_reason, request.error = arrival, "error", message
        on_finish(request, start)
        key = session_key(request)
        later = followups.pop(key, None) if key is not None else None
        if later is not None:
            self._with_history(later)
            self._report_refused(later, arrival, f"{later.where}: not sent: turn {key[1]} of session {key[0]!r} "
                                 "failed", start, followups, on_finish)

    def _remember_session(self, request: Request) -> None:
        key = session_key(request)
        if key is None:
            return
        answer = [int(t) for t in request.output_token_ids]
        extra = None if request.extra_ids is None else request.extra_ids + [0] * len(answer)
        self._history[key[0]] = (list(request.prompt_token_ids) + answer, extra)
