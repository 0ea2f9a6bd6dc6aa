"""What sampling adds to vLLM's decode step on the CPU: bench/sampled_decode.py's variants (greedy,
temperature 1.0, top_p 0.9, top_k 50) through vLLM's AsyncLLM, streamed as vllm_replay.py streams, in
turn in one process. Runs in the peer venv (`make peers-venv`), with vLLM's CPU settings, e.g.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 \\
        LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$PEER_VENV/lib/libiomp5.so" \\
        $PEER_VENV/bin/python bench/peers/vllm_sampled_decode.py --model CHECKPOINT_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time

import numpy as np

VARIANTS = {"greedy": {"temperature": 0.0}, "temperature 1.0": {"temperature": 1.0},
            "top_p 0.9": {"temperature": 1.0, "top_p": 0.9}, "top_k 50": {"temperature": 1.0, "top_k": 50}}


async def run(args) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=args.model, dtype=args.dtype, block_size=32, max_model_len=2048, enable_prefix_caching=False, seed=0))
    request_ids = itertools.count()

    async def tpot_ms(prompt: list[int], **params) -> float:
        """The request's median token-to-token interval, each token timed as it arrives."""
        sampling = SamplingParams(max_tokens=args.output_len, ignore_eos=True, seed=0,
                                  output_kind=RequestOutputKind.DELTA, **params)
        times: list[float] = []
        async for output in engine.generate(TokensPrompt(prompt_token_ids=prompt), sampling,
                                            request_id=f"r{next(request_ids)}"):
            times += [time.perf_counter()] * len(output.outputs[0].token_ids)
        return float(np.median(np.diff(times))) * 1e3

    rng = random.Random(0)
    names = list(VARIANTS)
    times: dict[str, list[float]] = {name: [] for name in names}
    try:
        await tpot_ms([rng.randrange(100, 10000) for _ in range(args.prompt_len)])  # warm-up
        for round_ in range(args.rounds):
            prompt = [rng.randrange(100, 10000) for _ in range(args.prompt_len)]
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                times[name].append(await tpot_ms(prompt, **VARIANTS[name]))
    finally:
        engine.shutdown()
        engine = None  # released now, not at interpreter exit (its __del__ shuts down again, modules gone)
    greedy = times["greedy"]
    print("| variant | TPOT p50 (ms) | / greedy's (paired median) | added (ms, paired median) |")
    print("|---|---:|---:|---:|")
    for name in names:
        print(f"| {name} | {statistics.median(times[name]):.2f} | "
              f"{statistics.median(t / g for t, g in zip(times[name], greedy)):.3f} | "
              f"{statistics.median(t - g for t, g in zip(times[name], greedy)):+.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=1056)
    parser.add_argument("--output_len", type=int, default=64)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":  # vLLM starts worker processes that re-import this file
    main()
