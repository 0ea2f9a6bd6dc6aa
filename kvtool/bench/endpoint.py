"""`kvtool bench --endpoint URL`: the bench's replay against any OpenAI-compatible server.

EndpointEngine is a TargetEngine (kvtool.bench.target) whose requests run on a server: the
Replayer hands it requests exactly as it hands them to kvtool's engine (sequential, concurrency,
Poisson arrivals, session turns), and each is sent as a streamed completion. A client thread runs
the HTTP streams on an asyncio loop (kvtool.bench.http_stream); ``step`` returns the requests that
finished meanwhile.

What is measured, as `vllm bench serve` and genai-perf define it, on this machine's clock: TTFT from
the request's arrival to the first streamed chunk that carries a token, each token's time when its
chunk arrives (TPOT and ITL from those), E2E to the chunk that carries the finish reason. Reused
tokens are the server's ``usage.prompt_tokens_details.cached_tokens``. A connection error or an
answer other than 200 finishes the request with the server's message as its error; the run goes on.
Secured and hosted servers: an API key, extra headers and https (kvtool.bench.endpoint_access).

Token-id lines are sent as token ids (``prompt: [ids]``), text lines as text: as the completion's
prompt, or as a user message to /v1/chat/completions. Servers that return token ids (kvtool serve,
vLLM: ``return_token_ids``) are asked for them, so the report holds the generated ids and a
token-id session's next turn can carry the previous answer; elsewhere an id the server did not
send is recorded as -1, and a later turn of a token-id session cannot be sent (its error says so).
Text sessions carry the previous answer as text (as an assistant message in chat).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import queue
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import httpx  # the untimed requests: /v1/models, /metrics

from kvtool.bench.endpoint_access import REFUSED_STATUSES, EndpointAccess
from kvtool.bench.http_stream import HttpError, StreamingClient, StreamResponse
from kvtool.config import check
from kvtool.errors import KvtoolError
from kvtool.models.tokenizer import ByteLevelTokenizer
from kvtool.reports.cache_counters import COUNTERS
from kvtool.runtime.clock import WALL_CLOCK
from kvtool.runtime.request import Request

API_KINDS = ("completions", "chat")
# /v1/models' owned_by of servers that accept return_token_ids (and kvtool's priority / cache counters).
RETURNS_TOKEN_IDS = ("kvtool", "vllm")
UNKNOWN_ID = -1  # a token the server counted (usage) but did not send the id of
# /metrics counters of kvtool serve -> the summary's cache columns.
KVTOOL_COUNTERS = frozenset(key for key, _ in COUNTERS)


@dataclass(frozen=True)
class EndpointOptions:
    """The server a bench talks to. ``url``: its address, with or without the trailing /v1.
    ``poll_s``: while requests run, how often the replay looks for requests falling due (Poisson
    arrivals, arrival_time_s); a request is handed over at most this late. ``access``: the API key,
    headers and certificate checks a secured server needs."""

    url: str
    api: str = "completions"
    served_model: str | None = None  # None: the first model the server lists
    timeout_s: float = 600.0
    poll_s: float = 0.001
    access: EndpointAccess = field(default_factory=EndpointAccess)

    def __post_init__(self) -> None:
        check(re.match(r"^https?://[^/\s]+", self.url or "") is not None, self, "url",
              f"{self.url!r} is not an http(s) URL: give the server's address, e.g. http://127.0.0.1:8000")
        # The URL goes into every report row: a password in it would be written there.
        check("@" not in self.url.split("//", 1)[-1].split("/", 1)[0], self, "url",
              "holds credentials (user:password@): give the key with --api_key, or a header with --header")
        check(self.api in API_KINDS, self, "api", f"{self.api!r} is unknown: use one of {list(API_KINDS)}")
        check(self.timeout_s > 0, self, "timeout_s", f"must be > 0 seconds, got {self.timeout_s}")
        check(self.poll_s > 0, self, "poll_s", f"must be > 0 seconds, got {self.poll_s}")

    @property
    def base_url(self) -> str:
        """The URL up to and including /v1."""
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else f"{url}/v1"


@dataclass
class _Call:
    """One request on the wire; the client thread fills it in, the replay thread reads it once finished."""

    request: Request
    body: dict[str, Any]
    session_id: str | None
    sent_as: str                      # "ids" | "text" | "chat"
    engine: EndpointEngine | None = None  # which server's (a fleet's servers share one queue of finished calls)
    answer: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None
    ids_returned: bool = False


def server_message(status: int, raw: bytes) -> str:
    """'HTTP 400: <the server's message>' from an OpenAI-style (or vLLM-style) error body."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return f"HTTP {status}: {text[:300] or 'no body'}"
    error = body.get("error", body) if isinstance(body, dict) else body
    message = error.get("message") if isinstance(error, dict) else error
    return f"HTTP {status}: {message if message else text[:300]}"


