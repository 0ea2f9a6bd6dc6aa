"""What the engine reports about each request: outputs as they are produced, and a timing record."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """Tokens a request produced in one engine step (streaming), and whether it is done."""

    request_id: int
    new_token_ids: list[int]
    token_ids: list[int]            # every output token so far
    finished: bool
    finish_reason: str | None = None  # "length" | "stop" | "error"
    error: str | None = None


@dataclass
class RequestRecord:
    """Timestamps (time.perf_counter seconds) and cache figures of one request, for metrics.

    TTFT = first_token_time - arrival_time; token_times[i] is when output token i reached the host.
    """

    request_id: int
    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_reused_tokens: int = 0
    num_reused_blocks: int = 0
    num_onboarded_blocks: int = 0
    num_early_reused_blocks: int = 0
    num_pauses: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_time is not None
