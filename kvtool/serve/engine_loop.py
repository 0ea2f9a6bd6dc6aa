"""The engine as one task of the server's event loop, and the streams that handlers read requests from.

One task owns the engine (kvtool.runtime.engine.Engine: the C++ scheduler and the model): while any
request is unfinished it runs a step and wakes the stream of every request that got a token, and
between steps it lets the loop turn a few times, so that handlers write those tokens and new
requests reach the scheduler before the next step. Every request of every connection is in the same scheduler, which batches them as
it batches a bench's.

Why a task and not a thread of its own: measured on a 2-core machine shared with other work, a
thread cost a hand-over each way (the request to the engine thread, the token back to the event
loop's), each waiting for the GIL and for the OS to run the other thread, which added 3-4 ms to
TTFT at concurrency 1. Nothing is lost by stepping on the loop: the scheduler takes new requests
only between steps either way, and the tokens of a step are written right after it. What a step
does block is HTTP I/O during the step (a /metrics scrape waits for the step to end).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvtool.runtime.engine import Engine
from kvtool.runtime.request import Request

logger = logging.getLogger("kvtool.serve")
LOOP_TURNS_PER_STEP = 3  # see EngineLoop._run
T = TypeVar("T")


class Stream:
    """One request as its handler sees it: ``wait`` returns when it has new tokens or finished."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.error: str | None = None  # the engine refused it (error_status 400) or failed while running it
        self.error_status = 500
        self.client_gone = False  # the client disconnected before the end
        self._progress = asyncio.Event()

    def notify(self) -> None:
        self._progress.set()

    async def wait(self) -> None:
        await self._progress.wait()
        self._progress.clear()

    @property
    def finished(self) -> bool:
        return self.request.finished or self.error is not None


@dataclass(frozen=True)
class EngineCounts:
    """What /metrics reads: the cache counters and the scheduler's queues."""

    stats: dict[str, int | float]
    num_running_requests: int
    num_queued_requests: int
    num_aborted_requests: int  # since the start: their clients went away, or the server stopped
    tokens_per_block: int


class EngineLoop:
    """Steps ``engine`` on the running event loop from ``start`` until ``stop``. Every method is called
    on that loop; another thread hands work to it with asyncio.run_coroutine_threadsafe(call(...), loop)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[int, Stream] = {}
        self._num_aborted = 0
        self._work: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._refusal: tuple[str, int] | None = None  # (message, status) every request gets from end_all on

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._work = asyncio.Event()
        self._task = self.loop.create_task(self._run(), name="kvtool-engine")

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Aborts what still runs (uvicorn has drained the connections it could) and ends the task."""
        self._stopping = True
        self._abort_all()
        if self._task is not None:
            self._work.set()
            await asyncio.wait_for(self._task, timeout_s)

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done() and not self._stopping

    async def call(self, function: Callable[[], T]) -> T:
        """``function()`` between two steps (awaitable, so that another thread can schedule it on the loop)."""
        return function()

    def problem(self, request: Request) -> str | None:
        """Why the engine would refuse the request (a prompt too long, larger than the KV pool), None if
        it would not: asks the engine's scratch scheduler, nothing is queued."""
        return self.engine.request_problem(request)

    def submit(self, request: Request) -> Stream:
        """Queues the request in the scheduler; it runs from the next step. Should the engine refuse it,
        the stream finishes at once with the engine's message (error_status 400); after ``end_all``,
        with its message."""
        if not self.alive:
            raise RuntimeError("the server is shutting down")
        stream = Stream(request)
        if self._refusal is not None:
            stream.error, stream.error_status = self._refusal
            stream.notify()
            return stream
        try:
            self.engine.add_request(request)
        except ValueError as refused:
            stream.error, stream.error_status = str(refused), 400
            stream.notify()
            return stream
        self._streams[request.request_id] = stream
        self._work.set()
        return stream

    def abort(self, stream: Stream) -> None:
        """Frees the request's blocks (its client went away); nothing when it already finished."""
        request = stream.request
        if request.request_id in self._streams and not request.finished:
            self.engine.abort_request(request.request_id)
            self._num_aborted += 1
        self._forget(request.request_id)
        stream.notify()  # a handler waiting for the end (not streaming) sees finish_reason "abort"

    async def counts(self) -> EngineCounts:
        scheduler = self.engine.scheduler
        return EngineCounts(self.engine.get_stats(), scheduler.num_running_requests(), scheduler.num_queued_requests(),
                            self._num_aborted, self.engine.tokens_per_block)

    async def _run(self) -> None:
        while not self._stopping:
            if not self.engine.has_unfinished_requests():
                self._work.clear()
                await self._work.wait()
                continue
            # A few turns of the loop before each step: a request that arrived during the last step is
            # read in one turn and reaches the scheduler in the next (its handler is a new task), so it
            # joins this step instead of waiting two more; the tokens of the last step are written.
            # With nothing to do, a turn costs microseconds.
            for _ in range(LOOP_TURNS_PER_STEP):
                await asyncio.sleep(0)
            try:
                produced = self.engine.step()
            except Exception as error:  # noqa: BLE001 - the requests fail, the server goes on
                logger.exception("the engine failed a step; failing the %d requests in it", len(self._streams))
                self._fail_all(f"the engine failed: {error}", status=500)
                produced = []
            for request in produced:
                stream = self._streams.get(request.request_id)
                if stream is None:
                    continue
                if request.finished:
                    self._forget(request.request_id)
                stream.notify()

    def _forget(self, request_id: int) -> None:
        self._streams.pop(request_id, None)

    def end_all(self, message: str, *, status: int) -> None:
        """Ends every request with ``message`` (its stream's error, with ``status``), and every request
        submitted from now on (the server is shutting down)."""
        self._refusal = (message, status)
        self._fail_all(message, status=status)

    def _fail_all(self, message: str, *, status: int) -> None:
        for request_id, stream in list(self._streams.items()):
            if not stream.request.finished:
                try:
                    self.engine.abort_request(request_id)
                    self._num_aborted += 1
                except Exception:  # noqa: BLE001 - the scheduler may be what failed; the stream fails anyway
                    logger.exception("could not abort request %d", request_id)
            stream.error, stream.error_status = message, status
            self._forget(request_id)
            stream.notify()

    def _abort_all(self) -> None:
        for stream in list(self._streams.values()):
            self.abort(stream)
