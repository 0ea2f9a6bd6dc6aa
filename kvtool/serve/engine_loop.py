"""The engine on its own thread, and the streams that HTTP handlers read their requests from.

The engine (kvtool.runtime.engine.Engine: the C++ scheduler and the model) is not thread-safe, so
one thread owns it: it adds the requests that handlers submit, steps while any request is
unfinished, and wakes each stream that got a token. Every request of every connection is in the
same scheduler, which batches them as it batches a bench's. Handlers never touch the engine: they
post commands (add, abort, read the counters) to the thread's inbox and await the answer on their
asyncio loop. While nothing runs the thread sleeps in the inbox, so a request is picked up as
soon as it is posted, not at the next poll.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvtool.runtime.engine import Engine
from kvtool.runtime.request import Request

logger = logging.getLogger("kvtool.serve")
T = TypeVar("T")


class Stream:
    """One request as its handler sees it: ``wait`` returns when it has new tokens or finished.

    The engine thread appends tokens to ``request`` and then wakes the stream through the loop,
    so reading ``finished`` before the token count never misses a last token.
    """

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.error: str | None = None  # the engine refused it (error_status 400) or failed while running it
        self.error_status = 500
        self._loop = loop
        self._progress = asyncio.Event()

    def notify(self) -> None:
        """From the engine thread."""
        self._loop.call_soon_threadsafe(self._progress.set)

    async def wait(self) -> None:
        await self._progress.wait()
        self._progress.clear()

    @property
    def finished(self) -> bool:
        return self.request.finished or self.error is not None


@dataclass(frozen=True)
class EngineCounts:
    """What /metrics reads on the engine thread: the cache counters and the scheduler's queues."""

    stats: dict[str, int | float]
    num_running_requests: int
    num_queued_requests: int
    num_aborted_requests: int  # since the start: their clients went away, or the server stopped


class EngineLoop:
    """Owns ``engine`` on a thread from ``start`` until ``stop``."""

    def __init__(self, engine: Engine, *, idle_poll_s: float = 0.5) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[int, Stream] = {}
        self._num_aborted = 0  # read and written on the engine thread only
        self._stopping = threading.Event()
        self._idle_poll_s = idle_poll_s  # how often an idle thread looks at _stopping
        self._thread = threading.Thread(target=self._run, name="kvtool-engine", daemon=True)

    # -- from the asyncio side ------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Aborts what still runs (uvicorn has drained the connections it could) and joins the thread."""
        self._inbox.put(self._abort_all)
        self._stopping.set()
        self._inbox.put(lambda: None)  # wakes an idle thread
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    async def call(self, function: Callable[[], T]) -> T:
        """Runs ``function`` on the engine thread; its result (or exception) comes back here."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(result: object, error: Exception | None) -> None:
            if future.cancelled():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def command() -> None:
            try:
                result = function()
            except Exception as error:  # noqa: BLE001 - handed to the awaiting handler
                loop.call_soon_threadsafe(settle, None, error)
            else:
                loop.call_soon_threadsafe(settle, result, None)

        if not self.alive:
            raise RuntimeError("the server is shutting down")
        self._inbox.put(command)
        return await future

    def problem(self, request: Request) -> str | None:
        """Why the engine would refuse the request (a prompt too long, larger than the KV pool), None if
        it would not. Safe off the engine thread: Engine.request_problem asks a scratch scheduler that
        only this (the asyncio) thread uses, never the engine's own."""
        return self.engine.request_problem(request)

    def submit(self, request: Request) -> Stream:
        """Queues the request in the scheduler without waiting for the engine thread: the handler goes on
        (sends its headers) while the engine computes the prompt, instead of the two taking turns with
        the GIL. Should the engine still refuse it, the stream finishes with the engine's message."""
        if not self.alive:
            raise RuntimeError("the server is shutting down")
        stream = Stream(request, asyncio.get_running_loop())

        def add() -> None:
            try:
                self.engine.add_request(request)
            except ValueError as refused:
                stream.error, stream.error_status = str(refused), 400
                stream.notify()
                return
            self._streams[request.request_id] = stream

        self._inbox.put(add)
        return stream

    def abort(self, stream: Stream) -> None:
        """Frees the request's blocks (its client went away); nothing when it already finished."""
        request = stream.request

        def abort() -> None:  # queued after the add: the request is in the engine or was refused
            if request.request_id in self._streams and not request.finished:
                self.engine.abort_request(request.request_id)
                self._num_aborted += 1
            self._forget(request.request_id)
            stream.notify()  # a handler waiting for the end (not streaming) sees finish_reason "abort"

        self._inbox.put(abort)

    async def counts(self) -> EngineCounts:
        scheduler = self.engine.scheduler
        return await self.call(lambda: EngineCounts(self.engine.get_stats(), scheduler.num_running_requests(),
                                                    scheduler.num_queued_requests(), self._num_aborted))

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished_requests()
            self._run_commands(block=not busy)
            if not self.engine.has_unfinished_requests():
                continue
            try:
                produced = self.engine.step()
            except Exception as error:  # noqa: BLE001 - the requests fail, the server goes on
                logger.exception("the engine failed a step; failing the %d requests in it", len(self._streams))
                self._fail_all(f"the engine failed: {error}")
                continue
            for request in produced:
                stream = self._streams.get(request.request_id)
                if stream is None:
                    continue
                if request.finished:
                    self._forget(request.request_id)
                stream.notify()
        self._run_commands(block=False)

    def _run_commands(self, *, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=self._idle_poll_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _forget(self, request_id: int) -> None:
        self._streams.pop(request_id, None)
        # The engine keeps every request it was given (a bench reads them back); a server would grow without end.
        self.engine.requests.pop(request_id, None)

    def _fail_all(self, message: str) -> None:
        for request_id, stream in list(self._streams.items()):
            if not stream.request.finished:
                try:
                    self.engine.abort_request(request_id)
                except Exception:  # noqa: BLE001 - the scheduler may be what failed; the stream fails anyway
                    logger.exception("could not abort request %d", request_id)
            stream.error = message
            self._forget(request_id)
            stream.notify()

    def _abort_all(self) -> None:
        for request_id, stream in list(self._streams.items()):
            if not stream.request.finished:
                self.engine.abort_request(request_id)
                self._num_aborted += 1
            self._forget(request_id)
            stream.notify()
