"""How many requests `kvtool simulate` replays per second (not a test; target >= 20,000 for 2k-token
prompts on the 2-core VM). The workload: 2,048-token prompts (16 system prompts of 1,984 tokens and
64-token questions), 64 in flight, a batch of up to 64; output lengths 1 and 16. The run is timed
inside run_bench (pre-check, replay, per-request rows), as a user's `kvtool simulate` spends it;
loading the dataset file is timed apart. Each figure is the median of --repeat runs.

    .venv/bin/python bench/simulate_speed.py --output results/simulate/speed.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console

from kvtool.bench.runner import run_bench
from kvtool.flags import configs
from kvtool.workloads import generators
from kvtool.workloads.datasets import load_dataset, write_jsonl
from kvtool.plan import BuildOptions, resolve_model
from kvtool.runtime.device import host_description
from kvtool.simulate.cost_model import CostModel
from kvtool.simulate.simulated_llm import SimulatedLLM
from kvtool.version import git_revision

WORKLOAD = ("2,048-token prompts (16 system prompts of 1,984 tokens, 64-token questions), 64 in flight, "
            "batches of up to 64, tiny-llama's plan (the cost model's numbers do not change the work). "
            "`simulate` is run_bench's time: the pre-check, the replay through the C++ scheduler and cache "
            "manager, and the per-request rows; loading the JSON Lines file is timed apart.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_requests", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    plan = resolve_model("preset:tiny-llama", options=BuildOptions(tokens_per_block=32, max_seq_len=4096,
                                                                    max_batch_size=64))
    cost = CostModel(device="cpu: speed test", coefficients={"step": 2e-3, "context_token": 2e-5, "decode_row": 1e-4})
    lines = ["| output tokens | requests | load dataset (s) | simulate (s, median) | simulated requests/s | "
             "steps |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as scratch:
        for output_len in (1, 16):
            path = write_jsonl(Path(scratch) / f"sp{output_len}.jsonl", generators.generate("system-prompt", dict(
                num_groups=16, prompts_per_group=args.num_requests // 16, system_prompt_len=1984, question_len=64,
                output_len=output_len, shuffle=True, seed=0)))
            start = time.perf_counter()
            dataset = load_dataset(path)
            load_seconds = time.perf_counter() - start
            engine, replay = configs({"concurrency": 64, "max_batch_size": 64})
            times, steps = [], 0
            for _ in range(args.repeat):
                llm = SimulatedLLM(plan, cost, engine)
                start = time.perf_counter()
                run_bench(llm, dataset, replay, label="speed", requests_csv=Path(scratch) / "requests.csv",
                          console=Console(quiet=True))
                times.append(time.perf_counter() - start)
                steps = llm.executor.num_steps
            median = statistics.median(times)
            lines.append(f"| {output_len} | {len(dataset):,} | {load_seconds:.2f} | {median:.2f} | "
                         f"{len(dataset) / median:,.0f} | {steps:,} |")
            print(lines[-1], flush=True)
    text = "\n".join(["# kvtool simulate: requests per second", "",
                      f"Machine: `cpu: {host_description()}`, Python {platform.python_version()}; revision "
                      f"{git_revision()}. Command: `python bench/simulate_speed.py --num_requests "
                      f"{args.num_requests} --repeat {args.repeat}`.", "", WORKLOAD, "", *lines, ""])
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
