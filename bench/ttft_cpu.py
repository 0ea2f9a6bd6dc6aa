"""TTFT with a cached 1,024-token prefix vs the same requests with reuse off (CPU, small-llama).

Both variants run in one process on the same plan; each request is a shared prefix plus its own
question, sent one at a time after a warm-up that puts the prefix in the cache. Reports medians
and the ratio (target: reuse cuts TTFT at least 5x on a 2-core CPU).

    python bench/ttft_cpu.py --output results/ttft_cpu.md
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

from kvtool import LLM, KvCacheConfig, SamplingParams
from kvtool.plan import BuildOptions, build_plan
from kvtool.runtime.device import describe_device, default_device
from kvtool.version import __version__, git_revision


def measure(plan_dir: str, enable_reuse: bool, prefix: list[int], questions: list[list[int]]) -> list[float]:
    """TTFT (ms) of each question after the prefix, requests sent one at a time."""
    llm = LLM(model=plan_dir, max_batch_size=1, kv_cache_config=KvCacheConfig(enable_block_reuse=enable_reuse))
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate(prefix + [7] * len(questions[0]), params)  # warm-up: caches the prefix when reuse is on
    ttft_ms = []
    for question in questions:
        out = llm.generate(prefix + question, params)
        request = out.request
        ttft_ms.append((request.first_token_time - request.arrival_time) * 1e3)
    llm.shutdown()
    return ttft_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="preset:small-llama")
    parser.add_argument("--prefix_len", type=int, default=1024)
    parser.add_argument("--question_len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens_per_block", type=int, default=32)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    rng = random.Random(0)
    prefix = [rng.randrange(10, 1000) for _ in range(args.prefix_len)]
    questions = [[rng.randrange(10, 1000) for _ in range(args.question_len)] for _ in range(args.repeats)]
    with tempfile.TemporaryDirectory() as tmp:
        plan_dir = str(Path(tmp) / "plan")
        build_plan(args.model, Path(plan_dir), BuildOptions(tokens_per_block=args.tokens_per_block,
                                                            max_seq_len=args.prefix_len + args.question_len + 64,
                                                            max_num_tokens=args.prefix_len + args.question_len + 64,
                                                            max_batch_size=1))
        reuse_off = measure(plan_dir, False, prefix, questions)
        reuse_on = measure(plan_dir, True, prefix, questions)
    off, on = statistics.median(reuse_off), statistics.median(reuse_on)
    command = "python " + " ".join(sys.argv)
    lines = [
        "# TTFT with a cached prefix vs reuse off (CPU)",
        "",
        f"- device: {describe_device(default_device())}",
        f"- model: {args.model}, tokens_per_block {args.tokens_per_block}, float32",
        f"- workload: {args.prefix_len}-token shared prefix + {args.question_len}-token question, "
        f"1 output token, {args.repeats} requests one at a time per variant, same process",
        f"- kvtool {__version__} ({git_revision()}); command: `{command}`",
        "",
        "| variant | median TTFT (ms) | min | max |",
        "|---|---|---|---|",
        f"| reuse off | {off:.1f} | {min(reuse_off):.1f} | {max(reuse_off):.1f} |",
        f"| reuse on (prefix cached) | {on:.1f} | {min(reuse_on):.1f} | {max(reuse_on):.1f} |",
        "",
        f"**TTFT reuse off / on: {off / on:.1f}x** (target >= 5x)",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)


if __name__ == "__main__":
    main()
