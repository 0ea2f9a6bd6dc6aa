"""Servers for the `kvtool bench --endpoint` tests that kvtool serve is not: its app behind a Bearer
check (BearerCheck), or passed off as another engine that may not report cached tokens
(AsAnotherServer), served by uvicorn in a thread over http or https (``serving``), with a
self-signed certificate made on the spot (serve_helpers.self_signed_certificate).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time

import uvicorn
from serve_helpers import free_port, self_signed_certificate  # noqa: F401 - the tests import it from here


class BearerCheck:
    """ASGI middleware: ``protected`` paths answer 401 in OpenAI's error format unless the request
    carries ``Authorization: Bearer <key>``. Records (path, headers) of every HTTP request."""

    def __init__(self, app, key: str, protected: tuple[str, ...] = ("/v1/",)) -> None:
        self.app, self.key, self.protected = app, key, protected
        self.seen: list[tuple[str, dict[str, str]]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
            self.seen.append((scope["path"], headers))
            given = headers.get("authorization", "")
            if scope["path"].startswith(self.protected) and given != f"Bearer {self.key}":
                # As OpenAI does, the message quotes (part of) the key given; the bench must not show it.
                body = json.dumps({"error": {"message": f"Incorrect API key provided: {given[7:]}",
                                             "type": "invalid_request_error", "code": "invalid_api_key"}}).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)

    def paths(self) -> list[str]:
        return [path for path, _ in self.seen]


@contextlib.contextmanager
def serving(app, certificate=None):
    """``app`` on 127.0.0.1 in a thread, over https when ``certificate`` is (cert.pem, key.pem); yields its URL."""
    port = free_port()
    tls = {} if certificate is None else {"ssl_certfile": str(certificate[0]), "ssl_keyfile": str(certificate[1])}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=2, **tls))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    try:
        yield f"{'http' if certificate is None else 'https'}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)



class AsAnotherServer:
    """ASGI middleware: /v1/models says the models are owned by ``owned_by`` (so the bench treats the
    server as a peer engine: no /metrics, no token ids asked for); with ``cached_tokens=False`` the
    streamed usage leaves out prompt_tokens_details, as vLLM does without --enable-prompt-tokens-details."""

    def __init__(self, app, owned_by: str = "hosted", *, cached_tokens: bool = True) -> None:
        self.app, self.owned_by, self.cached_tokens = app, owned_by, cached_tokens

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def rewrite(message):
            if message["type"] == "http.response.start":
                # The body changes length: drop the header (the server closes or chunks the answer).
                message = {**message, "headers": [(name, value) for name, value in message["headers"]
                                                  if name.lower() != b"content-length"]}
            elif message["type"] == "http.response.body":
                owned_by = f'"owned_by":"{self.owned_by}"'.encode()
                body = message.get("body", b"").replace(b'"owned_by":"kvtool"', owned_by)
                if not self.cached_tokens:
                    body = re.sub(rb',"prompt_tokens_details":\{[^}]*\}', b"", body)
                message = {**message, "body": body}
            await send(message)

        await self.app(scope, receive, rewrite)
