"""Launches and host time per engine step, with CUDA graphs and without (issue 21, target 2).

Three steps of one request each, run through the LLM's ModelRunner directly on scratch blocks:
  decode    one new token over a 2,176-token context
  128       128 new tokens over a cached 2,048-token prefix (the reuse workload's hit)
  2048      a 2,048-token prompt from scratch
For each, with the runner's CUDA graphs (decode and prefill / mixed buckets) and with them set aside:
  - launches per step: the host's CUDA launch calls (cudaLaunchKernel, cuLaunchKernel, cudaGraphLaunch,
    cudaMemcpy*Async, cudaMemsetAsync), and the kernels the GPU ran (a graph's nodes count one each),
    from the torch profiler (CUPTI) over PROFILED_STEPS steps;
  - host us per step: median time until ModelRunner.execute returns (it returns without waiting for
    the GPU), measured without the profiler; GPU us per step: CUDA events around the same call.
A step is launch-bound when its host time reaches its GPU time. Target: host time <= 1 ms for steps of
up to 512 tokens (decode, 128).

bench/gpu_e2e.py runs this on its reuse LLM after its own figures (the steps write scratch blocks, so
they run last). Alone:
    python bench/gpu_steps.py --model preset:qwen3-8b --output out/steps
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np
import torch

from gpu_reports import write_rows_csv

from kvtool.runtime.model_runner import StepRequest

PROFILED_STEPS = 3
HOST_TARGET_US = 1000.0
# Host-side CUDA API calls that enqueue work (runtime and driver spellings; CuPy launches through the driver).
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cuGraphLaunch", "cudaMemcpyAsync", "cudaMemcpy2DAsync", "cuMemcpyAsync", "cuMemcpyHtoDAsync_v2",
                "cudaMemsetAsync", "cuMemsetD8Async")
GRAPH_CALLS = ("cudaGraphLaunch", "cuGraphLaunch")


class LaunchCounts(NamedTuple):
    host_calls: int     # API calls that enqueue GPU work (each a launch of a kernel, graph, copy or memset)
    graph_launches: int
    gpu_kernels: int    # kernels the GPU ran (graph nodes included)
    gpu_copies: int     # copies and memsets the GPU ran


def count_launches(events: Iterable) -> LaunchCounts:
    """Counts a profile's events (``prof.events()``: objects with ``name`` and ``device_type``)."""
    host = graphs = kernels = copies = 0
    for event in events:
        name = event.name
        on_gpu = str(event.device_type).endswith("CUDA")
        if on_gpu:
            if name.startswith(("Memcpy", "Memset")):
                copies += 1
            else:
                kernels += 1
        elif name in LAUNCH_CALLS:
            host += 1
            graphs += name in GRAPH_CALLS
    return LaunchCounts(host, graphs, kernels, copies)


class StepRow(NamedTuple):
    case: str
    cuda_graphs: str          # "on" or "off"
    host_launch_calls: float  # per step
    graph_launches: float
    gpu_kernels: float
    gpu_copies: float
    host_us: float            # median, until ModelRunner.execute returns
    gpu_us: float             # median, CUDA events around the step
    target_host_us: float | None = None