def untimed_client(options: EndpointOptions, ssl_context) -> httpx.Client:
    """For the requests around the replay (/v1/models, /metrics), with the replay's key, headers and checks."""
    return httpx.Client(headers=options.access.request_headers(), verify=ssl_context or True,
                        timeout=min(options.timeout_s, 30.0))


def list_models(options: EndpointOptions, ssl_context=None) -> list[dict[str, Any]]:
    """The server's /v1/models entries; a KvtoolError saying what to do when it cannot be reached, refuses
    the API key or fails the certificate check (``ssl_context``: options.access.ssl_context's)."""
    url = f"{options.base_url}/models"
    access = options.access
    try:
        with untimed_client(options, ssl_context) as client:
            response = client.get(url)
    except httpx.HTTPError as error:
        problem = access.connect_problem(error)
        if problem is not None:
            raise KvtoolError(f"--endpoint {options.url}: {problem}") from None
        advice = ("start the server first (e.g. `kvtool serve --plan DIR --port 8000`) or fix the URL"
                  if not isinstance(error, httpx.RemoteProtocolError) else "if it serves https, use https://")
        raise KvtoolError(f"--endpoint {options.url}: cannot reach {url} ({error or type(error).__name__}): "
                          f"{advice}") from None
    if response.status_code in REFUSED_STATUSES:
        raise KvtoolError(f"--endpoint {options.url}: {access.refused(response.status_code)}")
    if response.status_code != 200:
        answer = access.redact(server_message(response.status_code, response.content))
        raise KvtoolError(f"--endpoint {options.url}: GET {url} answered {answer}"
                          ": is this an OpenAI-compatible server?")
    try:
        body = response.json()
    except ValueError:
        raise KvtoolError(f"--endpoint {options.url}: GET {url} did not answer JSON: is this an OpenAI-compatible "
                          "server?") from None
    data = body.get("data") if isinstance(body, dict) else None
    if not data and options.served_model is not None:
        return [{"id": options.served_model}]  # a server that does not list its models: take the name given
    if not data:
        raise KvtoolError(f"--endpoint {options.url}: GET {url} lists no model: give --served_model NAME")
    return [m for m in data if isinstance(m, dict)]


class CacheSize(NamedTuple):
    """What a server's KV cache holds: its block size and its pools' tokens (primary and host)."""

    tokens_per_block: int
    capacity_tokens: int


