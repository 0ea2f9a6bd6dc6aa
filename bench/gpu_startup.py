"""Start-up cost of a host cache through kvtool.LLM (default preset:qwen3-8b, bf16): the time from
``LLM(...)`` construction to the first token of a first request (one 16-token prompt, max_tokens=1),
without a host cache (host_cache_size=0) and with one (default 45 GB, as the card's offload run).

The plan is resolved (built once, or taken from the plan cache) before any timing, with the options
`kvtool bench --model MODEL` builds with here, so scripts/gpu_check.sh's plan step serves it. The two
variants alternate for --repeats rounds (drift in clocks or the page cache hits both alike); each
LLM is shut down and its memory freed before the next. Reported: the median of each and the
difference (target: a host cache adds less than 1 s).

Runs anywhere for a dry run:
    python bench/gpu_startup.py --model preset:tiny-llama --dtype float32 --host_cache_bytes 100000000 \\
        --output /tmp/st
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from gpu_reports import write_rows_csv

from kvtool import LLM, KvCacheConfig, SamplingParams
from kvtool.plan import BuildOptions, Plan, resolve_model

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
PROMPT_LEN = 16
TARGET_EXTRA_S = 1.0  # a host cache may add at most this much to the start-up


class StartupRun(NamedTuple):
    round: int
    host_cache_bytes: int
    construct_s: float      # LLM(...) returned
    first_token_s: float    # the first request's first token, from the start of LLM(...)


def _release(llm: LLM) -> None:
    llm.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_startup(plan: Plan, device: str, host_cache_bytes: int, round_: int) -> StartupRun:
    prompt = list(range(100, 100 + PROMPT_LEN))  # ids every preset's vocabulary holds
    start = time.perf_counter()
    # One block of work: a host cache larger than the memory available now is accepted, as `kvtool
    # bench` accepts it for a dataset that cannot fill it (the pool is allocated as blocks arrive).
    llm = LLM(model=plan, device=device, kv_cache_config=KvCacheConfig(host_cache_size=host_cache_bytes),
              num_workload_blocks=1)
    constructed = time.perf_counter()
    out = llm.generate(prompt, ONE_TOKEN)
    if out.error is not None:
        raise RuntimeError(out.error)
    # The engine stamps token times with time.perf_counter, the clock started above.
    first_token = out.request.first_token_time
    if host_cache_bytes and llm.pool_sizes.num_secondary_blocks == 0:
        raise RuntimeError(f"host_cache_size={host_cache_bytes} created no host cache: {llm.pool_sizes}")
    _release(llm)
    return StartupRun(round_, host_cache_bytes, constructed - start, first_token - start)


def measure(model: str | Plan = "preset:qwen3-8b", dtype: str = "bfloat16", *, device: str | None = None,
            host_cache_bytes: int = 45_000_000_000, repeats: int = 3,
            tokens_per_block: int = 32) -> tuple[Plan, list[StartupRun]]:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # Resolved (and verified) once, outside the timings; the options as `kvtool bench --model` on a GPU.
    plan = resolve_model(model, options=BuildOptions(dtype=dtype, tokens_per_block=tokens_per_block))
    if torch.device(device).type == "cuda":
        torch.zeros(1, device=device)  # the CUDA context: once per process, not the first variant's cost
    runs = []
    for round_ in range(repeats):
        for variant in (0, host_cache_bytes):
            runs.append(time_startup(plan, device, variant, round_))
    return plan, runs


def summarize(runs: list[StartupRun], host_cache_bytes: int) -> dict[str, float]:
    def median(size: int) -> float:
        return statistics.median(run.first_token_s for run in runs if run.host_cache_bytes == size)

    without, with_cache = median(0), median(host_cache_bytes)
    return {"without_s": without, "with_s": with_cache, "difference_s": with_cache - without}


def write_reports(runs: list[StartupRun], summary: dict[str, float], host_cache_bytes: int, output: Path,
                  header: dict[str, str]) -> None:
    """gpu_startup.csv (every run, the run's header repeated) and gpu_startup.md (the summary)."""
    write_rows_csv(output / "gpu_startup.csv", runs, header)
    verdict = "met" if summary["difference_s"] < TARGET_EXTRA_S else "missed"
    lines = ["# kvtool start-up with a host cache", ""] + [f"- {k}: {v}" for k, v in header.items()] + [""]
    lines += ["| host cache | median LLM() to first token (s) |", "|---|---|",
              f"| none | {summary['without_s']:.3f} |", f"| {host_cache_bytes} bytes | {summary['with_s']:.3f} |",
              "", f"difference: {summary['difference_s']:+.3f} s (target < {TARGET_EXTRA_S:g} s: {verdict})", "",
              "| round | host cache bytes | LLM() (s) | to first token (s) |", "|---|---|---|---|"]
    lines += [f"| {r.round} | {r.host_cache_bytes} | {r.construct_s:.3f} | {r.first_token_s:.3f} |" for r in runs]
    (output / "gpu_startup.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="preset:qwen3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--host_cache_bytes", type=int, default=45_000_000_000)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of (no host cache, host cache)")
    parser.add_argument("--tokens_per_block", type=int, default=32)
    parser.add_argument("--output", type=Path, default=None, help="write gpu_startup.csv and gpu_startup.md there")
    args = parser.parse_args()
    if args.host_cache_bytes <= 0 or args.repeats < 1:
        parser.error("--host_cache_bytes and --repeats must be positive")
    plan, runs = measure(args.model, args.dtype, device=args.device, host_cache_bytes=args.host_cache_bytes,
                         repeats=args.repeats, tokens_per_block=args.tokens_per_block)
    summary = summarize(runs, args.host_cache_bytes)
    print(f"plan {plan.path}, device {args.device}, {args.repeats} rounds")
    print(f"{'host cache':>22} | {'median LLM() -> first token':>28}")
    print(f"{'none':>22} | {summary['without_s']:>26.3f} s")
    print(f"{f'{args.host_cache_bytes} bytes':>22} | {summary['with_s']:>26.3f} s")
    verdict = "met" if summary["difference_s"] < TARGET_EXTRA_S else "missed"
    print(f"{'difference':>22} | {summary['difference_s']:>+26.3f} s  (target < {TARGET_EXTRA_S:g} s: {verdict})")
    if args.output is not None:
        device = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu"
        header = {"model": args.model, "dtype": plan.build_options.dtype, "plan": str(plan.path), "device": device}
        write_reports(runs, summary, args.host_cache_bytes, args.output, header)
        print(f"reports in {args.output}")


if __name__ == "__main__":
    main()
