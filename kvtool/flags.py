"""The flags of the commands that run an engine (`kvtool bench`, `simulate`, `serve`, `calibrate`),
declared once.

Each flag of FLAGS has its name (TensorRT-LLM's trtllm-bench spelling: the command-line option, its
key in a scenario's ``bench:`` section, its summary column), its help and --help panel, its value
type (a toggle takes no value; an on/off pair is one flag with two options), and, where it sets
one, the configuration field it sets (of EngineConfig and its KvCacheConfig / SchedulerConfig, or of
ReplayOptions: the field holds the rules and the default), its parser and its summary column. The
others (--plan, --dataset, --output, ...) the command reads itself. kvtool.cli.typer_options turns
the table into typer options; this module imports neither typer nor torch (`kvtool --help` stays fast).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvtool.config import ConfigError, EngineConfig, KvCacheConfig, ReplayOptions, SchedulerConfig
from kvtool.units import parse_bytes

MODEL, KV_CACHE, SCHEDULER, WORKLOAD, SAMPLING, OUTPUT, REPORT, FLEET = (
    "Model and plan", "KV cache", "Scheduler", "Workload", "Sampling", "Output", "Report", "Fleet")
# Where a flag's value goes: a configuration object (its type names it in ConfigError), or None: the command.
KV, SCHED, ENGINE, REPLAY = "kv_cache_config", "scheduler_config", "engine", "replay"
_OWNERS = MappingProxyType({KV: "KvCacheConfig", SCHED: "SchedulerConfig", ENGINE: "EngineConfig",
                            REPLAY: "ReplayOptions"})


@dataclass(frozen=True)
class Flag:
    """One flag: --name, its help, and the configuration field it sets (section None: none)."""

    name: str
    help: str
    panel: str
    type: type = str                           # the value's type; bool: a toggle, which takes no value
    section: str | None = None                 # KV, SCHED, ENGINE, REPLAY: the object holding `field`
    field: str | None = None
    parse: Callable[[Any], Any] | None = None  # the flag's text to the field's value
    column: str | None = None                  # the summary column, when not `name`
    off: str | None = None                     # a toggle pair's second flag: --off sets the field False
    off_help: str | None = None
    repeatable: bool = False                   # given several times: a list

    @property
    def toggle(self) -> bool:
        return self.type is bool


FLAGS: tuple[Flag, ...] = (
    Flag("plan", "A plan directory built by `kvtool build`.", MODEL, Path),
    Flag("model", "preset:NAME, a Hugging Face checkpoint directory, a .gguf file or gguf:NAME, built on the fly "
         "(bench --config: replaces the scenario's model).", MODEL),
    Flag("tokens_per_block", "Block size: a build option for --model (one plan per value), checked against --plan.",
         MODEL, int, ENGINE, "tokens_per_block"),
    Flag("plan_cache_dir", "Where plans built on the fly go (default $KVTOOL_CACHE_DIR or ~/.cache/kvtool/plans; see "
         "`kvtool plans`).", MODEL, Path),
    Flag("enable_kv_cache_reuse", "Reuse cached KV blocks of shared prefixes (the default).", KV_CACHE, bool, KV,
         "enable_block_reuse", off="disable_kv_cache_reuse", off_help="Compute every prompt in full."),
    Flag("max_tokens_in_paged_kv_cache", "Primary pool size in tokens (the smaller of this and the memory fraction's "
         "budget).", KV_CACHE, int, KV, "max_tokens"),
    Flag("kv_cache_free_gpu_mem_fraction", "Fraction of the free memory (a CPU: available host memory) for the "
         "primary pool (default 0.9; a CPU pool without max_tokens: 256 MiB at most).", KV_CACHE, float, KV,
         "free_gpu_memory_fraction"),
    Flag("kv_host_cache_bytes", "Host memory for offloaded blocks: bytes or 512MB / 1GiB (default 0: no "
         "offloading).", KV_CACHE, str, KV, "host_cache_size", parse=parse_bytes),
    Flag("kv_disk_cache_dir", "Third KV tier on local disk: blocks evicted from the host cache spill to files in "
         "this directory (private to this engine, emptied at start; needs --kv_host_cache_bytes and "
         "--kv_disk_cache_bytes).", KV_CACHE, str, KV, "disk_cache_dir"),
    Flag("kv_disk_cache_bytes", "Size of the disk tier's files: bytes or 4GB / 8GiB (simulate: the disk tier, no "
         "directory needed).", KV_CACHE, str, KV, "disk_cache_size", parse=parse_bytes),
    Flag("kv_remote_cache", "Third KV tier in a Redis / Valkey server shared by every engine pointed at it: "
         "redis://host:port (needs --kv_host_cache_bytes; keys carry the model, cache salt and LoRA id).",
         KV_CACHE, str, KV, "remote_cache_url"),
    Flag("kv_remote_cache_bytes", "simulate only: a remote store of this size shared by every --replicas (its "
         "least recently used blocks dropped when full; a real store's size is its server's maxmemory).", KV_CACHE,
         str, KV, "remote_cache_size", parse=parse_bytes),
    Flag("max_attention_window_size", "Sliding attention window (tokens).", KV_CACHE, int, KV, "max_attention_window"),
    Flag("scheduler_policy", "guaranteed_no_evict (default) | max_utilization | static_batch.", SCHEDULER, str,
         SCHED, "capacity_scheduler_policy"),
    Flag("enable_chunked_context", "Split long contexts into chunks.", SCHEDULER, bool, SCHED,
         "enable_chunked_context", off="disable_chunked_context", off_help="Each context in one step (the default)."),
    Flag("context_chunking_policy", "first_come_first_served (default) | equal_progress.", SCHEDULER, str, SCHED,
         "context_chunking_policy"),
    Flag("max_batch_size", "Requests per step (default: the plan's).", SCHEDULER, int, ENGINE, "max_batch_size"),
    Flag("max_num_tokens", "Tokens per step (default: the plan's).", SCHEDULER, int, ENGINE, "max_num_tokens"),
    Flag("max_seq_len", "Longest prompt + output (default: the plan's).", SCHEDULER, int, ENGINE, "max_seq_len"),
    Flag("enforce_eager", "No CUDA graphs: every step launches its kernels one by one (on a GPU, decode steps replay "
         "graphs by default).", SCHEDULER, bool, ENGINE, "enforce_eager"),
    Flag("cpu_kernels_isa", "On a CPU: the instruction set of kvtool's CPU kernels, auto (the best this CPU runs, "
         "the default) | amx | avx512_bf16 | avx512 | avx2 | generic | off (torch's ops throughout), to compare them on "
         "one machine (torch's own ops follow ATEN_CPU_CAPABILITY, oneDNN's ONEDNN_MAX_CPU_ISA).", SCHEDULER, str,
         ENGINE, "cpu_kernels_isa", parse=lambda value: "off" if value is False else str(value)),  # YAML: off is false
    Flag("dataset", "A JSON Lines dataset (see `kvtool dataset`).", WORKLOAD, Path),
    Flag("config", "A scenario file (bench_configs/NAME.yaml), sweeps included.", WORKLOAD, Path),
    Flag("set", "Override a scenario value: --set bench.max_batch_size=4 (repeatable; needs --config).", WORKLOAD,
         repeatable=True),
    Flag("mode", "offline (default: all queued at the start) | sequential (one at a time) | trace (each at its "
         "arrival_time_s).", WORKLOAD, str, REPLAY, "mode"),
    Flag("concurrency", "Keep N requests in flight.", WORKLOAD, int, REPLAY, "concurrency"),
    Flag("request_rate", "Poisson arrivals at R requests/s (seeded).", WORKLOAD, float, REPLAY, "request_rate"),
    Flag("burstiness", "With --request_rate: gaps between arrivals from a gamma distribution of this shape, as vllm "
         "bench serve's --burstiness: 1 is Poisson (the default), below 1 burstier, above 1 more even.", WORKLOAD,
         float, REPLAY, "burstiness"),
    Flag("seed", "Seed of --request_rate's arrivals and of sampled requests' draws (default 0).", WORKLOAD, int,
         REPLAY, "seed"),
    Flag("warmup", "Run the first N dataset requests first, uncounted.", WORKLOAD, int, REPLAY, "warmup"),
    Flag("time_scale", "Multiply the dataset's arrival times (0.5: twice as fast).", WORKLOAD, float, REPLAY,
         "time_scale"),
    Flag("warmup_counts_in_stats", "Keep the warm-up's cache counters (default: reset after warm-up).", WORKLOAD,
         bool, REPLAY, "warmup_counts_in_stats"),
    # 'num_requests' is the column of the requests that finished.
    Flag("num_requests", "Measure at most N requests.", WORKLOAD, int, REPLAY, "num_requests",
         column="num_requests_limit"),
    Flag("temperature", "Sample every request at this temperature (default 0: greedy, as trtllm-bench); each request "
         "draws from its own stream, seeded by --seed and its line, so a run repeats. Requests still generate "
         "exactly their output tokens. --endpoint: sent to the server, which draws with its own seeds.", SAMPLING,
         float, REPLAY, "temperature"),
    Flag("top_p", "Draw from the smallest set of tokens holding this much probability (default 1: every token; "
         "needs --temperature).", SAMPLING, float, REPLAY, "top_p"),
    Flag("top_k", "Draw from the K most likely tokens (default 0: every token; needs --temperature).", SAMPLING,
         int, REPLAY, "top_k"),
    Flag("output", "Output directory or summary .csv path (default out/<dataset or scenario>-<time>).", OUTPUT, Path),
    Flag("label", "Variant name in the reports (default: the plan/preset name).", OUTPUT),
    Flag("percentiles", "More latency percentiles: --percentiles 95,99.9 (p50, p90 and p99 are always reported).",
         REPORT),
    Flag("slo", "Service-level objectives, e.g. --slo ttft=500ms,tpot=50ms (also e2e; ms or s): report the share of "
         "requests meeting all of them, and goodput.", REPORT),
    Flag("report_json", "Also write the summary as JSON to this file.", REPORT, Path),
    Flag("html", "Also write report.html beside the CSVs: tables, plots and miss reasons in one self-contained page.",
         REPORT, bool),
    Flag("allow_errors", "Exit 0 when requests failed (default: exit 3 once the reports are written).", OUTPUT, bool),
    Flag("replicas", "Simulate a fleet of N replicas, each with its own KV pools and host cache, on one clock; "
         "requests are routed when they arrive (default 1).", FLEET, int),
    Flag("router", "round_robin (default) | least_loaded (fewest requests in flight) | prefix_aware (Dynamo's "
         "cost: prefill blocks not in the router's record of the replica + blocks in flight there).", FLEET),
    Flag("router_block_size", "Tokens per block of prefix_aware's record of what it sent where (default: the "
         "replicas' block size; with --endpoint, kvtool serve's from its /metrics, else 32: give the servers' block "
         "size).", FLEET, int),
    Flag("search", "Search for the cheapest fleet meeting --slo's percentile objectives: --search replicas=1..16 "
         "--search max_batch_size=8,16,32 (repeatable; replicas are binary-searched).", FLEET, repeatable=True),
)
FLAG_BY_NAME: Mapping[str, Flag] = MappingProxyType({flag.name: flag for flag in FLAGS})

# The flags that set configuration: their names are a scenario's `bench:` keys and summary columns, listed
# in the order summary rows have always given them.
CONFIG_FLAGS: tuple[Flag, ...] = tuple(FLAG_BY_NAME[name] for name in (
    "enable_kv_cache_reuse", "kv_host_cache_bytes", "kv_disk_cache_dir", "kv_disk_cache_bytes", "kv_remote_cache",
    "kv_remote_cache_bytes", "max_tokens_in_paged_kv_cache", "kv_cache_free_gpu_mem_fraction",
    "max_attention_window_size", "scheduler_policy", "context_chunking_policy", "enable_chunked_context",
    "max_batch_size", "max_num_tokens", "max_seq_len", "enforce_eager", "tokens_per_block", "mode", "concurrency",
    "request_rate", "seed", "warmup", "warmup_counts_in_stats", "time_scale", "num_requests", "cpu_kernels_isa",
    "temperature", "top_p", "top_k", "burstiness"))
FLAG_NAMES: tuple[str, ...] = tuple(flag.name for flag in CONFIG_FLAGS)
# A simulated engine's only: a remote store's size is a simulation's (a real one's is its server's maxmemory).
SIMULATION_ONLY_FLAGS = ("kv_remote_cache_bytes",)
# A real engine's only: which instruction set a CPU's kernels run is not part of a cost model.
REAL_ENGINE_ONLY_FLAGS = ("cpu_kernels_isa",)
# The flags that configure a real engine (not how a dataset is replayed): what `kvtool serve` takes too.
ENGINE_FLAG_NAMES: tuple[str, ...] = tuple(flag.name for flag in CONFIG_FLAGS
                                           if flag.section != REPLAY and flag.name not in SIMULATION_ONLY_FLAGS)
_FLAG_BY_FIELD = MappingProxyType({(_OWNERS[flag.section], flag.field): flag for flag in CONFIG_FLAGS})


def names_in(*panels: str) -> tuple[str, ...]:
    """The flags of these --help panels, in table (--help) order."""
    return tuple(flag.name for flag in FLAGS if flag.panel in panels)


# The flags of a command that runs an engine (what to run and how it is configured), and those of a
# command that replays a dataset through it (what, how, and what is written).
SIMULATED_ENGINE_FLAGS = tuple(name for name in names_in(MODEL, KV_CACHE, SCHEDULER)
                               if name not in REAL_ENGINE_ONLY_FLAGS)
ENGINE_FLAGS = tuple(name for name in names_in(MODEL, KV_CACHE, SCHEDULER) if name not in SIMULATION_ONLY_FLAGS)
RUN_FLAGS = names_in(WORKLOAD, SAMPLING, OUTPUT, REPORT)
# A fleet's: simulate takes them all, bench --endpoint the router's (its replicas are the servers given).
FLEET_FLAGS = names_in(FLEET)
ROUTER_FLAGS = ("router", "router_block_size")


def either(on: bool | None, off: bool | None, on_name: str, off_name: str) -> bool | None:
    """The value of an on/off flag pair: True, False, or None when neither was given."""
    if on and off:
        raise ValueError(f"--{on_name} and --{off_name} contradict each other: give one of them")
    return True if on else False if off else None


class FlagValues(dict):
    """What a command was given for its flags of the table: every one by name (None: not given), an on/off
    pair as one value under the first flag's name. ``a | b`` joins two groups of a command."""

    @classmethod
    def of_options(cls, options: Mapping[str, Any], names: tuple[str, ...]) -> FlagValues:
        """From the typer options of ``names`` (a pair's second flag by its own name); ValueError when
        both flags of a pair are given."""
        values = {}
        for name in names:
            flag = FLAG_BY_NAME[name]
            values[name] = options.get(name)
            if flag.off is not None:
                values[name] = either(options.get(name), options.get(flag.off), name, flag.off)
        return cls(values)

    def __or__(self, other: Mapping[str, Any]) -> FlagValues:
        return FlagValues({**self, **other})

    def config_flags(self) -> dict[str, Any]:
        """The flags given that set configuration (the table's order): a scenario's overrides, configs()'s input."""
        return {flag.name: self[flag.name] for flag in CONFIG_FLAGS if self.get(flag.name) is not None}


