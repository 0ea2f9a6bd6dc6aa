"""User-facing configuration, named as in TensorRT-LLM's LLM API, validated on construction.

These dataclasses (with kvtool.plan.BuildOptions) are the one definition of every rule and default:
an engine is configured by one EngineConfig (its KvCacheConfig, SchedulerConfig and runtime limits)
wherever it runs (the LLM API, bench, serve, simulate), a bench run adds its ReplayOptions; the
command line maps its flags onto their fields (kvtool.flags), and ``to_core`` hands them to the C++
runtime, whose own defaults a test checks against them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta

from kvtool import _core

# The C++ enums, so that a policy reaches the scheduler as given (TensorRT-LLM's member names).
CapacitySchedulerPolicy = _core.CapacitySchedulerPolicy
ContextChunkingPolicy = _core.ContextChunkingPolicy

# TensorRT-LLM's default retention priority (0..100); blocks of at least this priority are offloaded.
DEFAULT_PRIORITY = 35
# The remote tier: the URL schemes redis-py connects to, and how many of the store's blocks an engine's
# index remembers by default (a node of the C++ tree each, about 150 bytes).
REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")
REMOTE_INDEX_BLOCKS = 1 << 16


class ConfigError(ValueError):
    """A configuration field with a bad value. ``owner`` and ``field`` name it, so that a caller
    that set it from a flag can name the flag instead (kvtool.flags)."""

    def __init__(self, owner: str, field_name: str, problem: str) -> None:
        super().__init__(f"{owner}.{field_name} {problem}")
        self.owner = owner
        self.field = field_name
        self.problem = problem


def is_power_of_two(value: int) -> bool:
    return isinstance(value, int) and value > 0 and value & (value - 1) == 0


def check(condition: bool, owner: object, field_name: str, problem: str) -> None:
    """Raises ConfigError(type(owner).__name__, field_name, problem) unless ``condition``."""
    if not condition:
        raise ConfigError(type(owner).__name__, field_name, problem)


# A block holds a power of two tokens, more than one (TensorRT-LLM's rule) and at most 256 (vLLM's
# largest block size): a bigger block is rarely full, so it is rarely reused, and its size multiplies
# the memory one request needs before its first token.
MIN_TOKENS_PER_BLOCK, MAX_TOKENS_PER_BLOCK = 2, 256


def check_tokens_per_block(owner: object, value: int | None) -> None:
    check(value is None or (is_power_of_two(value) and MIN_TOKENS_PER_BLOCK <= value <= MAX_TOKENS_PER_BLOCK),
          owner, "tokens_per_block", f"must be a power of 2 from {MIN_TOKENS_PER_BLOCK} to {MAX_TOKENS_PER_BLOCK} "
          f"(16, 32, 64, ...), got {value}")


def _member(enum_type, value, owner: object, field_name: str):
    """An enum member from itself or its name in any case ('max_utilization', 'MAX-UTILIZATION')."""
    if isinstance(value, enum_type):
        return value
    name = str(getattr(value, "name", value)).strip().upper().replace("-", "_")
    try:
        return enum_type[name]
    except KeyError:
        allowed = "|".join(member.name.lower() for member in enum_type)
        raise ConfigError(type(owner).__name__, field_name, f"{value!r} is unknown: use one of {allowed}") from None


@dataclass
class KvCacheConfig:
    """KV cache sizing and reuse switches.

    The primary pool holds ``max_tokens`` tokens, else ``free_gpu_memory_fraction`` of the memory
    free after the weights; the smaller of the two when both are set. ``host_cache_size`` bytes of
    host memory form the secondary pool that evicted blocks are offloaded to.
    ``layered_copy_min_bytes`` (kvtool's): a step moving at least this many bytes between the
    pools copies layer by layer so the forward overlaps it (None: where the GPU copy kernel runs,
    128 MiB, or 1 GiB when the steps replay CUDA graphs, which a layered step gives up; whole blocks
    elsewhere; 0: always layer by layer).

    The third tier (kvtool's; docs/architecture.md#kv-cache-rules), below the host tier, which it
    needs: ``disk_cache_dir`` with ``disk_cache_size`` bytes of files private to this engine (emptied
    at start), or ``remote_cache_url`` (redis://host:port), a Redis / Valkey server that every engine
    pointed at it shares (``remote_cache_index_blocks``: how many of its blocks this engine's index
    remembers; blocks other engines stored are found by key anyway).

    A simulated engine (`kvtool simulate`) models the third tier from its size alone: a disk tier of
    ``disk_cache_size`` bytes (no directory: nothing is written), or a remote store of
    ``remote_cache_size`` bytes shared by every replica (a real store holds what its server's
    maxmemory allows, so a real engine refuses this size; the URL is optional there).
    """

    enable_block_reuse: bool = True
    max_tokens: int | None = None
    # TensorRT-LLM's spelling of the block size, which is a build option in kvtool: EngineConfig takes
    # it over as its tokens_per_block (and leaves None here), so nothing else reads it.
    tokens_per_block: int | None = None
    host_cache_size: int = 0
    free_gpu_memory_fraction: float = 0.9
    max_attention_window: int | None = None
    enable_partial_reuse: bool = True
    secondary_offload_min_priority: int = DEFAULT_PRIORITY
    event_buffer_max_size: int = 0
    layered_copy_min_bytes: int | None = None
    disk_cache_dir: str | None = None
    disk_cache_size: int = 0
    remote_cache_url: str | None = None
    remote_cache_index_blocks: int = REMOTE_INDEX_BLOCKS
    remote_cache_size: int = 0

    def __post_init__(self) -> None:
        check(self.max_tokens is None or self.max_tokens > 0, self, "max_tokens",
              f"must be positive, got {self.max_tokens}: give the number of tokens the primary pool holds")
        check_tokens_per_block(self, self.tokens_per_block)
        check(self.host_cache_size >= 0, self, "host_cache_size", f"must be >= 0 bytes, got {self.host_cache_size}")
        check(0.0 < self.free_gpu_memory_fraction <= 1.0, self, "free_gpu_memory_fraction",
              f"must be in (0, 1], got {self.free_gpu_memory_fraction}")
        check(self.max_attention_window is None or self.max_attention_window > 0, self, "max_attention_window",
              f"must be positive, got {self.max_attention_window}")
        check(0 <= self.secondary_offload_min_priority <= 100, self, "secondary_offload_min_priority",
              f"must be in 0..100, got {self.secondary_offload_min_priority}")
        check(self.event_buffer_max_size >= 0, self, "event_buffer_max_size",
              f"must be >= 0, got {self.event_buffer_max_size}")
        check(self.layered_copy_min_bytes is None or self.layered_copy_min_bytes >= 0, self,
              "layered_copy_min_bytes", f"must be >= 0 bytes, got {self.layered_copy_min_bytes}")
        self._check_third_tier()

    def _check_third_tier(self) -> None:
        if self.disk_cache_dir is not None:
            self.disk_cache_dir = str(self.disk_cache_dir)
        check(self.disk_cache_size >= 0, self, "disk_cache_size", f"must be >= 0 bytes, got {self.disk_cache_size}")
        check(self.disk_cache_dir is None or self.disk_cache_size > 0, self, "disk_cache_size",
              "must be given with the disk cache's directory: give its size in bytes (e.g. 4GiB)")
        check(self.remote_cache_size >= 0, self, "remote_cache_size",
              f"must be >= 0 bytes, got {self.remote_cache_size}")
        url = self.remote_cache_url
        check(url is None or (isinstance(url, str) and url.startswith(REMOTE_SCHEMES)), self, "remote_cache_url",
              f"{url!r} is not a Redis URL: use redis://host:port (rediss:// for TLS, unix:///path.sock)")
        remote = url is not None or self.remote_cache_size > 0
        check(not remote or self.disk_cache_size == 0, self, "remote_cache_url" if url is not None else
              "remote_cache_size", "and the disk cache are both given, but an engine has one third tier: give one "
              "of them")
        check(self.remote_cache_index_blocks >= 1, self, "remote_cache_index_blocks",
              f"must be >= 1, got {self.remote_cache_index_blocks}")
        check(not self.has_third_tier or self.host_cache_size > 0, self,
              ("remote_cache_url" if url is not None else "remote_cache_size") if remote
              else "disk_cache_dir" if self.disk_cache_dir is not None else "disk_cache_size",
              "needs a host cache, which blocks pass through on their way to and from the third tier: give "
              "the host cache a size too (--kv_host_cache_bytes)")

    @property
    def has_third_tier(self) -> bool:
        """Whether blocks evicted from the host tier go to disk or a remote store."""
        return self.disk_cache_size > 0 or self.remote_cache_url is not None or self.remote_cache_size > 0

    def to_core(self, *, tokens_per_block: int, num_primary_blocks: int, num_secondary_blocks: int,
                max_attention_window: int | None, num_tier3_blocks: int = 0,
                plan_digest: bytes = b"") -> _core.CacheConfig:
        """The C++ manager's configuration, with the pool sizes and the window the LLM settled on (and the
        third tier's blocks, with the plan identity its keys start from)."""
        config = _core.CacheConfig(
            tokens_per_block=tokens_per_block, num_primary_blocks=num_primary_blocks,
            num_secondary_blocks=num_secondary_blocks, enable_block_reuse=self.enable_block_reuse,
            enable_partial_reuse=self.enable_partial_reuse,
            secondary_offload_min_priority=self.secondary_offload_min_priority,
            max_attention_window=max_attention_window or 0, event_buffer_max_size=self.event_buffer_max_size)
        if num_tier3_blocks:
            config.num_tier3_blocks = num_tier3_blocks
            config.tier3_pool = _core.PoolKind.DISK if self.disk_cache_size else _core.PoolKind.REMOTE
            config.plan_digest = plan_digest
        return config


@dataclass
class SchedulerConfig:
    """Capacity policy and context chunking. A policy may be given by name, in any case."""

    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    context_chunking_policy: ContextChunkingPolicy = ContextChunkingPolicy.FIRST_COME_FIRST_SERVED
    enable_chunked_context: bool = False

    def __post_init__(self) -> None:
        self.capacity_scheduler_policy = _member(CapacitySchedulerPolicy, self.capacity_scheduler_policy, self,
                                                 "capacity_scheduler_policy")
        self.context_chunking_policy = _member(ContextChunkingPolicy, self.context_chunking_policy, self,
                                               "context_chunking_policy")

    def to_core(self, *, max_batch_size: int, max_num_tokens: int, max_seq_len: int) -> _core.SchedulerConfig:
        """The C++ scheduler's configuration, with the runtime limits the LLM settled on."""
        return _core.SchedulerConfig(
            capacity_scheduler_policy=self.capacity_scheduler_policy,
            context_chunking_policy=self.context_chunking_policy,
            enable_chunked_context=self.enable_chunked_context, max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens, max_seq_len=max_seq_len)


def _milliseconds(value: int | timedelta | None, owner: object, field_name: str) -> int | None:
    """A duration as whole milliseconds (TensorRT-LLM takes a timedelta; an int is milliseconds)."""
    if value is None:
        return None
    ms = round(value.total_seconds() * 1000) if isinstance(value, timedelta) else value
    check(isinstance(ms, int) and not isinstance(ms, bool) and ms > 0, owner, field_name,
          f"must be a positive number of milliseconds (or None: for ever), got {value!r}")
    return ms


@dataclass(frozen=True)
class TokenRangeRetentionConfig:
    """Retention of the prompt tokens [token_start, token_end) (TensorRT-LLM's name and fields): the
    blocks whose first token lies there get ``priority`` (0..100); ``duration_ms`` (milliseconds or a
    timedelta) after such a block was last released it reverts to the default 35. ``token_end`` None:
    to the end of the prompt; ``duration_ms`` None: for ever."""

    token_start: int
    token_end: int | None
    priority: int
    duration_ms: int | timedelta | None = None

    def __post_init__(self) -> None:
        check(isinstance(self.token_start, int) and self.token_start >= 0, self, "token_start",
              f"must be a token position >= 0, got {self.token_start!r}")
        check(self.token_end is None or (isinstance(self.token_end, int) and self.token_end > self.token_start),
              self, "token_end", f"must be past token_start={self.token_start} (or None: to the end of the prompt), "
              f"got {self.token_end!r}")
        check(isinstance(self.priority, int) and 0 <= self.priority <= 100, self, "priority",
              f"must be in 0..100, got {self.priority!r}")
        object.__setattr__(self, "duration_ms", _milliseconds(self.duration_ms, self, "duration_ms"))


@dataclass
class KvCacheRetentionConfig:
    """Per-request KV retention (TensorRT-LLM's KvCacheRetentionConfig): priorities of prompt token
    ranges, sorted and not overlapping, and of the blocks of generated tokens
    (``decode_retention_priority``; None: the request's ``priority``). Higher priorities are evicted
    later in every tier, and a block below KvCacheConfig.secondary_offload_min_priority is dropped
    instead of moving to a slower tier (docs/architecture.md#kv-cache-rules)."""

    token_range_retention_configs: list[TokenRangeRetentionConfig] = field(default_factory=list)
    decode_retention_priority: int | None = None
    decode_duration_ms: int | timedelta | None = None

    def __post_init__(self) -> None:
        ranges = self.token_range_retention_configs
        check(all(isinstance(r, TokenRangeRetentionConfig) for r in ranges), self,
              "token_range_retention_configs", "must be a list of TokenRangeRetentionConfig")
        for before, after in zip(ranges, ranges[1:]):
            check(before.token_end is not None and before.token_end <= after.token_start, self,
                  "token_range_retention_configs",
                  f"has overlapping or unsorted ranges ({before.token_start}..{before.token_end} then "
                  f"{after.token_start}..{after.token_end}): sort them by token_start, each ending before the next")
        priority = self.decode_retention_priority
        check(priority is None or (isinstance(priority, int) and not isinstance(priority, bool)
                                   and 0 <= priority <= 100), self,
              "decode_retention_priority", f"must be in 0..100 (or None), got {self.decode_retention_priority!r}")
        self.decode_duration_ms = _milliseconds(self.decode_duration_ms, self, "decode_duration_ms")

    def to_json(self) -> dict:
        """The JSON form retention_from_json reads (a serve request's field, a dataset line's)."""
        return {"token_range_retention_configs": [{"token_start": r.token_start, "token_end": r.token_end,
                                                   "priority": r.priority, "duration_ms": r.duration_ms}
                                                  for r in self.token_range_retention_configs],
                "decode_retention_priority": self.decode_retention_priority,
                "decode_duration_ms": self.decode_duration_ms}

    def to_core(self, num_prompt_tokens: int) -> list[_core.RetentionRange]:
        """The C++ manager's ranges for a prompt of ``num_prompt_tokens`` tokens: the prompt ranges
        (an open one ends with the prompt), then the generated tokens' range when it differs from
        the request's priority."""
        out = []
        for r in self.token_range_retention_configs:
            end = num_prompt_tokens if r.token_end is None else min(r.token_end, num_prompt_tokens)
            if r.token_start < end:
                out.append(_core.RetentionRange(r.token_start, end, r.priority, r.duration_ms))
        if self.decode_retention_priority is not None:
            out.append(_core.RetentionRange(num_prompt_tokens, None, self.decode_retention_priority,
                                            self.decode_duration_ms))
        return out


RETENTION_FIELD = "kv_cache_retention_config"
_RANGE_KEYS = ("token_start", "token_end", "priority", "duration_ms")
_RETENTION_KEYS = ("token_range_retention_configs", "decode_retention_priority", "decode_duration_ms")


def retention_from_json(value) -> KvCacheRetentionConfig:
    """A KvCacheRetentionConfig from its JSON form (a dataset line's or a serve request's
    ``kv_cache_retention_config``: TensorRT-LLM's field names, durations in milliseconds):
    ``{"token_range_retention_configs": [{"token_start": 0, "token_end": 512, "priority": 90,
    "duration_ms": 60000}], "decode_retention_priority": 10}``. ValueError naming the JSON field."""
    def fail(field_path: str, problem: str) -> ValueError:
        return ValueError(f"'{field_path}' {problem}")

    def known(obj, keys: tuple[str, ...], where: str) -> dict:
        if not isinstance(obj, dict):
            raise fail(where, f"must be a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - set(keys))
        if unknown:
            raise fail(where, f"has unknown key(s) {unknown}; allowed keys are {list(keys)}")
        return obj

    obj = known(value, _RETENTION_KEYS, RETENTION_FIELD)
    ranges_json = obj.get("token_range_retention_configs", [])
    if not isinstance(ranges_json, list):
        raise fail(f"{RETENTION_FIELD}.token_range_retention_configs", "must be a list of ranges")
    ranges = []
    for i, item in enumerate(ranges_json):
        where = f"{RETENTION_FIELD}.token_range_retention_configs[{i}]"
        item = known(item, _RANGE_KEYS, where)
        missing = [key for key in ("token_start", "priority") if key not in item]
        if missing:
            raise fail(where, f"needs {missing[0]!r} (and token_end, duration_ms: null or absent for open ones)")
        try:
            ranges.append(TokenRangeRetentionConfig(item["token_start"], item.get("token_end"), item["priority"],
                                                    item.get("duration_ms")))
        except ConfigError as error:
            raise fail(f"{where}.{error.field}", error.problem) from None
    try:
        return KvCacheRetentionConfig(ranges, obj.get("decode_retention_priority"), obj.get("decode_duration_ms"))
    except ConfigError as error:
        raise fail(f"{RETENTION_FIELD}.{error.field}", error.problem) from None


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
    priority: int = DEFAULT_PRIORITY  # KV retention priority 0..100 of the blocks this request computes
    cache_salt: str | None = None
    lora_task_id: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    # Priorities of token ranges of this request's KV (None: ``priority`` for every block).
    kv_cache_retention_config: KvCacheRetentionConfig | None = None

    def __post_init__(self) -> None:
        check(self.max_tokens >= 1, self, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        check(self.temperature >= 0.0, self, "temperature", f"must be >= 0, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, self, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.top_k >= 0, self, "top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        check(0 <= self.priority <= 100, self, "priority", f"must be in 0..100, got {self.priority}")
        check(self.kv_cache_retention_config is None or isinstance(self.kv_cache_retention_config,
                                                                   KvCacheRetentionConfig),
              self, "kv_cache_retention_config", "must be a KvCacheRetentionConfig or None")
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


# The instruction sets kvtool's CPU kernels are built for, best first (kvtool.cpu_kernels.supported_isas
# lists those this CPU runs).
CPU_KERNEL_ISAS = ("amx", "avx512_bf16", "avx512", "avx2", "generic")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine is configured with, wherever it runs (kvtool.LLM, `kvtool bench`, `serve`,
    `simulate`): the KV cache, the scheduler, the runtime limits (None: the plan's; more than the plan
    was built for is refused), the block size asked for, CUDA graphs, and the CPU kernels' instruction set.

    ``tokens_per_block`` is a build option: a model built on the fly is built with it, a built plan of
    another block size is refused (None: the plan's). A KvCacheConfig's tokens_per_block (TensorRT-LLM's
    spelling) is taken over here. ``enforce_eager``: no CUDA graphs (vLLM's --enforce-eager).
    ``cpu_kernels_isa``: on a CPU, the instruction set of kvtool's CPU kernels: "auto" (the best this
    CPU runs), one of CPU_KERNEL_ISAS (refused when the engine starts on a CPU that lacks it), or "off"
    (torch's ops throughout); to compare instruction sets on one machine. Ignored on a GPU.
    """

    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_seq_len: int | None = None
    tokens_per_block: int | None = None
    enforce_eager: bool = False
    cpu_kernels_isa: str = "auto"

    def __post_init__(self) -> None:
        check(self.cpu_kernels_isa in ("auto", "off", *CPU_KERNEL_ISAS), self, "cpu_kernels_isa",
              f"{self.cpu_kernels_isa!r} is unknown: use auto, off or one of {list(CPU_KERNEL_ISAS)}")
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len"):
            value = getattr(self, name)
            check(value is None or value >= 1, self, name, f"must be a positive integer, got {value}")
        check(isinstance(self.enforce_eager, bool), self, "enforce_eager",
              f"must be true or false, got {self.enforce_eager!r}")
        check_tokens_per_block(self, self.tokens_per_block)
        asked = self.kv_cache_config.tokens_per_block
        if asked is not None:
            check(self.tokens_per_block in (None, asked), self, "tokens_per_block",
                  f"{self.tokens_per_block} and KvCacheConfig.tokens_per_block {asked} disagree: give the block "
                  "size once")
            object.__setattr__(self, "tokens_per_block", asked)
            object.__setattr__(self, "kv_cache_config", replace(self.kv_cache_config, tokens_per_block=None))

    @property
    def cuda_graphs(self) -> bool:
        return not self.enforce_eager


MODES = ("offline", "sequential", "trace")


@dataclass(frozen=True)
class ReplayOptions:
    """How a bench run hands its dataset to the engine (kvtool.bench.replay), and which lines it
    measures: the first ``warmup`` run first, uncounted, then at most ``num_requests``.

    Every request generates exactly its line's output tokens, greedily (``temperature`` 0, as
    trtllm-bench's) or sampled at ``temperature`` among the ``top_k`` largest logits and the ``top_p``
    of the probability, each request drawing from its own stream seeded by ``seed`` and its line
    (kvtool.workloads.requests.request_seed): a sampled run repeats token for token."""

    mode: str = "offline"
    concurrency: int | None = None
    request_rate: float | None = None
    seed: int = 0
    warmup: int = 0
    warmup_counts_in_stats: bool = False  # keep the warm-up's cache counters
    num_requests: int | None = None
    time_scale: float = 1.0  # arrival times are multiplied by it
    burstiness: float = 1.0  # the shape of request_rate's gamma-distributed gaps (1: exponential, Poisson)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1: no nucleus cut
    top_k: int = 0  # 0: every token

    def __post_init__(self) -> None:
        self._check_sampling()
        mode = str(self.mode).lower()
        check(mode in MODES, self, "mode", f"{self.mode!r} is unknown: use one of {list(MODES)} "
              "(and --concurrency N / --request_rate R for the other replay patterns)")
        object.__setattr__(self, "mode", mode)
        check(self.concurrency is None or self.concurrency >= 1, self, "concurrency",
              f"must be >= 1, got {self.concurrency}")
        check(mode != "sequential" or self.concurrency in (None, 1), self, "mode",
              f"sequential keeps one request in flight; it contradicts concurrency {self.concurrency}: "
              "drop one of them")
        check(self.request_rate is None or self.request_rate > 0, self, "request_rate",
              f"must be > 0 requests per second, got {self.request_rate}")
        check(mode != "trace" or self.request_rate is None, self, "mode",
              f"trace replays the dataset's arrival times; it contradicts request_rate {self.request_rate}: drop one "
              "of them")
        check(isinstance(self.time_scale, (int, float)) and not isinstance(self.time_scale, bool)
              and 0 < self.time_scale < float("inf"), self, "time_scale",
              f"must be a number > 0 (0.5 replays twice as fast, 2 half as fast), got {self.time_scale!r}")
        check(self.time_scale == 1 or self.request_rate is None, self, "time_scale",
              f"scales the dataset's arrival times, but request_rate {self.request_rate} draws its own: drop one of "
              "them")
        check(isinstance(self.burstiness, (int, float)) and not isinstance(self.burstiness, bool)
              and 0 < self.burstiness < float("inf"), self, "burstiness",
              f"must be a number > 0 (1: Poisson arrivals; 0.5 burstier, 2 more even), got {self.burstiness!r}")
        check(self.burstiness == 1 or self.request_rate is not None, self, "burstiness",
              f"{self.burstiness:g} shapes the gaps of request_rate's arrivals: give a request_rate too")
        check(self.warmup >= 0, self, "warmup", f"must be >= 0 requests, got {self.warmup}")
        check(self.num_requests is None or self.num_requests >= 1, self, "num_requests",
              f"must be a positive integer, got {self.num_requests}")

    def _check_sampling(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), self,
                  name, f"must be a number, got {value!r}")
        check(self.temperature >= 0, self, "temperature", f"must be >= 0 (0: greedy), got {self.temperature}")
        check(0 < self.top_p <= 1, self, "top_p", f"must be in (0, 1] (1: no cut), got {self.top_p}")
        check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0, self, "top_k",
              f"must be an integer >= 0 (0: every token), got {self.top_k!r}")
        for name, cuts in (("top_p", self.top_p != 1), ("top_k", self.top_k > 1)):
            check(self.temperature > 0 or not cuts, self, name,
                  f"{getattr(self, name)} cuts the tokens a sampled request draws from, but temperature is 0 "
                  "(greedy, the default): give a temperature > 0 too (1.0: the model's own distribution)")

    @property
    def sampled(self) -> bool:
        """Whether requests draw their tokens (top_k 1 is greedy at any temperature)."""
        return self.temperature > 0 and self.top_k != 1

    @property
    def max_in_flight(self) -> int | None:
        """The in-flight limit (None: unlimited)."""
        return 1 if self.mode == "sequential" else self.concurrency

    def split(self, items: Sequence) -> tuple[list, list]:
        """(warm-up, measured) items of a run."""
        measured = list(items[self.warmup:])
        if self.num_requests is not None:
            measured = measured[:self.num_requests]
        return list(items[:self.warmup]), measured

    def describe(self) -> str:
        parts = [self.mode] if self.concurrency is None else [f"concurrency={self.concurrency}"]
        if self.mode == "trace" and self.concurrency is not None:
            parts.insert(0, "trace")
        if self.request_rate is not None:
            parts.append(f"rate={self.request_rate:g}/s")
        if self.burstiness != 1:
            parts.append(f"burstiness={self.burstiness:g}")
        if self.time_scale != 1:
            parts.append(f"time_scale={self.time_scale:g}")
        if self.sampled:
            parts.append(f"temperature={self.temperature:g}")
            if self.top_p != 1:
                parts.append(f"top_p={self.top_p:g}")
            if self.top_k > 0:
                parts.append(f"top_k={self.top_k}")
        return ",".join(parts)
