"""Request: one request from where it is made (a dataset line, an LLM.generate prompt) to its report row.

The replay, the engine and the metrics share this object: the caller fills in what to run, the
engine what happened. The C++ scheduler keeps its own state of the same request, by ``request_id``
(docs/architecture.md#a-requests-path), until it finishes: then the engine and the scheduler forget
it, and the caller's Request is its only record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvtool.workloads.datasets import DatasetRecord
    from kvtool.config import SamplingParams
    from kvtool.runtime.detokenizer import IncrementalDetokenizer


# Why a full prompt block was not reused, one reason per block, in kvtool._core.MissReasons' order
# (docs/architecture.md#kv-cache-rules).
MISS_REASONS = ("never_seen", "evicted_primary", "evicted_host", "identity", "partial", "last_token", "reuse_off")


def _default_sampling_params() -> SamplingParams:
    # Imported here: the report code (metrics -> Request) also runs in the peers' venvs, where
    # kvtool's C++ extension, which kvtool.config needs, is not built (bench/peers/common.py).
    from kvtool.config import SamplingParams  # noqa: PLC0415

    return SamplingParams()


@dataclass(eq=False, slots=True)
class Request:
    """What to run, where it came from, and what happened.

    Times are time.perf_counter seconds: TTFT = first_token_time - arrival_time; token_times[i] is
    when output token i reached the host. Slotted: a bench creates one per dataset line and reads
    its fields on every step (`kvtool simulate` replays ~20,000 a second).
    """

    prompt_token_ids: Sequence[int]  # a list, or a bench dataset line's tuple (shared, never copied)
    sampling_params: SamplingParams = field(default_factory=_default_sampling_params)
    extra_ids: list[int] | None = None  # one per prompt token (p-tuning style; 0 for a normal token)
    arrival_time: float | None = None   # None: when the engine is given it
    # A bench request: its dataset line (a later session turn's prompt_token_ids are its new
    # tokens until the replay prepends the conversation), its id in reports, where errors point.
    line: DatasetRecord | None = None
    name: str = ""
    where: str = ""
    # The output's text, which the engine feeds each token: give one to read the text (the LLM API and
    # kvtool serve do); the engine makes one itself for stop strings. None: no text is decoded.
    detokenizer: IncrementalDetokenizer | None = None
    # Filled in by the engine.
    request_id: int = -1
    output_token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    error: str | None = None
    num_reused_tokens: int = 0        # reuse figures at first admission (kvtool._core.RequestStats)
    num_reused_blocks: int = 0
    num_onboarded_blocks: int = 0
    num_early_reused_blocks: int = 0
    num_pauses: int = 0
    num_staged_blocks: int = 0        # prompt blocks fetched from the third tier (disk, remote) before admission
    # The full prompt blocks not reused, {reason in MISS_REASONS: blocks}, at first admission; None
    # where the engine does not say (a server behind bench --endpoint).
    miss_reasons: dict[str, int] | None = None
    # Which replica of a fleet served it (kvtool.fleet's routers); None: not a fleet's.
    replica: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
