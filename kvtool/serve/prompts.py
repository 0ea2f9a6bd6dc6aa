"""From an API request to the engine's Request: the prompt's token ids and the SamplingParams.

Everything a client can get wrong is found here, before the engine sees the request, and raised
as ApiError (400, naming the field): a prompt that leaves no room below max_seq_len, token ids
outside the vocabulary, max_tokens < 1, sampling values out of range.
"""

from __future__ import annotations

import json
import time

from kvtool.config import RETENTION_FIELD, ConfigError, SamplingParams, retention_from_json
from kvtool.runtime.request import Request
from kvtool.serve.protocol import (DEFAULT_COMPLETION_MAX_TOKENS, UNAPPLIED_CONTROLS, ChatCompletionRequest,
                                   CompletionRequest, SamplingFields)


class ApiError(Exception):
    """An answer other than 200: the message the client reads, the field it is about, the status."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


class PromptBuilder:
    """Turns requests into engine Requests for one model (its tokenizer, vocabulary and max_seq_len)."""

    def __init__(self, tokenizer, *, vocab_size: int, max_seq_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len

    def completion(self, body: CompletionRequest) -> Request:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(f"prompt holds {len(prompt)} prompts; kvtool serve takes one per request: send them "
                               "as separate requests (they are batched by the scheduler)", param="prompt")
            prompt = prompt[0]
        if body.echo:
            raise ApiError("echo is not supported by kvtool serve: leave it out", param="echo")
        if body.logprobs is not None:
            raise ApiError("logprobs are not supported by kvtool serve: leave them out", param="logprobs")
        if isinstance(prompt, str):
            token_ids = [int(t) for t in self.tokenizer.encode(prompt)] if prompt else []
        else:
            token_ids = list(prompt)
            self._check_vocabulary(token_ids)
        default = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        return self._request(token_ids, body, default)

    def chat(self, body: ChatCompletionRequest) -> Request:
        if body.logprobs:
            raise ApiError("logprobs are not supported by kvtool serve: leave them out", param="logprobs")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        token_ids = self.chat_token_ids(messages)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return self._request(token_ids, body, asked)

    def chat_token_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The plan's chat template where its tokenizer has one; else a plain 'role: content' line per
        message and 'assistant: ' (presets have no chat format of their own)."""
        if getattr(self.tokenizer, "has_chat_template", False):
            return [int(t) for t in self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)]
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return [int(t) for t in self.tokenizer.encode(text)]

    def _check_vocabulary(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ApiError(f"token id {token_id} in prompt is outside the model's vocabulary [0, {self.vocab_size})"
                               f": send token ids below {self.vocab_size}", param="prompt")

    def _request(self, token_ids: list[int], body: SamplingFields, max_tokens: int | None) -> Request:
        arrival = time.perf_counter()
        if body.n != 1:
            raise ApiError(f"n={body.n}: kvtool serve generates one choice per request; send n=1", param="n")
        for name in UNAPPLIED_CONTROLS:
            value, off = getattr(body, name), SamplingFields.model_fields[name].default
            if value != off and value != {}:
                raise ApiError(f"{name}={json.dumps(value)}: kvtool serve does not apply it (it samples by "
                               f"temperature, top_p and top_k); leave it out or send {json.dumps(off)}", param=name)
        if not token_ids:
            raise ApiError("the prompt is empty: give at least one token", param="prompt")
        room = self.max_seq_len - len(token_ids)
        if room < 1:
            raise ApiError(f"the prompt has {len(token_ids)} tokens and max_seq_len is {self.max_seq_len}, which leaves "
                           f"no room to generate: shorten the prompt below {self.max_seq_len} tokens", param="prompt")
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        # As TensorRT-LLM's LLM API (and kvtool.LLM): a request asking for more than max_seq_len leaves
        # generates up to it; its finish_reason says "length".
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        extra = {} if body.priority is None else {"priority": body.priority}
        if body.kv_cache_retention_config is not None:
            try:
                extra["kv_cache_retention_config"] = retention_from_json(body.kv_cache_retention_config)
            except ValueError as error:
                raise ApiError(str(error), param=RETENTION_FIELD) from None
        # -1: no top-k, as vLLM's and SGLang's clients send it (kvtool's own spelling is 0).
        if body.top_k < -1:
            raise ApiError(f"top_k must be >= 0, or -1 (0 and -1: every token), got {body.top_k}", param="top_k")
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                    top_k=max(body.top_k, 0), seed=body.seed, ignore_eos=body.ignore_eos,
                                    stop=body.stop, cache_salt=body.cache_salt or None, **extra)
        except ConfigError as error:
            raise ApiError(f"{error.field} {error.problem}", param=error.field) from None
        return Request(token_ids, params, arrival_time=arrival)
