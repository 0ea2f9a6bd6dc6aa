"""The HTTP routes of kvtool serve: OpenAI's completions and chat completions, models, health, metrics.

A handler turns the body into an engine Request (kvtool.serve.prompts), submits it to the engine
task (kvtool.serve.engine_loop) and answers from the Stream it gets back: server-sent events, one
per engine step that gave the request a token, ``data: [DONE]`` last; or one JSON body at the end.
A client that goes away aborts its request, which frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from kvtool.serve import protocol
from kvtool.serve.detokenize import TextAssembler
from kvtool.serve.engine_loop import EngineLoop, Stream
from kvtool.serve.metrics import CONTENT_TYPE, ServerMetrics
from kvtool.serve.prompts import ApiError, PromptBuilder

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


def create_app(llm, *, served_model_name: str) -> FastAPI:
    """The app serving ``llm`` (a kvtool.LLM); its engine task runs while the app does (lifespan)."""
    state = ServeState(EngineLoop(llm.engine),
                       PromptBuilder(llm.tokenizer, vocab_size=llm.plan.model_config.vocab_size,
                                     max_seq_len=llm.max_seq_len),
                       llm.tokenizer, served_model_name, llm.max_seq_len, ServerMetrics())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine_loop.start()
        try:
            yield
        finally:
            await state.engine_loop.stop()

    app = FastAPI(title="kvtool serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    @app.exception_handler(ApiError)
    async def api_error(_request: HttpRequest, error: ApiError) -> JSONResponse:
        return JSONResponse(protocol.error_body(error.message, status=error.status, param=error.param),
                            status_code=error.status)

    @app.get("/health")
    async def health() -> Response:
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
        body = await _parse(raw, protocol.CompletionRequest)
        _check_model(state, body.model)
        return await _answer(state, raw, body, state.prompts.completion(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: HttpRequest) -> Response:
        body = await _parse(raw, protocol.ChatCompletionRequest)
        _check_model(state, body.model)
        return await _answer(state, raw, body, state.prompts.chat(body), chat=True)

    return app


async def _parse(raw: HttpRequest, model: type[protocol.SamplingFields]):
    try:
        data = json.loads(await raw.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(f"the request body is not JSON ({error}): send a JSON object") from None
    if not isinstance(data, dict):
        raise ApiError("the request body must be a JSON object")
    try:
        return model.model_validate(data)
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
                output_ids = request.output_token_ids[:num_tokens]
                piece = self.text.delta(finished=finished)
                reason = self._finish_reason() if finished else None
                ids = {}
                if self.body.return_token_ids:
                    ids["token_ids"] = output_ids[num_sent:]
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