def configs(flags: Mapping[str, Any]) -> tuple[EngineConfig, ReplayOptions]:
    """The configuration the flags ask for (by name; a scenario's `bench:` section or FlagValues.config_flags);
    a bad value is a ValueError naming its flag."""
    sections: dict[str, dict[str, Any]] = {section: {} for section in _OWNERS}
    for name, value in flags.items():
        flag = FLAG_BY_NAME.get(name)
        if flag is None or flag.section is None:
            raise ValueError(f"--{name} is not a bench flag; known: {', '.join(FLAG_NAMES)}")
        try:
            sections[flag.section][flag.field] = flag.parse(value) if flag.parse else value
        except ValueError as error:
            raise ValueError(f"--{name}: {error}") from None
    try:
        engine = EngineConfig(kv_cache_config=KvCacheConfig(**sections[KV]),
                              scheduler_config=SchedulerConfig(**sections[SCHED]), **sections[ENGINE])
        return engine, ReplayOptions(**sections[REPLAY])
    except ConfigError as error:
        flag = _FLAG_BY_FIELD.get((error.owner, error.field))
        if flag is None:
            raise
        raise ValueError(f"--{flag.name} {error.problem}") from None


def as_row(engine: EngineConfig | None, replay: ReplayOptions) -> dict[str, Any]:
    """Every configuration flag's value as its summary column (policies as the flags spell them);
    ``engine=None``: the replay's flags only (a server's engine is configured where it runs)."""
    owners = {KV: None if engine is None else engine.kv_cache_config,
              SCHED: None if engine is None else engine.scheduler_config, ENGINE: engine, REPLAY: replay}
    row = {}
    for flag in CONFIG_FLAGS:
        owner = owners[flag.section]
        if owner is None:
            continue
        value = getattr(owner, flag.field)
        row[flag.column or flag.name] = value.name.lower() if isinstance(value, enum.Enum) else value
    return row


def flags_from_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """The flags a summary row records (read back from CSV text, each value as YAML reads it), so
    that its configuration can be run again (`kvtool explain` simulates what-ifs from it)."""
    import yaml

    flags = {}
    for flag in CONFIG_FLAGS:
        value = row.get(flag.column or flag.name)
        if value is None or value == "":
            continue
        flags[flag.name] = yaml.safe_load(value) if isinstance(value, str) else value
    return flags