def step_requests(tokens_per_block: int, context_len: int, question_len: int, prefill_len: int):
    """(case name, [StepRequest]) of the three steps, on scratch blocks 0, 1, ..."""
    def blocks(num_tokens: int) -> np.ndarray:
        return np.arange(-(-(num_tokens + 1) // tokens_per_block), dtype=np.int32)

    total = context_len + question_len
    return [
        (f"decode (1 token over {total:,})", [StepRequest(np.array([11], np.int32), blocks(total + 1), total, False,
                                                           True)]),
        (f"{question_len} tokens over a cached {context_len:,}",
         [StepRequest(np.arange(question_len, dtype=np.int32) % 1000 + 100, blocks(total), context_len, True, True)]),
        (f"{prefill_len:,}-token prompt", [StepRequest(np.arange(prefill_len, dtype=np.int32) % 1000 + 100,
                                                       blocks(prefill_len), 0, True, True)]),
    ]


def _time_step(runner, requests, repeats: int) -> tuple[float, float]:
    """(median host us, median GPU us) of runner.execute(requests)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host, gpu = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        runner.execute(requests)
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3)
    return statistics.median(host), statistics.median(gpu)


def measure_steps(llm, *, context_len: int = 2048, question_len: int = 128, prefill_len: int = 2048,
                  repeats: int = 10) -> list[StepRow]:
    """The three steps with the LLM's CUDA graphs on and off. Writes KV into blocks 0, 1, ...: run it
    when the LLM's cached blocks are no longer needed."""
    from torch.profiler import ProfilerActivity, profile

    runner = llm.engine.executor
    saved = runner.decode_graphs, runner.mixed_graphs
    rows = []
    try:
        for graphs in (True, False):
            runner.decode_graphs, runner.mixed_graphs = saved if graphs else (None, None)
            for case, requests in step_requests(runner.tokens_per_block, context_len, question_len, prefill_len):
                for _ in range(2):  # warm: kernels loaded, allocator grown
                    runner.execute(requests)
                host_us, gpu_us = _time_step(runner, requests, repeats)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(PROFILED_STEPS):
                        runner.execute(requests)
                    torch.cuda.synchronize()
                counts = count_launches(prof.events())
                small = len(requests[0].token_ids) <= 512
                rows.append(StepRow(case, "on" if graphs and saved != (None, None) else "off",
                                    counts.host_calls / PROFILED_STEPS, counts.graph_launches / PROFILED_STEPS,
                                    counts.gpu_kernels / PROFILED_STEPS, counts.gpu_copies / PROFILED_STEPS,
                                    host_us, gpu_us, HOST_TARGET_US if small and graphs else None))
                print(format_row(rows[-1]), flush=True)
    finally:
        runner.decode_graphs, runner.mixed_graphs = saved
    return rows


def format_row(row: StepRow) -> str:
    verdict = ""
    if row.target_host_us is not None:
        verdict = f"  (target host <= {row.target_host_us:.0f} us: {'met' if row.host_us <= row.target_host_us else 'missed'})"
    bound = "launch-bound" if row.host_us >= row.gpu_us else "GPU-bound"
    return (f"{row.case}, graphs {row.cuda_graphs}: {row.host_launch_calls:.0f} launch calls "
            f"({row.graph_launches:.0f} graph), {row.gpu_kernels:.0f} kernels, host {row.host_us:.0f} us, "
            f"GPU {row.gpu_us:.0f} us: {bound}{verdict}")


def write_reports(rows: list[StepRow], output: Path, header: dict[str, str]) -> None:
    write_rows_csv(output / "gpu_steps.csv", rows, header)
    lines = ["# kvtool: launches and host time per step", ""] + [f"- {k}: {v}" for k, v in header.items()] + [""]
    lines += ["| step | CUDA graphs | launch calls | graph launches | GPU kernels | host us | GPU us | target |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        target = "" if r.target_host_us is None else \
            f"host <= {r.target_host_us:.0f} us ({'met' if r.host_us <= r.target_host_us else 'missed'})"
        lines.append(f"| {r.case} | {r.cuda_graphs} | {r.host_launch_calls:.0f} | {r.graph_launches:.0f} | "
                     f"{r.gpu_kernels:.0f} | {r.host_us:.0f} | {r.gpu_us:.0f} | {target} |")
    (output / "gpu_steps.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="preset:qwen3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens_per_block", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    from kvtool import LLM, KvCacheConfig
    from kvtool.plan import BuildOptions, resolve_model

    plan = resolve_model(args.model, options=BuildOptions(dtype=args.dtype, tokens_per_block=args.tokens_per_block))
    llm = LLM(model=plan, max_batch_size=1, max_seq_len=4096, max_num_tokens=4096,
              kv_cache_config=KvCacheConfig(max_tokens=8192))
    rows = measure_steps(llm, repeats=args.repeats)
    header = {"model": args.model, "device": torch.cuda.get_device_name()}
    llm.shutdown()
    args.output.mkdir(parents=True, exist_ok=True)
    write_reports(rows, args.output, header)
    print(f"reports in {args.output}")


if __name__ == "__main__":
    main()
