"""The flags that configure kvtool's engine (what to serve, the KV cache, the scheduler), declared once
for every command that runs one: `kvtool bench` and `kvtool serve` name these types in their
signatures, so a flag's spelling, help and panel cannot drift between the two.

Each name is also a key of the bench flag table (kvtool.bench.config.FLAGS) where it sets a
configuration field; ``engine_flag_values`` collects them from a command's parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from kvtool.bench.config import FLAG_NAMES
from kvtool.cli.options import either, flag, toggle

MODEL, KV_CACHE, SCHEDULER = "Model and plan", "KV cache", "Scheduler"

Plan = Annotated[Path | None, flag("plan", "A plan directory built by `kvtool build`.", MODEL)]
Model = Annotated[str | None, flag("model", "preset:NAME, a Hugging Face checkpoint directory, a .gguf file or "
                                   "gguf:NAME, built on the fly (bench --config: replaces the scenario's model).",
                                   MODEL)]
TokensPerBlock = Annotated[int | None, flag("tokens_per_block", "Block size: a build option for --model (one plan "
                                            "per value), checked against --plan.", MODEL)]
PlanCacheDir = Annotated[Path | None, flag("plan_cache_dir", "Where plans built on the fly go (default "
                                           "$KVTOOL_CACHE_DIR or ~/.cache/kvtool/plans; see `kvtool plans`).", MODEL)]
EnableKvCacheReuse = Annotated[bool | None, toggle("enable_kv_cache_reuse", "Reuse cached KV blocks of shared "
                                                   "prefixes (the default).", KV_CACHE)]
DisableKvCacheReuse = Annotated[bool | None, toggle("disable_kv_cache_reuse", "Compute every prompt in full.",
                                                    KV_CACHE)]
MaxTokensInPagedKvCache = Annotated[int | None, flag(
    "max_tokens_in_paged_kv_cache", "Primary pool size in tokens (the smaller of this and the memory fraction's "
    "budget).", KV_CACHE)]
KvCacheFreeGpuMemFraction = Annotated[float | None, flag(
    "kv_cache_free_gpu_mem_fraction", "Fraction of the free memory (a CPU: available host memory) for the primary "
    "pool (default 0.9; a CPU pool without max_tokens: 256 MiB at most).", KV_CACHE)]
KvHostCacheBytes = Annotated[str | None, flag("kv_host_cache_bytes", "Host memory for offloaded blocks: bytes or "
                                              "512MB / 1GiB (default 0: no offloading).", KV_CACHE)]
MaxAttentionWindowSize = Annotated[int | None, flag("max_attention_window_size", "Sliding attention window (tokens).",
                                                    KV_CACHE)]
SchedulerPolicy = Annotated[str | None, flag("scheduler_policy", "guaranteed_no_evict (default) | max_utilization | "
                                             "static_batch.", SCHEDULER)]
EnableChunkedContext = Annotated[bool | None, toggle("enable_chunked_context", "Split long contexts into chunks.",
                                                     SCHEDULER)]
DisableChunkedContext = Annotated[bool | None, toggle("disable_chunked_context", "Each context in one step (the "
                                                      "default).", SCHEDULER)]
ContextChunkingPolicy = Annotated[str | None, flag("context_chunking_policy", "first_come_first_served (default) | "
                                                   "equal_progress.", SCHEDULER)]
MaxBatchSize = Annotated[int | None, flag("max_batch_size", "Requests per step (default: the plan's).", SCHEDULER)]
MaxNumTokens = Annotated[int | None, flag("max_num_tokens", "Tokens per step (default: the plan's).", SCHEDULER)]
MaxSeqLen = Annotated[int | None, flag("max_seq_len", "Longest prompt + output (default: the plan's).", SCHEDULER)]
EnforceEager = Annotated[bool | None, toggle("enforce_eager", "No CUDA graphs: every step launches its kernels one "
                                            "by one (on a GPU, decode steps replay graphs by default).", SCHEDULER)]

# The on/off pairs: one configuration field each, two flags on the command line.
_PAIRS = (("enable_kv_cache_reuse", "disable_kv_cache_reuse"), ("enable_chunked_context", "disable_chunked_context"))


def engine_flag_values(params: Mapping[str, Any], names: tuple[str, ...] = FLAG_NAMES) -> dict[str, Any]:
    """The flags given (not None) among ``names``, by their bench flag name, on/off pairs resolved
    (ValueError when both of a pair are given)."""
    given = {name: params.get(name) for name in names}
    for on, off in _PAIRS:
        if on in given:
            given[on] = either(params.get(on), params.get(off), on, off)
    return {name: value for name, value in given.items() if value is not None}
