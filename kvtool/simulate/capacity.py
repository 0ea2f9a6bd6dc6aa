"""`kvtool simulate --sweep_capacity`: the reused-token ratio and TTFT of a trace against the KV cache's
capacity, Mooncake's hit-rate-versus-capacity curve for the user's own engine and trace.

The sweep is a grid: the GPU pool (by default a quarter, half and all of what the profile's device
holds, ``GPU_FRACTIONS``, none smaller than the longest request) by the host cache (none, then from
the largest GPU pool's size up by ``HOST_GROWTH`` while the trace can fill it), plus the infinite
cache: a host cache of every block the replay can create (kvtool.workloads.blocks), where nothing
is ever evicted, the trace's theoretical maximum.
Each point is one simulation (kvtool.bench.sweep); its capacity is what the run had, primary and
host tokens, as its summary row says.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from rich.console import Console
from rich.table import Table

from kvtool.config import EngineConfig, ReplayOptions
from kvtool.files import atomic_write
from kvtool.reports.repeats import as_number
from kvtool.workloads.blocks import workload_blocks
from kvtool.workloads.datasets import Dataset
from kvtool.workloads.requests import dataset_requests

GPU_FLAG, HOST_FLAG = "max_tokens_in_paged_kv_cache", "kv_host_cache_bytes"
GPU_FRACTIONS = (0.25, 0.5, 1.0)  # of the device's primary pool
HOST_GROWTH = 4                   # each host cache holds 4 times the previous one
INFINITE = "infinite"             # the label of the infinite cache's variant
CAPACITY_CSV, CAPACITY_PNG = "capacity.csv", "capacity.png"


class PoolProbe(NamedTuple):
    """What the sweep's sizes come from: the device's primary pool for the flags given, and the most
    blocks the replay can create (a host cache of that many never evicts)."""

    num_primary_blocks: int
    tokens_per_block: int
    block_bytes: int
    num_workload_blocks: int
    num_request_blocks: int  # of the longest request (prompt and output): no smaller pool runs the replay


def probe_pools(llm, engine: EngineConfig, replay: ReplayOptions, dataset: Dataset) -> PoolProbe:
    """The pools of ``llm`` (a SimulatedLLM of the flags given) and the blocks replaying ``dataset`` creates."""
    sizes = llm.pool_sizes
    with_host = replace(engine, kv_cache_config=replace(engine.kv_cache_config, host_cache_size=1))
    # (A session's later turn holds its history too: the pre-check names a pool too small for it.)
    longest = max(len(r.prompt_token_ids) + r.sampling_params.max_tokens
                  for r in dataset_requests(dataset, tokenizer=llm.plan.tokenizer))
    return PoolProbe(sizes.num_primary_blocks, sizes.tokens_per_block, sizes.block_bytes,
                     workload_blocks(llm.plan, with_host, replay, dataset), -(-longest // sizes.tokens_per_block))


def capacity_variants(probe: PoolProbe, *, gpu_fixed: bool,
                      explicit: Mapping[str, Sequence[dict]] | None = None) -> list[dict]:
    """The sweep's variants (flag values and a label each), the infinite cache last. ``explicit``: a
    flag's own --sweep values (kvtool.bench.scenario.sweep_variants of one flag) instead of its
    defaults; ``gpu_fixed``: --max_tokens_in_paged_kv_cache is given, only the host cache is swept."""
    tpb, block_bytes = probe.tokens_per_block, probe.block_bytes
    explicit = explicit or {}
    gpu = [{}] if gpu_fixed else explicit.get(GPU_FLAG) or [
        {"label": f"gpu_tokens={blocks * tpb}", GPU_FLAG: blocks * tpb}
        for blocks in sorted({min(probe.num_primary_blocks, max(probe.num_request_blocks,
                                                                  round(probe.num_primary_blocks * f)))
                              for f in GPU_FRACTIONS})]
    # The host cache grows from the largest GPU pool (as large as the device holds at most) by HOST_GROWTH.
    largest_gpu = {} if gpu_fixed else max(gpu, key=lambda g: as_number(g[GPU_FLAG]) or 0)
    asked = as_number(largest_gpu.get(GPU_FLAG))
    size = probe.num_primary_blocks if asked is None else max(1, min(probe.num_primary_blocks, int(asked) // tpb))
    host_blocks = [0]
    while size < probe.num_workload_blocks:  # a larger one than the trace can fill is the infinite cache
        host_blocks.append(size)
        size *= HOST_GROWTH
    host = explicit.get(HOST_FLAG) or [{"label": f"host_tokens={blocks * tpb}", HOST_FLAG: blocks * block_bytes}
                                       for blocks in host_blocks]
    variants = [{**g, **h, "label": ",".join(filter(None, (g.get("label"), h["label"])))} for g in gpu for h in host]
    return variants + [{**largest_gpu, HOST_FLAG: probe.num_workload_blocks * block_bytes, "label": INFINITE}]


class CapacityPoint(NamedTuple):
    """One simulation of the sweep, as capacity.csv has it."""

    label: str
    gpu_pool_tokens: int
    host_cache_tokens: int
    cache_capacity_tokens: int
    reused_token_ratio: float
    ttft_ms_p50: float | None
    ttft_ms_p90: float | None
    infinite_cache: bool


def capacity_points(rows: Sequence[Mapping]) -> list[CapacityPoint]:
    """The sweep's summary rows as points, by capacity (rows of runs that measured nothing are left out)."""
    points = []
    for row in rows:
        prompt, reused = as_number(row.get("total_input_tokens")), as_number(row.get("total_reused_tokens"))
        if not prompt or reused is None:
            continue
        gpu, host = int(row["kv_primary_tokens"]), int(row.get("kv_host_tokens") or 0)
        points.append(CapacityPoint(str(row["label"]), gpu, host, gpu + host, reused / prompt,
                                    as_number(row.get("ttft_ms_p50")), as_number(row.get("ttft_ms_p90")),
                                    row["label"] == INFINITE))
    return sorted(points, key=lambda p: (p.infinite_cache, p.gpu_pool_tokens, p.cache_capacity_tokens))


