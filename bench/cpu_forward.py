"""Forward-step latency of a plan on the CPU, for the step kinds a TTFT is made of.

Drives the ModelRunner directly (no scheduler), one step at a time, on a prompt of real token
ids or random ones:
- miss: the whole prompt from position 0 (reuse off, or nothing cached);
- partial-miss: the prompt after a few cached tokens (a partial block copied from another prompt);
- hit: the last --hit_tokens tokens after a cached prefix (a reused system prompt);
- decode: one token after the prompt.
Each kind runs --repeats times, kinds interleaved; prints medians (ms) and, with --profile,
torch.profiler's top operators for each kind. --clock cpu measures process CPU time instead of
wall time (steadier when other tenants load the machine).

    python bench/cpu_forward.py --plan PLAN [--threads 1] [--clock cpu] [--profile]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import torch

from kvtool import LLM, KvCacheConfig
from kvtool.runtime.model_runner import StepRequest


def step_kinds(prompt_len: int, hit_tokens: int, partial_tokens: int) -> dict[str, tuple[int, int]]:
    """kind -> (num_cached_tokens, num_new_tokens)."""
    return {"miss": (0, prompt_len), "partial-miss": (partial_tokens, prompt_len - partial_tokens),
            "hit": (prompt_len - hit_tokens, hit_tokens), "decode": (prompt_len, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", required=True)
    parser.add_argument("--prompt_len", type=int, default=1056)
    parser.add_argument("--hit_tokens", type=int, default=32)
    parser.add_argument("--partial_tokens", type=int, default=17)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON line of medians")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time

    llm = LLM(model=args.plan, max_batch_size=1, kv_cache_config=KvCacheConfig(enable_block_reuse=False))
    runner = llm.engine.executor
    tpb = runner.tokens_per_block
    rng = random.Random(0)
    token_ids = np.array([rng.randrange(100, 10_000) for _ in range(args.prompt_len + 1)], dtype=np.int32)
    block_ids = np.arange(-(-(args.prompt_len + 1) // tpb), dtype=np.int32)
    runner.execute([StepRequest(token_ids[:args.prompt_len], block_ids, 0, True, True)])  # fills the blocks

    def request(num_cached: int, num_new: int) -> StepRequest:
        return StepRequest(token_ids[num_cached:num_cached + num_new], block_ids, num_cached, num_new > 1, True)

    kinds = step_kinds(args.prompt_len, args.hit_tokens, args.partial_tokens)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.repeats):
        for kind, (num_cached, num_new) in kinds.items():
            step = request(num_cached, num_new)
            start = clock()
            runner.execute([step])
            times[kind].append((clock() - start) * 1e3)
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    if args.json:
        print(json.dumps(medians))
    else:
        print(f"{args.clock} ms per step, median of {args.repeats} (threads {torch.get_num_threads()}):")
        for kind, value in medians.items():
            print(f"  {kind:13s} {value:9.1f}   (min {min(times[kind]):.1f}, max {max(times[kind]):.1f})")
    if args.profile:
        for kind, (num_cached, num_new) in kinds.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                runner.execute([request(num_cached, num_new)])
            print(f"\n## {kind}\n")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    llm.shutdown()


if __name__ == "__main__":
    main()
