"""Draining on Ctrl-C or SIGTERM: running requests finish, new ones get 503, the rest end with an error.

The gate (ASGI middleware around the app) counts the API requests in flight, from the first byte of
the request to the last byte of its answer, and once the drain has begun answers new ones 503
(the listener stays open meanwhile, so a client learns why instead of finding the port closed;
/health says 503 too, so a load balancer stops sending). The drain waits up to its grace period
for the count to reach zero. Then it ends what is left: the engine's requests with a 503 error (a
stream gets OpenAI's error object as an event and ``data: [DONE]``, a whole answer is a 503), and
a handler still tokenizing a large body answers 503 at once. uvicorn then waits a moment for those
answers to be written, closes the connections and the engine task stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

from fastapi.responses import JSONResponse

from kvtool.serve import protocol
from kvtool.serve.engine_loop import EngineLoop
from kvtool.serve.prompts import ApiError

logger = logging.getLogger("kvtool.serve")
POLL_S = 0.02  # how often the drain looks at the count; an answer's last byte is written meanwhile anyway
SHUTTING_DOWN = "the server is shutting down: send the request to another server, or again once it is back"
T = TypeVar("T")


class Drain:
    """The API requests in flight and, from ``run``, the drain of one app."""

    def __init__(self, engine_loop: EngineLoop) -> None:
        self.engine_loop = engine_loop
        self.draining = False
        self.num_open = 0  # API requests between their first byte and their answer's last
        self.num_refused = 0  # API requests answered 503 because the drain had begun
        self._cut = asyncio.Event()  # set when the grace period is over
        self._cut_message = SHUTTING_DOWN

    async def unless_cut(self, future: asyncio.Future[T]) -> T:
        """``future``'s result; ApiError 503 if the grace period ends first (the work goes on unread)."""
        cut = asyncio.ensure_future(self._cut.wait())
        try:
            await asyncio.wait((future, cut), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this request's task was cancelled: so is its work
            future.cancel()
            raise
        finally:
            cut.cancel()
        if not future.done():
            future.cancel()
            raise ApiError(self._cut_message, status=503)
        return future.result()

    async def run(self, *, timeout_s: float, flush_timeout_s: float, reason: str, cut_now: Callable[[], bool]) -> None:
        """Waits up to ``timeout_s`` for the open requests (or until ``cut_now()``), ends the rest and waits up to
        ``flush_timeout_s`` more for their answers to be written; logs one line."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.draining = True
        num_open = self.num_open
        await self._until_closed(timeout_s, cut_now)
        num_cut = self.num_open
        if num_cut:
            self._cut_message = (f"the server is shutting down: the request was ended after the {timeout_s:g} s grace "
                                 "period; send it again to another server")
            self._cut.set()
            self.engine_loop.end_all(self._cut_message, status=503)
            await self._until_closed(flush_timeout_s, cut_now)
        outcome = "no request in flight"
        if num_open:
            outcome = (f"{num_open - num_cut} of {num_open} requests in flight finished, {num_cut} ended with an "
                       f"error after the {timeout_s:g} s grace period (--shutdown_timeout)")
        logger.info("%s: drained in %.1f s: %s; %d new requests refused (503)", reason, loop.time() - start, outcome,
                    self.num_refused)

    async def _until_closed(self, timeout_s: float, cut_now: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.num_open and loop.time() < deadline and not cut_now():
            await asyncio.sleep(POLL_S)


class RequestGate:
    """ASGI middleware: counts the API requests of ``drain``; once it drains, answers new ones 503."""

    def __init__(self, app, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not protocol.is_api_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        drain = self.drain
        if drain.draining:
            drain.num_refused += 1
            await JSONResponse(protocol.error_body(SHUTTING_DOWN, status=503), status_code=503)(scope, receive, send)
            return
        drain.num_open += 1
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if not drain.draining:
                raise
            # uvicorn cancels what is left a moment after the drain (a client that stopped reading its
            # answer): the connection is closed, which is the whole story; no traceback for it.
            logger.warning("closed a connection whose client did not read its answer during shutdown")
        finally:
            drain.num_open -= 1
