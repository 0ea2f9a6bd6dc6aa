"""GPU benchmark suite for kvtool's CUDA kernels, each against a baseline measured in the same run.

Sections (``--sections``, default all):
  copy     device-to-device copy bandwidth (the decode baseline) and pinned host<->device bandwidth
  decode   paged decode attention effective bandwidth (KV bytes read / time) vs the D2D copy
           bandwidth; batch 64 and batch 1, context 4096, 32 query / 8 KV heads, head_dim 128
           (target >= 0.8 both); batch 1 at every split-K partition size, and the one chosen
  context  paged context attention throughput vs the fastest torch SDPA backend (flash, cuDNN) on
           the same data laid out contiguously; 4 x 4096-token causal prefills (target >= 0.8)
  blocks   host<->device block copy (copy engines "memcpy" and the SM kernel, scattered ids) vs one
           plain pinned copy of the same bytes (target >= 0.8)
  swap     offload + onboard in one step: one stream after the other vs both directions at once
  e2e      preset:qwen3-8b through kvtool.LLM (bench/gpu_e2e.py): TTFT reuse off / on for a 2k shared
           prompt + 128-token question (target >= 10), TPOT / TTFT of an identical 4k prompt sent
           back to back (target >= 1/1.5), A,B,A,B 4k TTFT recompute / onboard (target >= 8);
           guarded: a failure there is recorded and the kernel sections still report

Timing: CUDA events around each call, the GPU kept busy by a sleep kernel while Python enqueues
(so launch overhead does not leave gaps inside the timed region), warm-up, median of --reps.
Writes ``<output>/gpu_suite.csv`` and ``<output>/gpu_suite.md``.

    python bench/gpu_suite.py --output out/gpu_suite
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from gpu_reports import median_gpu_ms

SECTIONS = ("copy", "decode", "context", "blocks", "swap", "e2e")
SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time: covers Python launch overhead of one timed call


@dataclass
class Row:
    section: str
    case: str
    metric: str
    value: float
    unit: str
    baseline: float | None = None  # the same-run figure the value is compared with
    ratio: float | None = None     # value / baseline (higher is better)
    target: float | None = None    # required ratio


class Suite:
    """Collects rows; one section failing does not stop the others."""

    def __init__(self, reps: int, warmup: int) -> None:
        self.reps, self.warmup = reps, warmup
        self.rows: list[Row] = []
        self.errors: list[str] = []
        self.baselines: dict[str, float] = {}

    def add(self, row: Row) -> None:
        self.rows.append(row)
        ratio = f"  ratio {row.ratio:.3f} (target {row.target})" if row.ratio is not None else ""
        print(f"[{row.section}] {row.case}: {row.metric} = {row.value:.4g} {row.unit}{ratio}", flush=True)

    def time_ms(self, fn: Callable[[], None]) -> float:
        """Median GPU time (ms) of fn() on the current stream."""
        return median_gpu_ms(fn, self.reps, self.warmup, SLEEP_CYCLES)


# ---- baselines ----

def _d2d_bandwidth(suite: Suite, num_bytes: int) -> float:
    """GB/s of a device-to-device copy, counting read + write traffic (as decode counts its reads)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = suite.time_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def section_copy(suite: Suite) -> None:
    d2d = _d2d_bandwidth(suite, 1 << 30)
    suite.baselines["d2d_GBps"] = d2d
    suite.add(Row("copy", "device->device 1 GiB", "bandwidth (read+write)", d2d, "GB/s"))
    host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty(host.shape, dtype=torch.uint8, device="cuda")
    for name, fn in (("host->device", lambda: dev.copy_(host, non_blocking=True)),
                     ("device->host", lambda: host.copy_(dev, non_blocking=True))):
        ms = suite.time_ms(fn)
        bandwidth = host.numel() / (ms * 1e-3) / 1e9
        suite.baselines[f"{name}_GBps"] = bandwidth
        suite.add(Row("copy", f"{name} pinned 256 MiB", "bandwidth", bandwidth, "GB/s"))


# ---- paged attention inputs ----

