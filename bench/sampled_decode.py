"""What sampling adds to a decode step: requests of one prompt length at temperature 0 (greedy), at a
temperature, with top_p and with top_k (each drawn in the CPU decode step itself), in turn in one
process through the LLM API, as a user's requests run: --batch requests at a time, each its own prompt.

Each round runs every variant once, in an order that turns every round; a variant's TPOT is the median
over its requests of each one's median token-to-token interval, and each sampled variant is reported
as its TPOT over the greedy requests' of the same round (median over the rounds), and as the
milliseconds it adds.

    .venv/bin/python bench/sampled_decode.py --plan PLAN [--rounds 8] [--batch 1] [--prompt_len 1056] \
        [--output_len 64]
"""

from __future__ import annotations

import argparse
import random
import statistics

import numpy as np

from kvtool import LLM, KvCacheConfig, SamplingParams

VARIANTS = {
    "greedy": {"temperature": 0.0},
    "temperature 1.0": {"temperature": 1.0},
    "top_p 0.9": {"temperature": 1.0, "top_p": 0.9},
    "top_k 50": {"temperature": 1.0, "top_k": 50},
}


def tpot_ms(llm: LLM, prompts: list[list[int]], output_len: int, **params) -> float:
    outputs = llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True, seed=0, **params))
    return float(np.median([np.median(np.diff(output.request.token_times)) for output in outputs])) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", required=True, help="a plan directory (kvtool build) or a model kvtool builds")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1, help="requests generated together (a decode step's rows)")
    parser.add_argument("--prompt_len", type=int, default=1056)
    parser.add_argument("--output_len", type=int, default=64)
    args = parser.parse_args()

    rng = random.Random(0)
    names = list(VARIANTS)
    times: dict[str, list[float]] = {name: [] for name in names}
    # Reuse off: every request computes its prompt, so each decodes after the same context.
    config = KvCacheConfig(enable_block_reuse=False)
    with LLM(model=args.plan, kv_cache_config=config, max_batch_size=max(8, args.batch)) as llm:
        def prompts() -> list[list[int]]:
            return [[rng.randrange(100, 10000) for _ in range(args.prompt_len)] for _ in range(args.batch)]

        tpot_ms(llm, prompts(), 8)  # warm-up
        for round_ in range(args.rounds):
            round_prompts = prompts()
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in order:
                times[name].append(tpot_ms(llm, round_prompts, args.output_len, **VARIANTS[name]))
    greedy = times["greedy"]
    print(f"{args.plan}: {args.rounds} rounds of {args.batch} request(s) of {args.prompt_len}-token prompts, "
          f"{args.output_len} tokens\n")
    print("| variant | TPOT p50 (ms) | / greedy's (paired median) | added (ms, paired median) |")
    print("|---|---:|---:|---:|")
    for name in names:
        ratio = statistics.median(t / g for t, g in zip(times[name], greedy))
        added = statistics.median(t - g for t, g in zip(times[name], greedy))
        print(f"| {name} | {statistics.median(times[name]):.2f} | {ratio:.3f} | {added:+.3f} |")


if __name__ == "__main__":
    main()