class EndpointEngine:
    """A TargetEngine over HTTP (see the module docstring). ``timed``: requests fall due while others run
    (Poisson arrivals, arrival times), so ``step`` returns every ``poll_s`` for the replay to issue them;
    otherwise it waits for a request to finish."""

    def __init__(self, options: EndpointOptions, *, served_model: str, owned_by: str, timed: bool,
                 ssl_context=None, fleet: EndpointEngine | None = None) -> None:
        self.options = options
        self.served_model = served_model
        self.owned_by = owned_by
        self.returns_token_ids = owned_by in RETURNS_TOKEN_IDS
        self._wait_s = options.poll_s if timed else 0.5
        self._ids = itertools.count()
        self._calls: dict[int, _Call] = {}
        self._done: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._text_history: dict[str, str] = {}
        self._chat_history: dict[str, list[dict[str, str]]] = {}
        if fleet is not None:
            # Another server of a fleet (kvtool.fleet.endpoint_fleet): one queue of finished calls, which
            # ``fleet.step`` waits on, one numbering of requests, and one text history (a session's turns may
            # go to different servers).
            self._done, self._ids = fleet._done, fleet._ids
            self._text_history, self._chat_history = fleet._text_history, fleet._chat_history
        self._baseline: dict[str, float] = {}
        self._num_cached_reported = 0  # requests whose usage had prompt_tokens_details.cached_tokens
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtool-endpoint", daemon=True)
        self._thread.start()
        # No connection limit: the replay's own in-flight limit is the only one.
        self._client = StreamingClient(options.base_url, headers=options.access.request_headers(),
                                       ssl_context=ssl_context)
        self._untimed = untimed_client(options, ssl_context)

    def _on_loop(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    # -- TargetEngine ------------------------------------------------------------------------
    def request_problem(self, request: Request) -> str | None:
        line = request.line
        if self.options.api == "chat" and (line is None or line.input_ids is not None):
            return ("its prompt is token ids, which /v1/chat/completions cannot take: use --api completions, or a "
                    "dataset of text prompts")
        if not request.prompt_token_ids:
            return "the prompt is empty; give at least one token"
        return None

    def add_request(self, request: Request) -> None:
        request.request_id = next(self._ids)
        if request.arrival_time is None:
            request.arrival_time = time.perf_counter()
        call = self._call(request)
        call.engine = self
        self._calls[request.request_id] = call
        asyncio.run_coroutine_threadsafe(self._send(call), self._loop)

    def has_unfinished_requests(self) -> bool:
        return bool(self._calls)

    def step(self) -> list[Request]:
        try:
            calls = [self._done.get(timeout=self._wait_s)]
        except queue.Empty:
            return []
        while True:
            try:
                calls.append(self._done.get_nowait())
            except queue.Empty:
                break
        for call in calls:
            call.engine.release(call)
        return [call.request for call in calls]

    def release(self, call: _Call) -> None:
        """Forget a finished call (it is this engine's): remember its answer for the session's next turn."""
        del self._calls[call.request.request_id]
        self._remember(call)

    def get_stats(self) -> dict[str, int | float | None]:
        """kvtool serve's cache counters since reset_stats (other servers: none). When no request since
        then had its cached tokens reported, the reuse is unknown, not 0: the summary's
        total_reused_tokens and token_hit_rate are None (the per-request rows hold 0)."""
        stats: dict[str, int | float | None] = {}
        if not self._num_cached_reported:
            stats.update(total_reused_tokens=None, token_hit_rate=None)
        now = self._counters()
        if not now:
            return stats
        stats.update({name: int(now[name] - self._baseline.get(name, 0.0)) for name in now})
        looked_up = stats.get("reused_blocks", 0) + stats.get("missed_blocks", 0)
        stats["cache_hit_rate"] = stats.get("reused_blocks", 0) / looked_up if looked_up else 0.0
        return stats

    def reset_stats(self) -> None:
        self._baseline = self._counters()
        self._num_cached_reported = 0

    def shutdown(self) -> None:
        """Closes every connection; requests still in flight (an interrupted run) are cancelled, which
        the server sees as disconnects, so it frees their blocks."""
        self._on_loop(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        self._untimed.close()

    async def _close(self) -> None:
        running = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await self._client.aclose()

    # -- requests on the wire -------------------------------------------------------------------
    def _call(self, request: Request) -> _Call:
        line = request.line
        params = request.sampling_params
        session_id = None if line is None else line.session_id
        body: dict[str, Any] = {"model": self.served_model, "max_tokens": params.max_tokens,
                                "temperature": params.temperature, "ignore_eos": params.ignore_eos, "stream": True,
                                "stream_options": {"include_usage": True}}
        # A sampled run's cuts (the servers' defaults are none). No seed: vLLM draws a seeded request's noise
        # on its own, one request after another, and off FlashInfer's sampler.
        if params.top_p != 1:
            body["top_p"] = params.top_p
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if params.cache_salt:
            body["cache_salt"] = params.cache_salt
        if self.returns_token_ids:
            body["return_token_ids"] = True
        if self.owned_by == "kvtool" and line is not None and line.priority is not None:
            body["priority"] = params.priority  # kvtool's KV retention priority; vLLM's means something else
        if self.owned_by == "kvtool" and params.kv_cache_retention_config is not None:
            body["kv_cache_retention_config"] = params.kv_cache_retention_config.to_json()
        if self.options.api == "chat":
            history = self._chat_history.get(session_id, []) if session_id is not None else []
            body["messages"] = [*history, {"role": "user", "content": line.prompt}]
            return _Call(request, body, session_id, "chat")
        if line is not None and line.input_ids is None:
            history = self._text_history.get(session_id, "") if session_id is not None else ""
            body["prompt"] = history + line.prompt
            return _Call(request, body, session_id, "text")
        if any(token_id < 0 for token_id in request.prompt_token_ids):
            raise ValueError(f"the previous turn's answer has no token ids: the server ({self.owned_by}) does not return "
                             "them, so a token-id session cannot go on; use kvtool serve or vLLM, or a text dataset")
        body["prompt"] = [int(t) for t in request.prompt_token_ids]
        return _Call(request, body, session_id, "ids")

    async def _send(self, call: _Call) -> None:
        path = "/chat/completions" if self.options.api == "chat" else "/completions"
        try:
            await asyncio.wait_for(self._client.post(path, json.dumps(call.body).encode(),
                                                     lambda response: self._read(call, response)),
                                   self.options.timeout_s)
        except asyncio.TimeoutError:
            call.request.error = f"no answer from {self.options.base_url}{path} within {self.options.timeout_s:g} s"
        except (HttpError, OSError, asyncio.IncompleteReadError) as error:
            call.request.error = f"{self.options.base_url}{path}: {error}"
        except Exception as error:  # noqa: BLE001 - any failure is this request's error row; the replay waits for it
            call.request.error = f"{type(error).__name__}: {error}"
        finally:
            self._finish(call)
            self._done.put(call)

    async def _read(self, call: _Call, response: StreamResponse) -> None:
        request = call.request
        if response.status in REFUSED_STATUSES:
            await response.read()
            request.error = self.options.access.refused(response.status)
            return
        if response.status != 200:
            request.error = server_message(response.status, await response.read())
            return
        # Read to the body's end (just after [DONE]), so that the connection can be reused.
        async for line in response.lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(data)
            if isinstance(chunk, dict) and "error" in chunk:
                error = chunk["error"]
                request.error = f"stream error: {error.get('message', error) if isinstance(error, dict) else error}"
                return
            self._on_chunk(call, chunk, now)

    def _on_chunk(self, call: _Call, chunk: dict[str, Any], now: float) -> None:
        request = call.request
        if chunk.get("usage"):
            call.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if call.sent_as == "chat":
                text = (choice.get("delta") or {}).get("content")
            else:
                text = choice.get("text")
            token_ids = choice.get("token_ids")
            if choice.get("prompt_token_ids") is not None:
                call.prompt_token_ids = [int(t) for t in choice["prompt_token_ids"]]
            if token_ids is not None:
                call.ids_returned = True
                new_ids = [int(t) for t in token_ids]
            else:
                new_ids = [UNKNOWN_ID] if text else []  # one chunk, one token, until usage says how many
            if new_ids:
                if request.first_token_time is None:
                    request.first_token_time = now
                request.output_token_ids.extend(new_ids)
                request.token_times.extend([now] * len(new_ids))
            if text:
                call.answer.append(text)
            if choice.get("finish_reason"):
                call.finish_reason = choice["finish_reason"]
                request.finish_time = now

    def _finish(self, call: _Call) -> None:
        """Sets what the report reads; finish_reason last, as the engine does."""
        request, usage = call.request, call.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        request.num_reused_tokens = int(details.get("cached_tokens") or 0)
        if details.get("cached_tokens") is not None:
            self._num_cached_reported += 1  # on the loop's thread; reset_stats runs between replays
        if call.prompt_token_ids is not None:
            request.prompt_token_ids = call.prompt_token_ids
        elif call.sent_as != "ids" and usage.get("prompt_tokens"):
            request.prompt_token_ids = [UNKNOWN_ID] * int(usage["prompt_tokens"])
        num_output = usage.get("completion_tokens")
        if not call.ids_returned and num_output is not None and num_output != request.num_output_tokens:
            request.output_token_ids = [UNKNOWN_ID] * int(num_output)
        if request.error is None and request.finish_time is None:
            request.finish_time = time.perf_counter()
        if request.error is not None:
            request.error = self.options.access.redact(request.error)  # a server may echo the key back
        request.finish_reason = "error" if request.error is not None else (call.finish_reason or "stop")

    def _remember(self, call: _Call) -> None:
        """A text session's next turn carries this answer (token-id sessions: the Replayer's history)."""
        if call.session_id is None or call.request.error is not None:
            return
        answer = "".join(call.answer)
        if call.sent_as == "chat":
            self._chat_history[call.session_id] = [*call.body["messages"], {"role": "assistant", "content": answer}]
        elif call.sent_as == "text":
            self._text_history[call.session_id] = call.body["prompt"] + answer

    def cache_size(self) -> CacheSize | None:
        """kvtool serve's tokens per block and the tokens its primary and host pools hold, from /metrics;
        None for another server (or one that does not answer)."""
        gauges = self._metrics(("tokens_per_block", "primary_blocks", "secondary_blocks"))
        if len(gauges) < 3:
            return None
        tokens_per_block = int(gauges["tokens_per_block"])
        return CacheSize(tokens_per_block,
                         int(gauges["primary_blocks"] + gauges["secondary_blocks"]) * tokens_per_block)

    def _counters(self) -> dict[str, float]:
        return self._metrics(KVTOOL_COUNTERS)

    def _metrics(self, names) -> dict[str, float]:
        """kvtool serve's /metrics values of ``names`` (kvtool_NAME, kvtool_NAME_total); {} for other servers."""
        if self.owned_by != "kvtool":
            return {}
        try:
            response = self._untimed.get(f"{self.options.base_url.removesuffix('/v1')}/metrics")
        except httpx.HTTPError:
            return {}  # the server went away: the summary has no cache counters, the rows are written
        values = {}
        for line in response.text.splitlines():
            match = re.match(r"^kvtool_(\w+?)(?:_total)? ([0-9.eE+-]+)$", line)
            if match and match.group(1) in names:
                values[match.group(1)] = float(match.group(2))
        return values


class EndpointLLM:
    """A server as a bench target (kvtool.bench.target.Target): its engine, a tokenizer for the replay's
    bookkeeping of text prompts (they are sent as text), the wall clock; no configuration, plan or pools
    of its own to report (the server's are configured where it runs)."""

    config = None
    plan = None
    pool_sizes = None
    report_columns: Mapping[str, object] = MappingProxyType({})  # none beyond the plan's, pools' and device's
    clock = WALL_CLOCK

    def __init__(self, options: EndpointOptions, *, timed: bool, fleet: EndpointLLM | None = None) -> None:
        ssl_context = options.access.ssl_context(options.base_url)
        models = list_models(options, ssl_context)
        names = [str(m.get("id")) for m in models]
        if options.served_model is not None and options.served_model not in names:
            raise KvtoolError(f"--served_model {options.served_model!r}: the server at {options.url} serves "
                              f"{names}: give one of them")
        name = options.served_model or names[0]
        owned_by = str(next(m for m in models if str(m.get("id")) == name).get("owned_by") or "unknown")
        self.options = options
        self.served_model = name
        self.endpoint = options.base_url
        self.engine_name = f"{owned_by}@endpoint"
        self.device_description = f"endpoint: {owned_by} at {options.base_url}, model {name}"
        # Text prompts are sent as text: these ids only count them before the server reports its own.
        self.tokenizer = ByteLevelTokenizer(256, None, [])
        self.engine = EndpointEngine(options, served_model=name, owned_by=owned_by, timed=timed,
                                     ssl_context=ssl_context, fleet=None if fleet is None else fleet.engine)

    def shutdown(self) -> None:
        self.engine.shutdown()
