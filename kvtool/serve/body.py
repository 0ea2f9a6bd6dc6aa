"""A request body: read within the server's size limit, then parsed, validated and tokenized, off the
event loop when it is large.

The limit (--max_request_bytes) is checked against Content-Length before a byte of the body is read
(a client that sent ``Expect: 100-continue``, as curl does for large bodies, never sends it), and
against what has arrived while a chunked body is read. Either way the answer is a 413 in OpenAI's
error format; the rest of such a body is discarded by uvicorn as it arrives, never kept.

Parsing a multi-megabyte body and tokenizing its prompt take long enough (seconds with a slow
tokenizer) to stall every other connection if done on the event loop, which also runs the engine.
A body over ``INLINE_BYTES`` is prepared in one worker thread, in the order the bodies arrived;
a smaller one on the loop, where it costs less than an engine step already blocks it and saves the
hand-over to a thread and back (a few ms on a busy 2-core machine, see engine_loop.py). Only the
preparation moves: the engine is still driven from the event loop alone, so scheduling stays as
deterministic as before.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pydantic import ValidationError
from starlette.requests import Request as HttpRequest

from kvtool.serve import protocol
from kvtool.serve.drain import Drain
from kvtool.serve.prompts import ApiError
from kvtool.units import format_bytes

INLINE_BYTES = 64 << 10
T = TypeVar("T")


class BodyReader:
    """Reads the bodies of one app and runs their preparation (``prepare(body bytes)``)."""

    def __init__(self, max_request_bytes: int, drain: Drain) -> None:
        self.max_request_bytes = max_request_bytes
        self.drain = drain
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtool-prepare")

    async def prepare(self, raw: HttpRequest, prepare: Callable[[bytes], T]) -> T:
        data = await self.read(raw)
        if len(data) <= INLINE_BYTES:
            return prepare(data)
        return await self.drain.unless_cut(asyncio.get_running_loop().run_in_executor(self._executor, prepare, data))

    async def read(self, raw: HttpRequest) -> bytes:
        declared = raw.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            raise self._too_large(f"the request body is {int(declared):,} bytes ({format_bytes(int(declared))})")
        data = bytearray()
        if await self._receive(raw, data):  # the whole body came at once, as a small one does
            return bytes(data)
        # A body still on its way when the grace period of a shutdown ends is not waited for.
        return await self.drain.unless_cut(asyncio.ensure_future(self._receive_rest(raw, data)))

    async def _receive_rest(self, raw: HttpRequest, data: bytearray) -> bytes:
        while not await self._receive(raw, data):
            pass
        return bytes(data)

    async def _receive(self, raw: HttpRequest, data: bytearray) -> bool:
        """Adds the next piece of the body to ``data``; True if it was the last."""
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            # Nobody reads the answer; the status only keeps the log quiet (no traceback for a client gone).
            raise ApiError("the client disconnected before sending the whole body", status=400)
        data += message.get("body", b"")
        if len(data) > self.max_request_bytes:
            raise self._too_large(f"the request body (chunked) reached {len(data):,} bytes")
        return not message.get("more_body", False)

    def _too_large(self, what: str) -> ApiError:
        return ApiError(f"{what}, over this server's limit of {format_bytes(self.max_request_bytes)}: send a shorter "
                        "prompt, or start kvtool serve with a larger --max_request_bytes", status=413)

    def close(self) -> None:
        """Drops queued preparations; one already running finishes in its thread, unread."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def parse(data: bytes, model: type[protocol.SamplingFields]):
    """The body as ``model``, or ApiError 400 naming the field that is wrong."""
    try:
        body = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(f"the request body is not JSON ({error}): send a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise _validation_error(error) from None


# Pydantic names the member of a union it tried in an error's location ('prompt', 'list[int]'): not a field.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none)$|[\[\]]|^[A-Z]")


def _validation_error(error: ValidationError) -> ApiError:
    """The first field in error, what it should be (each type of a union) and what it got."""
    def field_of(details) -> str:
        parts = [str(p) for p in details["loc"] if not isinstance(p, int) and not _UNION_MEMBER.search(str(p))]
        return ".".join(parts)

    errors = error.errors()
    field = field_of(errors[0])
    expected = list(dict.fromkeys(e["msg"].lower() for e in errors if field_of(e) == field))
    first = errors[0]
    got = json.dumps(first.get("input"))[:80] if first["type"] != "missing" else None
    message = f"{field}: {' or '.join(expected)}" + (f" (got {got})" if got is not None else "")
    return ApiError(message, param=field or None)
