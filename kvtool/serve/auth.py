"""API keys: with --api_key, every /v1 route requires ``Authorization: Bearer <key>`` (as vLLM's and
SGLang's --api-key); anything else is a 401 in OpenAI's error format, which the openai client
raises as AuthenticationError.

/health stays open: a load balancer or Kubernetes probe checks it without a key. /metrics stays
open too, as in vLLM: Prometheus scrapes it without credentials, and it holds counters and latency
histograms only (no prompt, no output, no key); `kvtool bench --endpoint` reads the cache counters
there. A deployment that must hide them binds the server to a private address or puts a proxy in
front.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from kvtool.serve import protocol

NO_KEY = ("no API key was sent: send it in an Authorization header as 'Bearer <key>' (the openai client's api_key, "
          "or OPENAI_API_KEY)")
WRONG_KEY = "the API key is not this server's: send the key kvtool serve was started with (--api_key or KVTOOL_API_KEY)"


class ApiKeyCheck:
    """ASGI middleware: answers a /v1 request 401 unless it carries the key (compared in constant time)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode("ascii")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and protocol.is_api_path(scope["path"]):
            problem = self.problem(scope["headers"])
            if problem is not None:
                message, code = problem
                body = protocol.error_body(message, status=401, code=code)
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def problem(self, headers: list[tuple[bytes, bytes]]) -> tuple[str, str | None] | None:
        """None when the key is right; else the message and OpenAI's code for it."""
        value = next((v for k, v in headers if k == b"authorization"), None)
        if value is None:
            return NO_KEY, None
        scheme, _, token = value.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return NO_KEY, None
        # compare_digest: the time taken does not tell how much of a guessed key was right.
        if not hmac.compare_digest(token.strip(), self.expected):
            return WRONG_KEY, "invalid_api_key"
        return None
