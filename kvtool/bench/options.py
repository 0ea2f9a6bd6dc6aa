"""The bench flags (TensorRT-LLM's names), validated, and how they map to the LLM's configuration."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from types import MappingProxyType

from kvtool.bench.replay import ReplaySchedule
from kvtool.config import (
    CapacitySchedulerPolicy,
    ContextChunkingPolicy,
    KvCacheConfig,
    SchedulerConfig,
    is_power_of_two,
)

_BYTE_UNITS = MappingProxyType({"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                                "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
                                "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(value: str | int) -> int:
    """'1073741824', '1GiB', '512MB', '1.5G' -> bytes (KiB/MiB/GiB and K/M/G are powers of 1024, KB/MB/GB of 1000)."""
    if isinstance(value, int) and not isinstance(value, bool):
        amount, unit = value, ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _BYTE_UNITS:
            raise ValueError(f"byte size {value!r} is not understood: give bytes (1073741824) or a number with a "
                             "unit (512MB, 1GiB, 2G)")
        amount, unit = float(match.group(1)), match.group(2).lower()
    size = int(amount * _BYTE_UNITS[unit])
    if size < 0:
        raise ValueError(f"byte size {value!r} must be >= 0")
    return size


def _policy(value, enum_type, flag: str):
    text = value.value if hasattr(value, "value") else str(value)
    try:
        return enum_type(text.strip().upper().replace("-", "_"))
    except ValueError:
        allowed = "|".join(member.value.lower() for member in enum_type)
        raise ValueError(f"--{flag} {value!r} is unknown: use one of {allowed}") from None


@dataclass
class BenchOptions:
    """Every `kvtool bench` flag; None means "the plan's / the engine's default"."""

    enable_kv_cache_reuse: bool = True
    kv_host_cache_bytes: int = 0
    max_tokens_in_paged_kv_cache: int | None = None
    kv_cache_free_gpu_mem_fraction: float | None = None
    max_attention_window_size: int | None = None
    scheduler_policy: str = "guaranteed_no_evict"
    context_chunking_policy: str = "first_come_first_served"
    enable_chunked_context: bool = False
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_seq_len: int | None = None
    tokens_per_block: int | None = None
    mode: str = "offline"
    concurrency: int | None = None
    request_rate: float | None = None
    seed: int = 0
    warmup: int = 0
    warmup_counts_in_stats: bool = False
    num_requests: int | None = None

    def __post_init__(self) -> None:
        self.kv_host_cache_bytes = parse_bytes(self.kv_host_cache_bytes)
        self.scheduler_policy = _policy(self.scheduler_policy, CapacitySchedulerPolicy, "scheduler_policy").value.lower()
        self.context_chunking_policy = _policy(self.context_chunking_policy, ContextChunkingPolicy,
                                               "context_chunking_policy").value.lower()
        for name in ("max_tokens_in_paged_kv_cache", "max_attention_window_size", "max_batch_size",
                     "max_num_tokens", "max_seq_len", "num_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be a positive integer, got {value}")
        if self.tokens_per_block is not None and not is_power_of_two(self.tokens_per_block):
            raise ValueError(f"--tokens_per_block must be a power of 2 (16, 32, 64, ...), got {self.tokens_per_block}")
        fraction = self.kv_cache_free_gpu_mem_fraction
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"--kv_cache_free_gpu_mem_fraction must be in (0, 1], got {fraction}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0 requests, got {self.warmup}")
        self.mode = self.schedule().mode

    @classmethod
    def flag_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def schedule(self) -> ReplaySchedule:
        return ReplaySchedule(mode=self.mode, concurrency=self.concurrency, request_rate=self.request_rate,
                              seed=self.seed)

    def kv_cache_config(self) -> KvCacheConfig:
        extra = {}
        if self.kv_cache_free_gpu_mem_fraction is not None:
            extra["free_gpu_memory_fraction"] = self.kv_cache_free_gpu_mem_fraction
        return KvCacheConfig(enable_block_reuse=self.enable_kv_cache_reuse,
                             max_tokens=self.max_tokens_in_paged_kv_cache,
                             tokens_per_block=self.tokens_per_block, host_cache_size=self.kv_host_cache_bytes,
                             max_attention_window=self.max_attention_window_size, **extra)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(capacity_scheduler_policy=self.scheduler_policy.upper(),
                               context_chunking_policy=self.context_chunking_policy.upper(),
                               enable_chunked_context=self.enable_chunked_context)

    def llm_kwargs(self) -> dict:
        """Keyword arguments of kvtool.LLM besides the model (limits left out take the plan's values)."""
        kwargs = {name: getattr(self, name) for name in ("max_batch_size", "max_seq_len", "max_num_tokens")
                  if getattr(self, name) is not None}
        return {**kwargs, "kv_cache_config": self.kv_cache_config(), "scheduler_config": self.scheduler_config()}

    def as_row(self) -> dict:
        """Flag values as summary columns (--num_requests is 'num_requests_limit': 'num_requests' counts
        the requests that finished)."""
        row = asdict(self)
        row["num_requests_limit"] = row.pop("num_requests")
        return row
