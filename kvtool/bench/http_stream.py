"""A lean HTTP/1.1 client for the one exchange a bench times: POST a JSON body, read the answer's
lines as they arrive (server-sent events), on keep-alive connections.

Why not httpx (which kvtool uses for everything else): on the 2-core machine where kvtool serve was
measured, httpx's layers (httpcore, anyio, its line decoder) added 1.5-2 ms to every TTFT and
about 1 ms to every token, more than the server itself adds; the numbers would describe the client.
This reads the socket with asyncio streams and nothing else: a Content-Length body, a chunked
body, or one that ends when the server closes the connection. Not supported, since OpenAI-compatible
servers do not need them: proxies, redirects, compressed bodies.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit


class HttpError(Exception):
    """The connection failed or the answer is not HTTP/1.x as expected."""


class StreamResponse:
    """An answer being read: ``status``, ``headers`` (lower-case names), then ``lines()`` or ``read()``."""

    def __init__(self, reader: asyncio.StreamReader, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers
        self._reader = reader
        self.complete = False  # the body was read to its end (the connection can be reused)

    async def _pieces(self) -> AsyncIterator[bytes]:
        reader = self._reader
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readline()
                if not size_line:
                    raise HttpError("the server closed the connection in the middle of a chunked answer")
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailer fields
                    break
                yield await reader.readexactly(size)
                await reader.readexactly(2)  # the CRLF after each chunk
        elif "content-length" in self.headers:
            remaining = int(self.headers["content-length"])
            while remaining > 0:
                piece = await reader.read(min(remaining, 1 << 16))
                if not piece:
                    raise HttpError(f"the server closed the connection {remaining} bytes before the answer's end")
                remaining -= len(piece)
                yield piece
        else:
            while piece := await reader.read(1 << 16):
                yield piece
            self.headers["connection"] = "close"
        self.complete = True

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines (without line ends) as they arrive."""
        pending = b""
        async for piece in self._pieces():
            pending += piece
            *done, pending = pending.split(b"\n")
            for line in done:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if pending:
            yield pending.rstrip(b"\r").decode("utf-8", errors="replace")

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self._pieces()])


class StreamingClient:
    """POSTs to one server (``base_url``: scheme, host, port and path prefix) over reused connections.
    ``headers`` go with every request (an Authorization, say); ``ssl_context`` checks an https
    server's certificate (default: against the system's certificate authorities)."""

    def __init__(self, base_url: str, *, headers: Mapping[str, str] | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{base_url!r} is not an http(s) URL")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = (ssl_context or ssl.create_default_context()) if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        fixed = {"Host": parts.netloc.rsplit("@", 1)[-1], "Content-Type": "application/json",
                 "Accept": "text/event-stream"}
        # Encoded once (ASCII: the caller checked the values for line breaks).
        self._headers = "".join(f"{name}: {value}\r\n" for name, value in
                                merge_headers(fixed, headers or {}).items()).encode("ascii")
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connect(self):
        try:
            return await asyncio.open_connection(self.host, self.port, ssl=self.ssl)
        except OSError as error:
            raise HttpError(f"cannot connect to {self.host}:{self.port}: {error.strerror or error}") from None

    async def post(self, path: str, body: bytes, handle) -> None:
        """Sends the request and awaits ``handle(response)``; the connection is reused when the answer
        was read to its end. A reused connection the server had closed meanwhile is replaced once."""
        request = (f"POST {self.prefix}{path} HTTP/1.1\r\n".encode("ascii") + self._headers
                   + f"Content-Length: {len(body)}\r\n\r\n".encode("ascii") + body)
        for attempt in range(2):
            # The retry takes a new connection: the other idle ones may have been closed as well.
            reused = attempt == 0 and bool(self._idle)
            reader, writer = self._idle.pop() if reused else await self._connect()
            try:
                writer.write(request)
                await writer.drain()
                status_line = await reader.readline()
            except OSError:
                status_line = b""
            if not status_line:
                writer.close()
                if reused and attempt == 0:
                    continue  # a keep-alive connection the server closed while it was idle
                raise HttpError(f"{self.host}:{self.port} closed the connection without answering")
            break
        response = StreamResponse(reader, *await _status_and_headers(status_line, reader))
        try:
            await handle(response)
        finally:
            keep = response.complete and response.headers.get("connection", "").lower() != "close"
            if keep:
                self._idle.append((reader, writer))
            else:
                writer.close()

    async def aclose(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


def merge_headers(headers: Mapping[str, str], more: Mapping[str, str]) -> dict[str, str]:
    """``headers`` with ``more`` added; one of ``more`` replaces a header of the same name (in any case)."""
    merged = dict(headers)
    for name, value in more.items():
        for same in [known for known in merged if known.lower() == name.lower()]:
            del merged[same]
        merged[name] = value
    return merged


async def _status_and_headers(status_line: bytes, reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    parts = status_line.decode("latin-1").split(None, 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise HttpError(f"not an HTTP/1.x answer: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers
