"""BuildOptions: what `kvtool build` bakes into a plan (TensorRT-LLM's trtllm-build flags)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from kvtool.config import ConfigError, check, check_tokens_per_block
from kvtool.models.model_config import check_dtype_name

DEFAULT_MAX_SEQ_LEN_CAP = 4096  # max_seq_len of a model with longer position embeddings


@dataclass
class BuildOptions:
    """``max_seq_len=None`` becomes min(model max_position_embeddings, 4096) at build time;
    ``kv_cache_dtype=None`` means ``dtype``. ``seed`` seeds a preset's random weights."""

    tokens_per_block: int = 32
    use_paged_context_fmha: bool = True
    max_batch_size: int = 8
    max_seq_len: int | None = None
    max_num_tokens: int = 8192
    dtype: str = "float32"
    kv_cache_dtype: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check(self.tokens_per_block is not None, self, "tokens_per_block", "must be given (a power of 2)")
        check_tokens_per_block(self, self.tokens_per_block)
        check(self.max_batch_size >= 1, self, "max_batch_size", f"must be >= 1, got {self.max_batch_size}")
        check(self.max_seq_len is None or self.max_seq_len >= 1, self, "max_seq_len",
              f"must be >= 1 (or unset for the model's limit), got {self.max_seq_len}")
        self._check_block_fits(self.max_seq_len)
        check(self.max_num_tokens >= 1, self, "max_num_tokens", f"must be >= 1, got {self.max_num_tokens}")
        check(isinstance(self.use_paged_context_fmha, bool), self, "use_paged_context_fmha",
              f"must be a bool, got {self.use_paged_context_fmha!r}")
        check_dtype_name(self.dtype)
        if self.kv_cache_dtype is not None:
            check_dtype_name(self.kv_cache_dtype)

    def _check_block_fits(self, max_seq_len: int | None) -> None:
        """A block longer than the longest sequence would never fill, so it would never be reused."""
        if max_seq_len is None or self.tokens_per_block <= max_seq_len:
            return
        raise ConfigError(
            type(self).__name__, "tokens_per_block",
            f"{self.tokens_per_block} is more than --max_seq_len {max_seq_len}: a block would never fill (so never "
            f"be reused); give --tokens_per_block {_largest_power_of_two(max_seq_len)} or less, or a larger "
            "--max_seq_len")

    @property
    def resolved_kv_cache_dtype(self) -> str:
        return self.kv_cache_dtype or self.dtype

    def resolved(self, max_position_embeddings: int) -> BuildOptions:
        """A copy with max_seq_len and kv_cache_dtype filled in for a model."""
        max_seq_len = self.max_seq_len
        if max_seq_len is None:
            max_seq_len = min(max_position_embeddings, DEFAULT_MAX_SEQ_LEN_CAP)
        check(max_seq_len <= max_position_embeddings, self, "max_seq_len",
              f"{max_seq_len} exceeds the model's max_position_embeddings {max_position_embeddings}: "
              f"pass --max_seq_len {max_position_embeddings} or less")
        return BuildOptions(**{**asdict(self), "max_seq_len": max_seq_len,
                               "kv_cache_dtype": self.resolved_kv_cache_dtype})

    def admitting(self, *, tokens_per_block: int | None = None, max_batch_size: int | None = None,
                  max_seq_len: int | None = None, max_num_tokens: int | None = None) -> BuildOptions:
        """A copy for a plan built on the fly: with this block size, and admitting these runtime limits
        (a limit these options already admit is left as is, so such runs share one plan)."""
        changes: dict[str, Any] = {}
        if tokens_per_block is not None:
            changes["tokens_per_block"] = tokens_per_block
        admitted = {"max_batch_size": self.max_batch_size, "max_num_tokens": self.max_num_tokens,
                    "max_seq_len": self.max_seq_len or DEFAULT_MAX_SEQ_LEN_CAP}
        for name, value in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len),
                            ("max_num_tokens", max_num_tokens)):
            if value is not None and value > admitted[name]:
                changes[name] = value
        return BuildOptions(**{**asdict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BuildOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"BuildOptions: unknown keys {unknown}; known keys are {sorted(known)}")
        return cls(**data)


def _largest_power_of_two(limit: int) -> int:
    return 1 << (max(limit, 1).bit_length() - 1)
