"""Drives the engine through a dataset in one of the replay modes.

Every request has a *due* time and the number of requests in flight has a limit:

- offline: every request is due at the start, no limit (all queued at t0);
- sequential: limit 1 (the next request is handed over when the previous one finishes);
- ``concurrency`` N: limit N (a new request is handed over as soon as one finishes);
- ``request_rate`` R: due times are a Poisson process of rate R per second (exponential gaps,
  seeded), starting at 0; a concurrency limit may be combined with it;
- dataset ``arrival_time_s``: the line is due at that offset (ignored with a request rate).

A request is handed to the engine once it is due and the limit allows; its arrival time is
its due time when due times are timed (request rate, ``arrival_time_s``), else the moment it
is handed over. Multi-turn sessions are issued turn after turn inside any mode: a later turn
becomes ready when the previous turn finishes, its prompt is the previous turn's prompt + the
generated answer + the line's new tokens, and it arrives when it is handed over. Ready later
turns go before new requests (a client finishes its conversation), and the loop calls
engine.step() until every request has finished.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvtool.bench.datasets import Dataset, DatasetRecord
from kvtool.config import SamplingParams, check
from kvtool.errors import DatasetError
from kvtool.runtime.request import RequestRecord

MODES = ("offline", "sequential")


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
        check(self.warmup >= 0, self, "warmup", f"must be >= 0 requests, got {self.warmup}")
        check(self.num_requests is None or self.num_requests >= 1, self, "num_requests",
              f"must be a positive integer, got {self.num_requests}")

    @property
    def max_in_flight(self) -> int | None:
        """The in-flight limit (None: unlimited)."""
        return 1 if self.mode == "sequential" else self.concurrency

    def split(self, items: Sequence) -> tuple[list, list]:
        """(warm-up, measured) items of a run."""
        measured = list(items[self.warmup:])
        if self.num_requests is not None:
            measured = measured[:self.num_requests]
        return list(items[:self.warmup]), measured

    def describe(self) -> str:
        parts = [self.mode] if self.concurrency is None else [f"concurrency={self.concurrency}"]
        if self.request_rate is not None:
            parts.append(f"rate={self.request_rate:g}/s")
        return ",".join(parts)


@dataclass(frozen=True)
class ReplayItem:
    """A dataset line ready to replay: its new tokens are tokenized and checked against the vocabulary."""

    index: int                   # position in the dataset (0-based)
    record: DatasetRecord
    request_id: str              # the id reports use: the line's request_id/task_id, else its position
    new_token_ids: tuple[int, ...]
    new_extra_ids: tuple[int, ...] | None
    where: str                   # '<file> line <n>', for error messages

    @property
    def session_key(self) -> tuple[str, int] | None:
        record = self.record
        return None if record.session_id is None else (record.session_id, record.turn)


class FinishedRequest(NamedTuple):
    """What the replay reports when a request finishes."""

    item: ReplayItem
    record: RequestRecord
    bench_start: float           # the clock value the run started at


def prepare_items(dataset: Dataset, *, tokenizer) -> list[ReplayItem]:
    """Tokenizes text prompts (kvtool.bench.precheck checks the result against the model)."""
    items = []
    bos_token_id = getattr(tokenizer, "bos_token_id", None)
    sessions_seen: set[str] = set()
    for index, record in enumerate(dataset.records):
        where = dataset.where(record)
        if record.input_ids is not None:
            token_ids = record.input_ids
        else:
            token_ids = tuple(int(t) for t in tokenizer.encode(record.prompt)) if record.prompt else ()
            if record.session_id in sessions_seen and bos_token_id is not None and token_ids[:1] == (bos_token_id,):
                # A later turn continues the conversation: no second beginning-of-sequence token mid-prompt.
                token_ids = token_ids[1:]
        if record.session_id is not None:
            sessions_seen.add(record.session_id)
        items.append(ReplayItem(index=index, record=record,
                                request_id=record.request_id if record.request_id is not None else str(index),
                                new_token_ids=tuple(token_ids), new_extra_ids=record.extra_ids, where=where))
    return items


def poisson_due_times(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start: 0, then exponential gaps of mean 1/request_rate."""
    rng = random.Random(seed)
    due, now = [], 0.0
    for position in range(num_requests):
        if position:
            now += rng.expovariate(request_rate)
        due.append(now)
    return due


def sampling_params_for(record: DatasetRecord) -> SamplingParams:
    """Bench requests always generate exactly output_tokens tokens, greedily (as trtllm-bench does)."""
    extra = {}
    if record.priority is not None:
        extra["priority"] = record.priority
    return SamplingParams(max_tokens=record.output_tokens, temperature=0.0, ignore_eos=True,
                          cache_salt=record.cache_salt, **extra)


class RequestRefused(DatasetError):
    """The engine refused a request in the middle of a run (the replay records an error row)."""


class _Pending(NamedTuple):
    item: ReplayItem
    due: float | None            # seconds after the start; None: untimed (arrives when handed over)


