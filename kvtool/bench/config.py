"""A bench run's configuration, and the one table that maps `kvtool bench` flags onto it.

A flag's name (TensorRT-LLM's trtllm-bench spelling) is its command-line option, its key in a
scenario's ``bench:`` section and its summary CSV column; the field it sets (of KvCacheConfig,
SchedulerConfig, the LLM's runtime limits or ReplayOptions) holds its rules and its default.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvtool.bench.replay import ReplayOptions
from kvtool.config import ConfigError, KvCacheConfig, SchedulerConfig, check
from kvtool.units import parse_bytes

@dataclass(frozen=True)
class BenchConfig:
    """What one bench run is configured with: the LLM's configuration (runtime limits left None take
    the plan's) and how the dataset is replayed."""

    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_seq_len: int | None = None
    enforce_eager: bool = False  # no CUDA graphs: every step launches its kernels (vLLM's --enforce-eager)
    replay: ReplayOptions = field(default_factory=ReplayOptions)

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len"):
            value = getattr(self, name)
            check(value is None or value >= 1, self, name, f"must be a positive integer, got {value}")
        check(isinstance(self.enforce_eager, bool), self, "enforce_eager",
              f"must be true or false, got {self.enforce_eager!r}")

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> BenchConfig:
        """The configuration the flags ask for; a bad value is a ValueError naming its flag."""
        sections: dict[str, dict[str, Any]] = {section: {} for section in _OWNERS}
        for name, value in flags.items():
            flag = _FLAG_BY_NAME.get(name)
            if flag is None:
                raise ValueError(f"--{name} is not a bench flag; known: {', '.join(FLAG_NAMES)}")
            try:
                sections[flag.section][flag.field] = flag.parse(value) if flag.parse else value
            except ValueError as error:
                raise ValueError(f"--{name}: {error}") from None
        try:
            return cls(kv_cache_config=KvCacheConfig(**sections[KV]),
                       scheduler_config=SchedulerConfig(**sections[SCHEDULER]),
                       replay=ReplayOptions(**sections[REPLAY]), **sections[LIMITS])
        except ConfigError as error:
            flag = _FLAG_BY_FIELD.get((error.owner, error.field))
            if flag is None:
                raise
            raise ValueError(f"--{flag.name} {error.problem}") from None

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of kvtool.LLM besides the model."""
        limits = {name: getattr(self, name) for name in ("max_batch_size", "max_num_tokens", "max_seq_len")
                  if getattr(self, name) is not None}
        return {**limits, "kv_cache_config": self.kv_cache_config, "scheduler_config": self.scheduler_config,
                "cuda_graphs": not self.enforce_eager}

    def as_row(self, *, engine: bool = True) -> dict[str, Any]:
        """Every flag's value as its summary column (policies as the flags spell them); ``engine=False``:
        the replay's flags only (a server's engine is configured where it runs)."""
        row = {}
        for flag in FLAGS:
            if not engine and flag.section != REPLAY:
                continue
            owner = self if flag.section == LIMITS else getattr(self, flag.section)
            value = getattr(owner, flag.field)
            row[flag.column or flag.name] = value.name.lower() if isinstance(value, enum.Enum) else value
        return row


@dataclass(frozen=True)
class Flag:
    """A bench flag and the configuration field it sets."""

    name: str                                  # --name, scenario key, summary column
    section: str                               # a BenchConfig field: the object holding `field`
    field: str
    parse: Callable[[Any], Any] | None = None  # the flag's text to the field's value
    column: str | None = None                  # the summary column, when not `name`


KV, SCHEDULER, LIMITS, REPLAY = "kv_cache_config", "scheduler_config", "limits", "replay"
_OWNERS = MappingProxyType({KV: "KvCacheConfig", SCHEDULER: "SchedulerConfig", LIMITS: "BenchConfig",
                            REPLAY: "ReplayOptions"})

# In summary column order.
FLAGS: tuple[Flag, ...] = (
    Flag("enable_kv_cache_reuse", KV, "enable_block_reuse"),
    Flag("kv_host_cache_bytes", KV, "host_cache_size", parse=parse_bytes),
    Flag("max_tokens_in_paged_kv_cache", KV, "max_tokens"),
    Flag("kv_cache_free_gpu_mem_fraction", KV, "free_gpu_memory_fraction"),
    Flag("max_attention_window_size", KV, "max_attention_window"),
    Flag("scheduler_policy", SCHEDULER, "capacity_scheduler_policy"),
    Flag("context_chunking_policy", SCHEDULER, "context_chunking_policy"),
    Flag("enable_chunked_context", SCHEDULER, "enable_chunked_context"),
    Flag("max_batch_size", LIMITS, "max_batch_size"),
    Flag("max_num_tokens", LIMITS, "max_num_tokens"),
    Flag("max_seq_len", LIMITS, "max_seq_len"),
    Flag("enforce_eager", LIMITS, "enforce_eager"),
    Flag("tokens_per_block", KV, "tokens_per_block"),
    Flag("mode", REPLAY, "mode"),
    Flag("concurrency", REPLAY, "concurrency"),
    Flag("request_rate", REPLAY, "request_rate"),
    Flag("time_scale", REPLAY, "time_scale"),
    Flag("seed", REPLAY, "seed"),
    Flag("warmup", REPLAY, "warmup"),
    Flag("warmup_counts_in_stats", REPLAY, "warmup_counts_in_stats"),
    # 'num_requests' is the column of the requests that finished.
    Flag("num_requests", REPLAY, "num_requests", column="num_requests_limit"),
)
FLAG_NAMES: tuple[str, ...] = tuple(flag.name for flag in FLAGS)
# The flags that configure the engine (not how a dataset is replayed): what `kvtool serve` takes too.
ENGINE_FLAG_NAMES: tuple[str, ...] = tuple(flag.name for flag in FLAGS if flag.section != REPLAY)
_FLAG_BY_NAME = MappingProxyType({flag.name: flag for flag in FLAGS})
_FLAG_BY_FIELD = MappingProxyType({(_OWNERS[flag.section], flag.field): flag for flag in FLAGS})


def flags_from_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """The flags a summary row records (read back from CSV text, each value as YAML reads it), so
    that its configuration can be run again (`kvtool explain` simulates what-ifs from it)."""
    import yaml

    flags = {}
    for flag in FLAGS:
        value = row.get(flag.column or flag.name)
        if value is None or value == "":
            continue
        flags[flag.name] = yaml.safe_load(value) if isinstance(value, str) else value
    return flags
