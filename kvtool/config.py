"""User-facing configuration, named as in TensorRT-LLM's LLM API. Validated on construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class CapacitySchedulerPolicy(str, enum.Enum):
    """How many requests the scheduler admits against the KV cache (TensorRT-LLM's names)."""

    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    MAX_UTILIZATION = "MAX_UTILIZATION"
    STATIC_BATCH = "STATIC_BATCH"


class ContextChunkingPolicy(str, enum.Enum):
    """Which context advances first when contexts are chunked."""

    FIRST_COME_FIRST_SERVED = "FIRST_COME_FIRST_SERVED"
    EQUAL_PROGRESS = "EQUAL_PROGRESS"


def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass
class KvCacheConfig:
    """KV cache sizing and reuse switches.

    The primary pool holds ``max_tokens`` tokens, else ``free_gpu_memory_fraction`` of the memory
    free after the weights; the smaller of the two when both are set. ``host_cache_size`` bytes of
    host memory form the secondary pool that evicted blocks are offloaded to.
    """

    enable_block_reuse: bool = True
    max_tokens: int | None = None
    tokens_per_block: int | None = None  # None: the plan's value
    host_cache_size: int = 0
    free_gpu_memory_fraction: float = 0.9
    max_attention_window: int | None = None
    enable_partial_reuse: bool = True
    secondary_offload_min_priority: int = 35
    event_buffer_max_size: int = 0

    def __post_init__(self) -> None:
        _check(self.max_tokens is None or self.max_tokens > 0,
               f"KvCacheConfig.max_tokens must be positive, got {self.max_tokens}: "
               "give the number of tokens the primary pool holds, or None to size it from memory")
        _check(self.tokens_per_block is None or is_power_of_two(self.tokens_per_block),
               f"KvCacheConfig.tokens_per_block must be a power of 2 (16, 32, 64, ...), "
               f"got {self.tokens_per_block}")
        _check(self.host_cache_size >= 0,
               f"KvCacheConfig.host_cache_size must be >= 0 bytes, got {self.host_cache_size}")
        _check(0.0 < self.free_gpu_memory_fraction <= 1.0,
               f"KvCacheConfig.free_gpu_memory_fraction must be in (0, 1], got {self.free_gpu_memory_fraction}")
        _check(self.max_attention_window is None or self.max_attention_window > 0,
               f"KvCacheConfig.max_attention_window must be positive, got {self.max_attention_window}")
        _check(0 <= self.secondary_offload_min_priority <= 100,
               "KvCacheConfig.secondary_offload_min_priority must be in 0..100, "
               f"got {self.secondary_offload_min_priority}")
        _check(self.event_buffer_max_size >= 0,
               f"KvCacheConfig.event_buffer_max_size must be >= 0, got {self.event_buffer_max_size}")


@dataclass
class SchedulerConfig:
    """Capacity policy and context chunking."""

    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    context_chunking_policy: ContextChunkingPolicy = ContextChunkingPolicy.FIRST_COME_FIRST_SERVED
    enable_chunked_context: bool = False

    def __post_init__(self) -> None:
        try:
            self.capacity_scheduler_policy = CapacitySchedulerPolicy(
                _enum_value(self.capacity_scheduler_policy))
        except ValueError:
            raise ValueError(f"SchedulerConfig.capacity_scheduler_policy {self.capacity_scheduler_policy!r} "
                             f"is unknown: use one of {[p.value for p in CapacitySchedulerPolicy]}") from None
        try:
            self.context_chunking_policy = ContextChunkingPolicy(_enum_value(self.context_chunking_policy))
        except ValueError:
            raise ValueError(f"SchedulerConfig.context_chunking_policy {self.context_chunking_policy!r} "
                             f"is unknown: use one of {[p.value for p in ContextChunkingPolicy]}") from None


def _enum_value(value) -> str:
    if isinstance(value, enum.Enum):
        return value.value
    return str(value).upper()


@dataclass
class SamplingParams:
    """How to sample. ``temperature=0`` is greedy; ``ignore_eos`` generates exactly ``max_tokens``."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    priority: int = 35  # KV retention priority 0..100 of the blocks this request computes
    cache_salt: str | None = None
    lora_task_id: int = 0
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        _check(self.temperature >= 0.0, f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"SamplingParams.top_k must be >= 0 (0 disables it), got {self.top_k}")
        _check(0 <= self.priority <= 100, f"SamplingParams.priority must be in 0..100, got {self.priority}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