class Replayer:
    """Replays items through one engine. Session history and request ids persist across runs,
    so a warm-up run can start a session that the measured run continues."""

    def __init__(self, engine, options: ReplayOptions, *, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.engine = engine
        self.options = options
        self.clock = clock
        self.sleep = sleep
        self._next_engine_id = 0
        # session_id -> (full prompt + generated answer, matching extra ids or None), after its last turn
        self._history: dict[str, tuple[list[int], list[int] | None]] = {}
        self._prompts: dict[int, tuple[list[int], list[int] | None]] = {}

    def run(self, items: Sequence[ReplayItem], on_finish: Callable[[FinishedRequest], None], *,
            timed: bool = True) -> float:
        """Replays items to completion and returns the clock value the run started at.

        ``timed=False`` ignores request rate and arrival times (warm-up). KeyboardInterrupt
        propagates; on_finish has been called for every request finished before it.
        """
        start = self.clock()
        in_run = {item.session_key for item in items if item.session_key is not None}
        entries: list[ReplayItem] = []
        followups: dict[tuple[str, int], ReplayItem] = {}  # keyed by the turn they wait for
        for item in items:
            record = item.record
            previous = None if record.session_id is None else (record.session_id, record.turn - 1)
            if previous is not None and previous in in_run:
                followups[previous] = item
            else:
                entries.append(item)
        pending = [_Pending(item, due) for item, due in zip(entries, self._due_times(entries, timed))]
        queue = deque(sorted(pending, key=lambda p: 0.0 if p.due is None else p.due))  # stable: file order
        ready: deque[ReplayItem] = deque()
        in_flight: dict[int, ReplayItem] = {}
        limit = self.options.max_in_flight

        while queue or ready or in_flight:
            now = self.clock()
            while limit is None or len(in_flight) < limit:
                if ready:
                    item, arrival = ready.popleft(), now
                elif queue and (queue[0].due is None or start + queue[0].due <= now):
                    pending = queue.popleft()
                    item, arrival = pending.item, now if pending.due is None else start + pending.due
                else:
                    break
                try:
                    in_flight[self._issue(item, arrival)] = item
                except RequestRefused as refused:
                    # An error row; the run goes on (a later turn of the session cannot be sent either).
                    self._report_refused(item, arrival, str(refused), start, followups, on_finish)
            if not in_flight:
                if queue:  # nothing to run until the next request is due
                    self.sleep(max(0.0, start + queue[0].due - self.clock()))
                continue  # (or every request left was refused)
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"the engine reports no unfinished request while {len(in_flight)} are in flight")
            for output in self.engine.step():
                if not output.finished or output.request_id not in in_flight:
                    continue
                item = in_flight.pop(output.request_id)
                record = self.engine.records[output.request_id]
                self._remember_session(item, output.request_id, record)
                if item.session_key in followups:
                    ready.append(followups.pop(item.session_key))
                on_finish(FinishedRequest(item, record, start))
        return start

    def _due_times(self, entries: Sequence[ReplayItem], timed: bool) -> list[float | None]:
        if not timed:
            return [None] * len(entries)
        if self.options.request_rate is not None:
            return poisson_due_times(len(entries), self.options.request_rate, self.options.seed)
        arrivals = [item.record.arrival_time_s for item in entries]
        if all(arrival is None for arrival in arrivals):
            return arrivals
        return [0.0 if arrival is None else arrival for arrival in arrivals]

    def _prompt_for(self, item: ReplayItem) -> tuple[list[int], list[int] | None]:
        new_ids, new_extra = list(item.new_token_ids), item.new_extra_ids
        record = item.record
        if record.session_id is None or record.session_id not in self._history:
            return new_ids, None if new_extra is None else list(new_extra)
        history_ids, history_extra = self._history[record.session_id]
        if history_extra is None and new_extra is None:
            return history_ids + new_ids, None
        # Extra ids are per token: 0 (a normal token) wherever a part has none.
        extra = (history_extra or [0] * len(history_ids)) + (list(new_extra) if new_extra else [0] * len(new_ids))
        return history_ids + new_ids, extra

    def _issue(self, item: ReplayItem, arrival: float) -> int:
        prompt_ids, extra_ids = self._prompt_for(item)
        engine_id = self._next_engine_id
        self._next_engine_id += 1
        try:
            self.engine.add_request(engine_id, prompt_ids, sampling_params_for(item.record),
                                    extra_ids=extra_ids, arrival_time=arrival)
        except ValueError as error:
            raise RequestRefused(f"{item.where}: the engine refused the request ({len(prompt_ids)} prompt tokens): "
                                 f"{error}") from None
        self._prompts[engine_id] = (prompt_ids, extra_ids)
        return engine_id

    def _report_refused(self, item: ReplayItem, arrival: float, message: str, start: float,
                        followups: dict[tuple[str, int], ReplayItem],
                        on_finish: Callable[[FinishedRequest], None]) -> None:
        prompt_ids, _ = self._prompt_for(item)
        record = RequestRecord(request_id=-1, arrival_time=arrival, num_prompt_tokens=len(prompt_ids),
                               finish_reason="error", error=message)
        on_finish(FinishedRequest(item, record, start))
        later = followups.pop(item.session_key, None) if item.session_key is not None else None
        if later is not None:
            self._report_refused(later, arrival, f"{later.where}: not sent: turn {item.record.turn} of session "
                                 f"{item.record.session_id!r} failed", start, followups, on_finish)

    def _remember_session(self, item: ReplayItem, engine_id: int, record: RequestRecord) -> None:
        prompt_ids, extra_ids = self._prompts.pop(engine_id)
        session_id = item.record.session_id
        if session_id is None:
            return
        answer = [int(t) for t in record.output_token_ids]
        self._history[session_id] = (prompt_ids + answer,
                                     None if extra_ids is None else extra_ids + [0] * len(answer))
