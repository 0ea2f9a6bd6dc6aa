"""The OpenAI API's request bodies as kvtool serve accepts them, and the bodies it answers with.

Requests are pydantic models in strict mode: a field of the wrong type ("max_tokens": "5") is a
400, never silently converted. Fields kvtool has no use for are ignored, as vLLM ignores them, so
clients that send their defaults work. kvtool's extras (``priority``, ``cache_salt``,
``ignore_eos``, ``return_token_ids``) are accepted as vLLM spells them, and
``kv_cache_retention_config`` (token ranges kept at their own priority) as TensorRT-LLM spells it.
Answers are built as dicts: they are written once per token while streaming, and a model class
would only add a copy.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's default for /v1/completions; /v1/chat/completions defaults to what max_seq_len leaves.
DEFAULT_COMPLETION_MAX_TOKENS = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


# SamplingFields' controls of other engines that kvtool takes only at their defaults.
UNAPPLIED_CONTROLS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias")


class SamplingFields(BaseModel):
    """What both routes accept besides the prompt."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    # Other engines' sampling controls, taken at the value that leaves them off only (kvtool samples by
    # temperature, top_p and top_k): another value is refused, never silently ignored.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[str, float] | None = None
    # kvtool's (and vLLM's) extra fields.
    priority: int | None = None
    cache_salt: str | None = None
    return_token_ids: bool = False
    # Retention of token ranges, TensorRT-LLM's JSON form (kvtool.config.retention_from_json).
    kv_cache_retention_config: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions: one prompt, as text or token ids (a list of one of either, as the
    OpenAI client sends a batch, is accepted too)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions; ``max_completion_tokens`` is the newer name of max_tokens."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


API_PREFIX = "/v1"  # the OpenAI routes: what an API key guards and a drain refuses


def is_api_path(path: str) -> bool:
    return path == API_PREFIX or path.startswith(API_PREFIX + "/")


_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
                413: "invalid_request_error", 503: "service_unavailable"}
_NO_CODE = object()


def error_body(message: str, *, status: int, param: str | None = None, code: object = _NO_CODE) -> dict[str, Any]:
    """OpenAI's error object (the official client raises BadRequestError, AuthenticationError etc. from the
    status). ``code`` is the status, as vLLM sends it, unless given (OpenAI's 401 says "invalid_api_key")."""
    kind = _ERROR_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status if code is _NO_CODE else code}}


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    """``prompt_tokens_details.cached_tokens``: the prompt tokens whose KV was reused, as vLLM and SGLang report it."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def completion_choice(text: str, finish_reason: str | None, *, token_ids: list[int] | None = None,
                      prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    return choice


def chat_choice(text: str | None, finish_reason: str | None, *, streaming: bool, first: bool = False,
                token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    if streaming:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    return choice


def envelope(kind: str, response_id: str, created: int, model: str, choices: list[dict[str, Any]],
             usage_body: dict[str, Any] | None = None, *, with_usage_key: bool = True) -> dict[str, Any]:
    """A response or stream chunk: ``kind`` is text_completion, chat.completion or chat.completion.chunk."""
    body: dict[str, Any] = {"id": response_id, "object": kind, "created": created, "model": model, "choices": choices}
    if with_usage_key:
        body["usage"] = usage_body
    return body
