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
from collections import deque
from collections.abc import Callable, Sequence

from kvtool.bench.target import TargetEngine
from kvtool.config import ReplayOptions
from kvtool.errors import DatasetError
from kvtool.runtime.clock import WALL_CLOCK, Clock
from kvtool.runtime.request import Request


def rate_due_times(num_requests: int, request_rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Seconds after the start: 0, then gaps of mean 1/request_rate, exponential (a Poisson process) or,
    with ``burstiness`` other than 1, gamma-distributed of that shape, as vllm bench serve draws them:
    their coefficient of variation is 1/sqrt(burstiness), burstier below 1 and more even above."""
    rng = random.Random(seed)
    due, now = [], 0.0
    for position in range(num_requests):
        if position:
            now += (rng.expovariate(request_rate) if burstiness == 1 else
                    rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)))
        due.append(now)
    return due


def session_key(request: Request) -> tuple[str, int] | None:
    line = request.line
    return None if line is None or line.session_id is None else (line.session_id, line.turn)


def entry_requests(requests: Sequence[Request]) -> list[Request]:
    """The requests issued on their own: all but the session turns whose previous turn is among
    ``requests`` (those are issued when it finishes)."""
    in_run = {session_key(r) for r in requests if session_key(r) is not None}
    return [r for r in requests if session_key(r) is None or (session_key(r)[0], session_key(r)[1] - 1) not in in_run]


def check_arrival_times(options: ReplayOptions, measured: Sequence[Request]) -> None:
    """In trace mode every measured request that does not wait for a previous turn must have an arrival
    time (a DatasetError names the first without one); a time_scale needs one at least."""
    entries = entry_requests(measured)
    timed = [r.line is not None and r.line.arrival_time_s is not None for r in entries]
    if options.mode == "trace" and not all(timed):
        raise DatasetError(f"{entries[timed.index(False)].where}: no arrival_time_s, but --mode trace replays each "
                           "request at its arrival time: import a trace with `kvtool dataset import`, or use --mode "
                           "offline")
    if options.time_scale != 1 and not any(timed):
        raise DatasetError(f"--time_scale {options.time_scale:g} scales the dataset's arrival_time_s, but no measured "
                           "request has one: leave out --time_scale, or import a trace with `kvtool dataset import`")


class RequestRefused(DatasetError):
    """The engine refused a request in the middle of a run (the replay records an error row)."""


class Replayer:
    """Replays requests through one engine. Session history persists across runs, so a warm-up
    run can start a session that the measured run continues."""

    def __init__(self, engine: TargetEngine, options: ReplayOptions, *, clock: Clock = WALL_CLOCK) -> None:
        self.engine = engine
        self.options = options
        self.clock = clock  # a simulation's clock jumps to a timed arrival instead of sleeping
        # session_id -> (its last turn's prompt + generated answer, matching extra ids or None)
        self._history: dict[str, tuple[list[int], list[int] | None]] = {}

    def run(self, requests: Sequence[Request], on_finish: Callable[[Request, float], None], *,
            timed: bool = True) -> float:
        """Replays the requests to completion and returns the clock value the run started at.

        ``on_finish(request, start)`` is called as each finishes (or is refused). ``timed=False``
        ignores request rate and arrival times (warm-up). KeyboardInterrupt propagates; on_finish
        has been called for every request finished before it.
        """
        start = self.clock.now()
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
            now = self.clock.now()
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
                    self.clock.sleep(max(0.0, start + queue[0][0] - self.clock.now()))
                continue  # (or every request left was refused)
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"the engine reports no unfinished request while {len(in_flight)} are in flight")
            can_issue = limit is None or len(in_flight) < limit
            next_due = start + queue[0][0] if can_issue and queue and queue[0][0] is not None else None
            for request in self._run_until(next_due):
                if not request.finished or in_flight.pop(request.request_id, None) is None:
                    continue
                self._remember_session(request)
                key = session_key(request)
                if key in followups:
                    ready.append(followups.pop(key))
                on_finish(request, start)
        return start

    def _run_until(self, next_due: float | None) -> list[Request]:
        """The engine's steps until one finishes a request or the clock reaches ``next_due`` (the next request
        to issue: None, only a finish lets one be issued): an engine that can (kvtool.runtime.engine.Engine.
        step_until; a simulation runs them in C++) takes them in one call, another one step per call, the
        replay checking after each what it can issue."""
        step_until = getattr(self.engine, "step_until", None)
        return self.engine.step() if step_until is None else step_until(next_due)

    def _due_times(self, entries: Sequence[Request], timed: bool) -> list[float | None]:
        if not timed:
            return [None] * len(entries)
        if self.options.request_rate is not None:
            return rate_due_times(len(entries), self.options.request_rate, self.options.seed,
                                  self.options.burstiness)
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
