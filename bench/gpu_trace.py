"""Where the time of an onboarding step and of a decode step goes: torch profiler traces of kvtool.LLM.

An A,B,A,B replay (default preset:qwen3-8b, bf16, 4,000-token prompts, a primary pool that holds one
request, a host cache) runs two warm rounds, then the third round's two requests are profiled
(CPU ops and CUDA kernels / copies); then 16 decode steps of one request are profiled, with CUDA
graphs and without. Writes, under --output:
  onboard.json, decode_graphs_{on,off}.json    Chrome traces (chrome://tracing, ui.perfetto.dev)
  onboard.txt, decode_graphs_{on,off}.txt      the profiler's tables (CPU and CUDA time per op), TTFT / TPOT

The plan is the one `kvtool bench --model MODEL` builds here (scripts/gpu_check.sh builds it first).

    python bench/gpu_trace.py --output out/trace
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvtool import LLM, KvCacheConfig, SamplingParams
from kvtool.plan import BuildOptions, resolve_model

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def _ttft_ms(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate(prompt, ONE_TOKEN)
    if out.error is not None:
        raise RuntimeError(out.error)
    request = out.request
    return (request.first_token_time - request.arrival_time) * 1e3


def _synchronize() -> None:
    if torch.cuda.is_available():  # a CPU dry run has nothing to wait for
        torch.cuda.synchronize()


def _write(prof, output: Path, name: str, lines: list[str]) -> None:
    prof.export_chrome_trace(str(output / f"{name}.json"))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    cuda_table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25)
    (output / f"{name}.txt").write_text("\n".join(lines) + "\n\n" + table + "\n\n" + cuda_table + "\n")
    print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="preset:qwen3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens_per_block", type=int, default=32)
    parser.add_argument("--prompt_len", type=int, default=4000)
    parser.add_argument("--host_cache_bytes", type=int, default=8 << 30)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    plan = resolve_model(args.model, options=BuildOptions(dtype=args.dtype, tokens_per_block=args.tokens_per_block))
    tpb = plan.build_options.tokens_per_block
    pool_tokens = (-(-(args.prompt_len + 1) // tpb) + 1) * tpb  # one request, not two
    llm = LLM(model=plan, max_batch_size=1,
              kv_cache_config=KvCacheConfig(max_tokens=pool_tokens, host_cache_size=args.host_cache_bytes))
    rng = random.Random(0)
    high = min(30000, plan.model_config.vocab_size)
    prompts = [[rng.randrange(100, high) for _ in range(args.prompt_len)] for _ in range(2)]

    warm = [[round(_ttft_ms(llm, p), 1) for p in prompts] for _ in range(2)]
    stats = llm.get_stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        traced = [round(_ttft_ms(llm, p), 1) for p in prompts]
        _synchronize()
    after = llm.get_stats()
    _write(prof, args.output, "onboard", [
        f"A,B,A,B {args.prompt_len}-token prompts, pool {pool_tokens} tokens, host cache {args.host_cache_bytes:,} B",
        f"TTFT rounds 1-2 (ms): {warm}; traced round 3 (ms): {traced}",
        f"onboarded blocks in round 3: {after['onboarded_blocks'] - stats['onboarded_blocks']}, offloaded: "
        f"{after['offloaded_blocks'] - stats['offloaded_blocks']}, host pool allocated "
        f"{llm.engine.executor.pools.host.num_allocated_bytes:,} B"])

    decode = SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)
    lines = []
    runner = llm.engine.executor
    for graphs in (True, False):
        saved = runner.decode_graphs, runner.mixed_graphs
        if not graphs:
            runner.decode_graphs, runner.mixed_graphs = None, None
        llm.generate(prompts[0], decode)  # warm
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            out = llm.generate(prompts[0], decode)
            _synchronize()
            wall = time.perf_counter() - start
        runner.decode_graphs, runner.mixed_graphs = saved
        request = out.request
        tpot = (request.finish_time - request.first_token_time) / 16 * 1e3
        lines.append(f"decode, CUDA graphs {'on' if graphs and saved[0] is not None else 'off'}: TPOT {tpot:.2f} ms "
                     f"(16 steps; request wall {wall * 1e3:.1f} ms)")
        _write(prof, args.output, f"decode_graphs_{'on' if graphs else 'off'}", lines[-1:])
    llm.shutdown()


if __name__ == "__main__":
    main()