def print_capacity(points: Sequence[CapacityPoint], console: Console, *, title: str) -> None:
    """One line per point: the pools, the reused-token ratio and predicted TTFT p50 / p90."""
    table = Table(title=f"{title}: reused-token ratio and predicted TTFT against cache capacity")
    for name in ("GPU pool (tokens)", "host cache (tokens)", "capacity (tokens)", "reused-token ratio",
                 "TTFT p50 (ms)", "TTFT p90 (ms)"):
        table.add_column(name, justify="right", no_wrap=True)
    for p in points:
        capacity = "infinite" if p.infinite_cache else f"{p.cache_capacity_tokens:,}"
        table.add_row(f"{p.gpu_pool_tokens:,}", f"{p.host_cache_tokens:,}", capacity, f"{p.reused_token_ratio:.1%}",
                      *("-" if v is None else f"{v:,.1f}" for v in (p.ttft_ms_p50, p.ttft_ms_p90)))
    console.print(table)


def write_capacity_csv(points: Sequence[CapacityPoint], path: Path) -> Path:
    with atomic_write(path, newline="") as out:
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(CapacityPoint._fields)
        writer.writerows(points)
    return path


def plot_capacity(points: Sequence[CapacityPoint], path: Path, *, title: str) -> Path:
    """capacity.png: reused-token ratio (top) and TTFT p50 / p90 (bottom) against cache capacity in tokens
    (log scale), a line per GPU pool size; the infinite cache's figures drawn across as the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ratio_axis, ttft_axis) = plt.subplots(2, 1, sharex=True, figsize=(8.0, 7.0))
    finite = [p for p in points if not p.infinite_cache]
    for index, gpu in enumerate(sorted({p.gpu_pool_tokens for p in finite})):
        line = [p for p in finite if p.gpu_pool_tokens == gpu]
        x = [p.cache_capacity_tokens for p in line]
        color = f"C{index}"
        ratio_axis.plot(x, [p.reused_token_ratio for p in line], "o-", color=color,
                        label=f"GPU pool {gpu:,} tokens")
        ttft_axis.plot(x, [p.ttft_ms_p50 for p in line], "o-", color=color, label=f"p50, GPU pool {gpu:,} tokens")
        ttft_axis.plot(x, [p.ttft_ms_p90 for p in line], "^--", color=color, label=f"p90, GPU pool {gpu:,} tokens")
    for infinite in (p for p in points if p.infinite_cache):
        ratio_axis.axhline(infinite.reused_token_ratio, color="black", linestyle=":",
                           label=f"infinite cache: {infinite.reused_token_ratio:.1%} (theoretical maximum)")
        ratio_axis.plot([infinite.cache_capacity_tokens], [infinite.reused_token_ratio], "k*", markersize=10)
        for value, name in ((infinite.ttft_ms_p50, "p50"), (infinite.ttft_ms_p90, "p90")):
            if value is not None:
                ttft_axis.axhline(value, color="black", linestyle=":" if name == "p50" else "-.", linewidth=1,
                                  label=f"{name}, infinite cache")
    ratio_axis.set_ylabel("reused-token ratio (reused / prompt tokens)")
    ratio_axis.set_ylim(0, 1.0)
    ratio_axis.set_title(title, fontsize="medium")
    ratio_axis.legend(loc="upper left", fontsize="small")
    ttft_axis.set_xscale("log")
    ttft_axis.set_yscale("log")
    ttft_axis.set_xlabel("KV cache capacity (GPU pool + host cache, tokens)")
    ttft_axis.set_ylabel("predicted TTFT (ms)")
    ttft_axis.legend(loc="best", fontsize="x-small", ncol=2)
    ratio_axis.grid(True, which="both", alpha=0.3)
    ttft_axis.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