def paged_inputs(batch: int, seq_len: int, query_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 tokens_per_block: int, dtype: torch.dtype, seed: int = 0):
    """Random pool with each sequence's blocks scattered (random permutation), metadata tensors."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = math.ceil(seq_len / tokens_per_block)
    num_blocks = batch * blocks_per_seq
    pool = torch.randn((num_blocks, 2, tokens_per_block, num_kv_heads, head_dim), generator=gen, device="cuda",
                       dtype=torch.float32).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=gen, device="cuda").view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * query_len
    query = torch.randn((batch * query_len, num_heads, head_dim), generator=gen, device="cuda").to(dtype)
    return pool, block_tables, seq_lens, query_start_loc, query


def section_decode(suite: Suite, library, dtype: torch.dtype) -> None:
    from kvtool.kernels.loader import device_sm_count
    from kvtool.kernels.paged_decode_attention import (PARTITION_SIZES, num_partitions, paged_decode_attention,
                                                       partition_size_for)

    d2d = suite.baselines.get("d2d_GBps")
    cases = [(64, 4096, 16, 0.8), (1, 4096, 32, 0.8), (64, 4096, 64, None), (8, 16384, 16, None),
             (1, 32768, 16, None)]
    for batch, seq_len, tpb, target in cases:
        num_heads, num_kv_heads, head_dim = 32, 8, 128
        pool, tables, seq_lens, qsl, query = paged_inputs(batch, seq_len, 1, num_heads, num_kv_heads, head_dim,
                                                          tpb, dtype)
        out = torch.empty_like(query)
        kv_bytes = batch * seq_len * num_kv_heads * head_dim * 2 * pool.element_size()
        chosen = partition_size_for(num_kv_heads * batch, device_sm_count(pool.device))

        def run(max_seq_len=seq_len, partition_size=None, unroll=4):
            paged_decode_attention(library, query, pool, tables, qsl, seq_lens, seq_offset=0, num_seqs=batch,
                                   max_seq_len=max_seq_len, scale=head_dim ** -0.5, sliding_window=None, out=out,
                                   partition_size=partition_size, unroll=unroll)

        ms = suite.time_ms(run)
        bandwidth = kv_bytes / (ms * 1e-3) / 1e9
        case = (f"batch {batch} x ctx {seq_len}, tpb {tpb}, 32/8 heads, hd 128, partitions of {chosen} keys "
                f"({num_partitions(seq_len, chosen)} each)")
        suite.add(Row("decode", case, "time", ms, "ms"))
        suite.add(Row("decode", case, "effective KV bandwidth", bandwidth, "GB/s", d2d,
                      bandwidth / d2d if d2d else None, target))
        if target is None:
            continue
        # The knobs on the target cases: keys per split-K partition (what partition_size_for picks
        # from), and 16-byte loads in flight at batch 64.
        knobs = [(size, 4) for size in PARTITION_SIZES if size != chosen]
        if batch == 64:
            knobs += [(512, 8), (512, 2)]
        for partition_size, unroll in knobs:
            bandwidth = kv_bytes / (suite.time_ms(lambda p=partition_size, u=unroll: run(partition_size=p, unroll=u))
                                    * 1e-3) / 1e9
            suite.add(Row("decode", f"batch {batch} x ctx {seq_len}: partition {partition_size}, unroll {unroll}",
                          "effective KV bandwidth", bandwidth, "GB/s", d2d, bandwidth / d2d if d2d else None))
        # A CUDA graph's grid is sized for the runtime's max_seq_len: the partitions past each
        # sequence's end return at once. What that costs here, for a 40k max_seq_len:
        bandwidth = kv_bytes / (suite.time_ms(lambda: run(max_seq_len=40960)) * 1e-3) / 1e9
        suite.add(Row("decode", f"batch {batch} x ctx {seq_len}: grid for max_seq_len 40960 "
                      f"({num_partitions(40960, chosen)} partitions)", "effective KV bandwidth", bandwidth, "GB/s",
                      d2d, bandwidth / d2d if d2d else None))


def section_context(suite: Suite, library, dtype: torch.dtype) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kvtool.kernels.paged_context_attention import paged_context_attention

    batch, seq_len, num_heads, num_kv_heads, head_dim = 4, 4096, 32, 8, 128
    scale = head_dim ** -0.5
    flops = 4 * batch * num_heads * head_dim * seq_len * (seq_len + 1) / 2  # causal: half the square
    fastest = None
    for tpb in (16, 32, 64):
        pool, tables, seq_lens, qsl, query = paged_inputs(batch, seq_len, seq_len, num_heads, num_kv_heads,
                                                          head_dim, tpb, dtype)
        out = torch.empty_like(query)

        def run():
            paged_context_attention(library, query, pool, tables, qsl, seq_lens, num_seqs=batch,
                                    max_query_len=seq_len, max_seq_len=seq_len, scale=scale, sliding_window=None,
                                    out=out)

        ms = suite.time_ms(run)
        ours = flops / (ms * 1e-3) / 1e12
        if fastest is None:
            # The same keys/values, gathered out of the pool into contiguous [batch, heads, seq, dim]
            # (K/V heads expanded: every backend takes that), for each SDPA backend this torch has.
            order = tables.long().flatten()
            kv = pool[order].view(batch, -1, 2, tpb, num_kv_heads, head_dim)
            group = num_heads // num_kv_heads
            k = kv[:, :, 0].reshape(batch, -1, num_kv_heads, head_dim)[:, :seq_len].transpose(1, 2)
            v = kv[:, :, 1].reshape(batch, -1, num_kv_heads, head_dim)[:, :seq_len].transpose(1, 2)
            k = k.repeat_interleave(group, dim=1).contiguous()
            v = v.repeat_interleave(group, dim=1).contiguous()
            q = query.view(batch, seq_len, num_heads, head_dim).transpose(1, 2).contiguous()
            run()
            ours_out = out.view(batch, seq_len, num_heads, head_dim).transpose(1, 2).float()
            rates = {}
            for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
                backend = getattr(SDPBackend, name, None)
                if backend is None:
                    continue
                try:
                    with sdpa_kernel([backend]):
                        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
                        sdpa_ms = suite.time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                       scale=scale))
                except RuntimeError as error:  # not built into this torch, or refuses these shapes
                    suite.errors.append(f"context: SDPA {name} unavailable: {error}")
                    continue
                rates[name] = flops / (sdpa_ms * 1e-3) / 1e12
                suite.add(Row("context", f"torch SDPA {name.lower()}, contiguous", "throughput", rates[name],
                              "TFLOP/s"))
                suite.add(Row("context", f"paged kernel vs SDPA {name.lower()} output", "max abs difference",
                              (ours_out - expected.float()).abs().max().item(), ""))
            fastest = max(rates.values()) if rates else float("nan")
        case = f"{batch} x {seq_len} causal prefill, tpb {tpb}, 32/8 heads, hd 128"
        suite.add(Row("context", case, "time", ms, "ms"))
        suite.add(Row("context", case, "throughput", ours, "TFLOP/s", fastest, ours / fastest, 0.8))
    # Reuse: the second half of each sequence attends to a cached first half (read from the cache).
    query_len = seq_len // 2
    pool, tables, seq_lens, qsl, query = paged_inputs(batch, seq_len, query_len, num_heads, num_kv_heads,
                                                      head_dim, 32, dtype)
    out = torch.empty_like(query)

    def run_chunk():
        paged_context_attention(library, query, pool, tables, qsl, seq_lens, num_seqs=batch,
                                max_query_len=query_len, max_seq_len=seq_len, scale=scale, sliding_window=None,
                                out=out)

    ms = suite.time_ms(run_chunk)
    chunk_flops = 4 * batch * num_heads * head_dim * query_len * (seq_len - query_len + (query_len + 1) / 2)
    case = f"{batch} x {query_len} new tokens over a cached {seq_len - query_len}-token prefix, tpb 32"
    suite.add(Row("context", case, "time", ms, "ms"))
    suite.add(Row("context", case, "throughput", chunk_flops / (ms * 1e-3) / 1e12, "TFLOP/s"))
    section_context_hit(suite, library, dtype)


def section_context_hit(suite: Suite, library, dtype: torch.dtype) -> None:
    """gpu_e2e's reuse hit, one layer: a 128-token question over a cached 2,048-token prefix is one
    query tile per head (32 CTAs), timed with the keys split (the launcher's choice) and unsplit."""
    from kvtool.kernels.loader import device_sm_count
    from kvtool.kernels.paged_context_attention import key_splits, paged_context_attention

    num_heads, num_kv_heads, head_dim, query_len, seq_len = 32, 8, 128, 128, 2176
    scale = head_dim ** -0.5
    pool, tables, seq_lens, qsl, query = paged_inputs(1, seq_len, query_len, num_heads, num_kv_heads, head_dim, 32,
                                                      dtype, seed=3)
    chosen = key_splits(num_heads, seq_len, head_dim, device_sm_count()).num_splits
    flops = 4 * num_heads * head_dim * query_len * (seq_len - query_len + (query_len + 1) / 2)
    times, outputs = {}, {}
    for splits in dict.fromkeys((1, chosen)):
        out = torch.empty_like(query)

        def run(splits=splits, out=out):
            paged_context_attention(library, query, pool, tables, qsl, seq_lens, num_seqs=1, max_query_len=query_len,
                                    max_seq_len=seq_len, scale=scale, sliding_window=None, out=out,
                                    num_splits=splits)

        times[splits] = suite.time_ms(run)
        outputs[splits] = out.float()
        case = f"1 x {query_len} new tokens over a cached {seq_len - query_len}-token prefix, {splits} key split(s)"
        suite.add(Row("context", case, "time", times[splits] * 1e3, "us"))
        suite.add(Row("context", case, "throughput", flops / (times[splits] * 1e-3) / 1e12, "TFLOP/s"))
    suite.add(Row("context", f"1 x {query_len} over {seq_len - query_len}: unsplit / {chosen} key splits", "speed-up",
                  times[1] / times[chosen], "x"))
    suite.add(Row("context", f"1 x {query_len} over {seq_len - query_len}: split vs unsplit output",
                  "max abs difference", (outputs[chosen] - outputs[1]).abs().max().item(), ""))


def section_blocks(suite: Suite, library, dtype: torch.dtype) -> None:
    from kvtool.kernels.block_copy import copy_blocks

    # qwen3-8b block geometry: 36 layers x K/V x 16 tokens x 8 kv heads x 128 dims (2.36 MB in 16 bits).
    block_dims = (36, 2, 16, 8, 128)
    num_device_blocks, num_host_blocks, num_ops = 256, 160, 64
    device_pool = torch.randn((num_device_blocks, *block_dims), device="cuda").to(dtype)
    per_chunk = max(1, (64 << 20) // (device_pool[0].numel() * device_pool.element_size()))
    host_chunks = [torch.empty((min(per_chunk, num_host_blocks - start), *block_dims), dtype=dtype).pin_memory()
                   for start in range(0, num_host_blocks, per_chunk)]
    gen = torch.Generator().manual_seed(0)
    device_ids = torch.randperm(num_device_blocks, generator=gen)[:num_ops].tolist()
    host_ids = torch.randperm(num_host_blocks, generator=gen)[:num_ops].tolist()
    num_bytes = num_ops * device_pool[0].numel() * device_pool.element_size()
    staging_host = torch.empty((num_ops, *block_dims), dtype=dtype).pin_memory()
    staging_device = torch.empty((num_ops, *block_dims), dtype=dtype, device="cuda")
    directions = {
        "device->host (offload)": (device_pool, host_chunks, device_ids, host_ids,
                                   lambda: staging_host.copy_(staging_device, non_blocking=True)),
        "host->device (onboard)": (host_chunks, device_pool, host_ids, device_ids,
                                   lambda: staging_device.copy_(staging_host, non_blocking=True)),
    }
    for direction, (src, dst, src_ids, dst_ids, plain_copy) in directions.items():
        baseline = num_bytes / (suite.time_ms(plain_copy) * 1e-3) / 1e9
        suite.add(Row("blocks", f"{direction}: one pinned copy of {num_bytes / 1e6:.0f} MB", "bandwidth",
                      baseline, "GB/s"))
        for method in ("memcpy", "kernel"):
            def run(src=src, dst=dst, src_ids=src_ids, dst_ids=dst_ids, method=method):
                copy_blocks(src, dst, src_ids, dst_ids, torch.cuda.current_stream(), method=method, library=library)

            bandwidth = num_bytes / (suite.time_ms(run) * 1e-3) / 1e9
            suite.add(Row("blocks", f"{direction}: {num_ops} scattered 2.36 MB blocks, {method}", "bandwidth",
                          bandwidth, "GB/s", baseline, bandwidth / baseline, 0.8))


def section_swap(suite: Suite, library, dtype: torch.dtype) -> None:
    """A step that offloads one request's blocks while onboarding another's (the A,B,A,B pattern):
    one stream after the other vs the two directions on two streams at once (PCIe is full duplex),
    and the runtime's own step (KvCachePools.execute_copies: offloads then onboards layer by layer
    on two streams) with each copy method, against the pinned copies' bandwidths of this run
    (target >= 0.8 of host->device + device->host)."""
    import numpy as np

    from kvtool._core import PoolKind
    from kvtool.kernels.block_copy import copy_blocks
    from kvtool.runtime.copy_batches import copy_batches
    from kvtool.runtime.kv_pool import BlockShape, KvCachePools

    block_dims = (36, 2, 16, 8, 128)  # qwen3-8b, 16-token blocks
    num_ops = 64
    device_pool = torch.randn((2 * num_ops, *block_dims), device="cuda").to(dtype)
    host_pool = torch.empty((2 * num_ops, *block_dims), dtype=dtype).pin_memory()
    out_ids, in_ids = list(range(num_ops)), list(range(num_ops, 2 * num_ops))
    num_bytes = 2 * num_ops * device_pool[0].numel() * device_pool.element_size()  # both directions
    second = torch.cuda.Stream()
    for method in ("memcpy", "kernel"):
        def sequential(method=method):
            stream = torch.cuda.current_stream()
            copy_blocks(device_pool, host_pool, out_ids, out_ids, stream, method=method, library=library)
            copy_blocks(host_pool, device_pool, in_ids, in_ids, stream, method=method, library=library)

        def overlapped(method=method):
            current = torch.cuda.current_stream()
            second.wait_stream(current)
            copy_blocks(device_pool, host_pool, out_ids, out_ids, current, method=method, library=library)
            copy_blocks(host_pool, device_pool, in_ids, in_ids, second, method=method, library=library)
            current.wait_stream(second)

        one = num_bytes / (suite.time_ms(sequential) * 1e-3) / 1e9
        two = num_bytes / (suite.time_ms(overlapped) * 1e-3) / 1e9
        case = f"offload {num_ops} + onboard {num_ops} blocks of 2.36 MB, {method}"
        suite.add(Row("swap", f"{case}, one stream", "bandwidth (both directions)", one, "GB/s"))
        suite.add(Row("swap", f"{case}, two streams", "bandwidth (both directions)", two, "GB/s", one, two / one))

    pinned = suite.baselines.get("host->device_GBps", 0) + suite.baselines.get("device->host_GBps", 0)
    shape = BlockShape(num_layers=36, tokens_per_block=16, num_kv_heads=8, head_dim=128, dtype=dtype)
    primary, secondary = PoolKind.PRIMARY.value, PoolKind.SECONDARY.value
    # Offload blocks 0..n-1 to host blocks 0..n-1, onboard host blocks n..2n-1 into the freed blocks.
    ops = [(primary, b, secondary, b, 16) for b in range(num_ops)] + \
          [(secondary, num_ops + b, primary, b, 16) for b in range(num_ops)]
    src_pool, src, dst_pool, dst, tokens = (np.array(column) for column in zip(*ops))
    for method in ("memcpy", "kernel"):
        pools = KvCachePools(shape, num_primary_blocks=num_ops, num_secondary_blocks=2 * num_ops,
                             device=torch.device("cuda"), kernels=library, copy_method=method)
        for block in range(2 * num_ops):
            pools.host.block(block)  # allocated before timing (in the runtime: ahead of need)

        def step(pools=pools):
            pools.execute_copies(src_pool, src, dst_pool, dst, tokens)
            pools.wait_for_all_copies()  # the forward's waits, all at once

        both = num_bytes / (suite.time_ms(step) * 1e-3) / 1e9
        batches = copy_batches(src_pool, src, dst_pool, dst, tokens)
        layered = pools.copies_layer_by_layer(batches)
        how = f"{pools.step_copy_method(batches, layered)}, {'layer by layer' if layered else 'whole blocks'}"
        suite.add(Row("swap", f"runtime step: offload {num_ops} + onboard {num_ops} blocks, {method}: {how}",
                      "bandwidth (both directions)", both, "GB/s", pinned or None, both / pinned if pinned else None,
                      0.8))
        del pools


def section_e2e(suite: Suite, model: str, dtype: str, prefix_len: int, question_len: int, long_len: int,
                repeats: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_e2e import measure

    for row in measure(model, dtype, prefix_len=prefix_len, question_len=question_len, long_len=long_len,
                       repeats=repeats):
        suite.add(Row("e2e", row.case, row.metric, row.value, row.unit, row.baseline, row.ratio, row.target))


def write_reports(suite: Suite, output: Path, header: dict[str, str]) -> None:
    output.mkdir(parents=True, exist_ok=True)
    with open(output / "gpu_suite.csv", "w", newline="") as handle:
        fields = list(header) + list(asdict(suite.rows[0]).keys()) if suite.rows else list(header)
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in suite.rows:
            writer.writerow({**header, **asdict(row)})
    lines = ["# kvtool GPU suite", ""] + [f"- {k}: {v}" for k, v in header.items()] + [""]
    lines += ["| section | case | metric | value | unit | baseline | ratio | target |", "|---|---|---|---|---|---|---|---|"]
    for r in suite.rows:
        fmt = lambda x: "" if x is None else f"{x:.4g}"  # noqa: E731
        verdict = "" if r.ratio is None or r.target is None else (" (met)" if r.ratio >= r.target else " (missed)")
        lines.append(f"| {r.section} | {r.case} | {r.metric} | {r.value:.4g} | {r.unit} | {fmt(r.baseline)} | "
                     f"{fmt(r.ratio)}{verdict} | {fmt(r.target)} |")
    if suite.errors:
        lines += ["", "## Errors", ""] + [f"```\n{e}\n```" for e in suite.errors]
    (output / "gpu_suite.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="directory for gpu_suite.csv / gpu_suite.md")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per measurement (median)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--e2e_model", default="preset:qwen3-8b")
    parser.add_argument("--e2e_prefix_len", type=int, default=2048)
    parser.add_argument("--e2e_question_len", type=int, default=128)
    parser.add_argument("--e2e_long_len", type=int, default=4000)
    parser.add_argument("--e2e_repeats", type=int, default=7)
    args = parser.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}: choose from {SECTIONS}")
    if args.reps < 20:
        parser.error("--reps must be at least 20 (medians of >= 20 repetitions)")
    if not torch.cuda.is_available():
        print("gpu_suite: no CUDA device", file=sys.stderr)
        return 2

    from kvtool.kernels.loader import KernelLibrary

    dtype = getattr(torch, args.dtype)
    suite = Suite(args.reps, args.warmup)
    library = KernelLibrary()
    header = {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "torch": torch.__version__,
              "torch_cuda": str(torch.version.cuda)}
    try:
        import cupy

        header["cupy"] = cupy.__version__
        header["kernel_compilers"] = " / ".join(b.identity for b in library.compiler.backends)
    except Exception as error:  # noqa: BLE001 - reported, the baselines still run
        suite.errors.append(f"kernel toolchain: {error}")
    runners = {
        "copy": lambda: section_copy(suite),
        "decode": lambda: section_decode(suite, library, dtype),
        "context": lambda: section_context(suite, library, dtype),
        "blocks": lambda: section_blocks(suite, library, dtype),
        "swap": lambda: section_swap(suite, library, dtype),
        "e2e": lambda: section_e2e(suite, args.e2e_model, args.dtype, args.e2e_prefix_len, args.e2e_question_len,
                                   args.e2e_long_len, args.e2e_repeats),
    }
    if "decode" in sections and "copy" not in sections:
        sections.insert(0, "copy")  # the decode ratio needs the D2D baseline of this run
    for name in sections:
        try:
            runners[name]()
        except Exception:  # noqa: BLE001 - one section's failure must not hide the others' figures
            suite.errors.append(f"section {name} failed:\n{traceback.format_exc()}")
            print(suite.errors[-1], file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
    write_reports(suite, args.output, header)
    return 1 if suite.errors else 0


if __name__ == "__main__":
    sys.exit(main())
