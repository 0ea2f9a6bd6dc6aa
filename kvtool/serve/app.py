"""The HTTP routes of kvtool serve: OpenAI's completions and chat completions, models, health, metrics.

A handler reads the body (kvtool.serve.body: the size limit, off the event loop when large), turns
it into an engine Request (kvtool.serve.prompts), submits it to the engine task
(kvtool.serve.engine_loop) and answers from the Stream it gets back: server-sent events, one per
engine step that gave the request a token, ``data: [DONE]`` last; or one JSON body at the end.
A client that goes away aborts its request, which frees its blocks at once. Around the routes:
the API key check (kvtool.serve.auth) and the gate that drains on shutdown (kvtool.serve.drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from kvtool.serve import protocol
from kvtool.serve.auth import ApiKeyCheck
from kvtool.serve.body import BodyReader, parse
from kvtool.serve.detokenize import TextAssembler
from kvtool.serve.drain import SHUTTING_DOWN, Drain, RequestGate
from kvtool.serve.engine_loop import EngineLoop, Stream
from kvtool.serve.prometheus import CONTENT_TYPE, ServerMetrics
from kvtool.serve.prompts import ApiError, PromptBuilder
from kvtool.serve.server import ServeConfig

OWNED_BY = "kvtool"  # /v1/models' owned_by: how `kvtool bench --endpoint` knows it talks to kvtool serve


@dataclass
class ServeState:
    """What the routes share: one per app."""

    engine_loop: EngineLoop
    prompts: PromptBuilder
    tokenizer: object
    served_model_name: str
    max_seq_len: int
    metrics: ServerMetrics
    drain: Drain
    bodies: BodyReader


def create_app(llm, *, served_model_name: str, config: ServeConfig | None = None) -> FastAPI:
    """The app serving ``llm`` (a kvtool.LLM); its engine task runs while the app does (lifespan).
    ``config`` gives the API key and the body size limit (none and 8 MiB without it)."""
    config = config or ServeConfig()
    engine_loop = EngineLoop(llm.engine)
    drain = Drain(engine_loop)
    state = ServeState(engine_loop,
                       PromptBuilder(llm.tokenizer, vocab_size=llm.plan.model_config.vocab_size,
                                     max_seq_len=llm.max_seq_len),
                       llm.tokenizer, served_model_name, llm.max_seq_len, ServerMetrics(), drain,
                       BodyReader(config.max_request_bytes, drain))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine_loop.start()
        try:
            yield
        finally:
            state.bodies.close()
            await state.engine_loop.stop()

    app = FastAPI(title="kvtool serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    # The last added runs first: the key is checked before a request counts as open.
    app.add_middleware(RequestGate, drain=drain)
    if config.api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=config.api_key)

    @app.exception_handler(ApiError)
    async def api_error(_request: HttpRequest, error: ApiError) -> JSONResponse:
        return JSONResponse(protocol.error_body(error.message, status=error.status, param=error.param),
                            status_code=error.status)

    @app.get("/health")
    async def health() -> Response:
        if state.drain.draining:
            return JSONResponse(protocol.error_body(SHUTTING_DOWN, status=503), status_code=503)
        if not state.engine_loop.alive:
            return JSONResponse(protocol.error_body("the engine is not running", status=503), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": state.served_model_name, "object": "model", "created": protocol.now_s(), "owned_by": OWNED_BY,
             "max_model_len": state.max_seq_len}]})

    @app.get("/metrics")
    async def metrics() -> Response:
        counts = await state.engine_loop.counts()
        return Response(state.metrics.render(counts), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(raw: HttpRequest) -> Response:
        body, request = await state.bodies.prepare(raw, _preparation(state, protocol.CompletionRequest,
                                                                      state.prompts.completion))
        return await _answer(state, raw, body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: HttpRequest) -> Response:
        body, request = await state.bodies.prepare(raw, _preparation(state, protocol.ChatCompletionRequest,
                                                                      state.prompts.chat))
        return await _answer(state, raw, body, request, chat=True)

    return app


def _preparation(state: ServeState, model: type[protocol.SamplingFields], build: Callable) -> Callable:
    """What turns a body's bytes into (the parsed body, the engine Request): touches no engine, so it
    may run in a thread (kvtool.serve.body)."""
    def prepare(data: bytes):
        body = parse(data, model)
        _check_model(state, body.model)
        return body, build(body)

    return prepare


def _check_model(state: ServeState, model: str | None) -> None:
    if model is not None and model != state.served_model_name:
        raise ApiError(f"the model {model!r} does not exist: this server serves {state.served_model_name!r}",
                       param="model", status=404)


async def _answer(state: ServeState, raw: HttpRequest, body, request, *, chat: bool) -> Response:
    problem = state.engine_loop.problem(request)  # the engine's own checks (e.g. larger than the KV pool)
    if problem is not None:
        raise ApiError(problem, param="messages" if chat else "prompt")
    if not state.engine_loop.alive:
        raise ApiError("the server is shutting down", status=503)
    response = _Response(state, body, request, chat=chat)
    if body.stream:
        return _EventStream(response)
    stream = response.submit()
    watcher = asyncio.ensure_future(_abort_on_disconnect(raw.receive, state.engine_loop, stream))
    try:
        while not stream.finished:
            await stream.wait()
    finally:
        watcher.cancel()
    return response.whole()


async def _abort_on_disconnect(receive, engine_loop: EngineLoop, stream: Stream) -> None:
    # Once the body is read, the server's next message is the client's disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass
    stream.client_gone = True
    engine_loop.abort(stream)


class _EventStream(Response):
    """Server-sent events of one request, aborted as soon as the client disconnects.

    Starlette's StreamingResponse learns of a disconnect by cancelling the task that writes, and a
    cancellation reaches a task only while it waits for something not yet done: the engine task wakes
    this stream at every step, so with a step always just done the cancellation never landed and an
    abandoned request ran to its end. Here a watcher aborts the request itself, which ends the events.
    """

    media_type = "text/event-stream"

    def __init__(self, response: _Response) -> None:  # not super().__init__: no body, so no Content-Length
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        self.answer = response

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        # Submitted once the headers are out: the first step starts after the handler's own work.
        stream = self.answer.submit()
        watcher = asyncio.ensure_future(_abort_on_disconnect(receive, self.answer.state.engine_loop, stream))
        events = self.answer.events()
        try:
            async for event in events:
                # The last event ends the body in the same write.
                more = not self.answer.last_event
                await send({"type": "http.response.body", "body": event.encode(), "more_body": more})
            if not self.answer.last_event:  # the client went away
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            await events.aclose()


class _Response:
    """One request's answer: the stream of chunks, or the whole body."""

    def __init__(self, state: ServeState, body, request, *, chat: bool) -> None:
        self.state, self.body, self.request, self.chat = state, body, request, chat
        self.stream: Stream | None = None
        self.response_id = protocol.new_id("chatcmpl" if chat else "cmpl")
        self.created = protocol.now_s()
        self.text = TextAssembler(request, state.tokenizer)
        self.last_event = False  # events() set it before yielding the answer's last event

    def submit(self) -> Stream:
        self.stream = self.state.engine_loop.submit(self.request)
        return self.stream

    def _usage(self) -> dict:
        request = self.stream.request
        return protocol.usage(request.num_prompt_tokens, request.num_output_tokens, request.num_reused_tokens)

    def _observe(self) -> None:
        request = self.stream.request
        arrival = request.arrival_time
        self.state.metrics.observe(
            ttft_s=None if request.first_token_time is None else request.first_token_time - arrival,
            e2e_s=None if request.finish_time is None else request.finish_time - arrival)

    def _finish_reason(self) -> str:
        return self.stream.request.finish_reason or "error"

    def whole(self) -> Response:
        request = self.stream.request
        if self.stream.error is not None:
            raise ApiError(self.stream.error, status=self.stream.error_status)
        self._observe()
        output_ids = list(request.output_token_ids)
        text = self.text.full_text()
        ids = {"token_ids": output_ids, "prompt_token_ids": list(request.prompt_token_ids)} \
            if self.body.return_token_ids else {}
        if self.chat:
            choice = protocol.chat_choice(text, self._finish_reason(), streaming=False, **ids)
        else:
            choice = protocol.completion_choice(text, self._finish_reason(), **ids)
        kind = "chat.completion" if self.chat else "text_completion"
        return JSONResponse(protocol.envelope(kind, self.response_id, self.created, self.state.served_model_name,
                                              [choice], self._usage()))

    async def events(self) -> AsyncIterator[str]:
        """The answer's events, after ``submit``."""
        stream = self.stream
        request = stream.request
        options = self.body.stream_options
        include_usage = options is not None and options.include_usage
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        model = self.state.served_model_name
        num_sent, first = 0, True
        try:
            while True:
                await stream.wait()
                finished = stream.finished  # before the token count: see Stream
                if stream.error is not None:
                    self.last_event = True
                    yield _event(protocol.error_body(stream.error, status=stream.error_status)) + DONE
                    return
                if stream.client_gone:
                    return  # nobody reads the rest
                num_tokens = len(request.output_token_ids)
                piece = self.text.delta(finished=finished)
                reason = self._finish_reason() if finished else None
                ids = {}
                if self.body.return_token_ids:
                    # The new tokens only: slicing the whole output each step would copy O(n^2) ids.
                    ids["token_ids"] = request.output_token_ids[num_sent:num_tokens]
                    if first:
                        ids["prompt_token_ids"] = list(request.prompt_token_ids)
                if self.chat:
                    choice = protocol.chat_choice(piece, reason, streaming=True, first=first, **ids)
                else:
                    choice = protocol.completion_choice(piece, reason, **ids)
                num_sent, first = num_tokens, False
                event = _event(protocol.envelope(kind, self.response_id, self.created, model, [choice],
                                                 with_usage_key=include_usage))
                if not finished:
                    yield event
                    continue
                # The last token, the usage and [DONE] in one write (each write is a system call and a
                # wake-up of the client: a sizeable share of a small model's step).
                if include_usage:
                    event += _event(protocol.envelope(kind, self.response_id, self.created, model, [], self._usage()))
                self._observe()
                self.last_event = True
                yield event + DONE
                return
        finally:
            # The answer ended early (writing failed, the task was cancelled): its blocks are freed now.
            if not stream.finished:
                self.state.engine_loop.abort(stream)


DONE = "data: [DONE]\n\n"


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
