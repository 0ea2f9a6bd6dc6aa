"""Decoding with fewer free cores than threads: several kvtool processes generating at once.

A CPU decode step runs on one team of threads that meet at a spin barrier after each kernel
(csrc/cpu/parallel.cpp). On cores of its own a waiter spins for the microseconds its partner takes;
with more threads than cores, a waiter that kept spinning would hold the core its partner needs, and
both would crawl (two processes of two threads on the 2-core VM took 8.4-8.8 s for what takes
0.4-0.5 s alone while waiters spun 16k times before yielding; issue 24). This benchmark guards
against that: each process generates --output_len tokens after a --prompt_len prompt, greedy, alone
and then with the others at once, started together, alternating over --rounds rounds.

The figure to read is the slowdown per process: its time with the others over its time alone,
divided by how many processes share the cores (N processes of T threads each on C cores: N * T / C
when the cores are the limit). Near 1, sharing costs nothing beyond the shared cores; far above it,
threads wait on each other's cores.

    .venv/bin/python bench/cpu_contention.py --plan PLAN [--processes 2 3] [--threads 2] \
        [--output results/cpu_contention.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT_SEED = 7


def worker(args: argparse.Namespace) -> None:
    """Loads the plan, warms up, then for each "go" line on stdin generates once and prints the seconds it took."""
    import random

    import torch

    from kvtool import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    with LLM(model=str(args.plan)) as llm:
        prompt = random.Random(PROMPT_SEED).choices(range(1000, 20000), k=args.prompt_len)
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        llm.generate([prompt], params)  # warm-up (and the prompt's blocks cached for every run after)
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            start = time.perf_counter()
            llm.generate([prompt], params)
            print(time.perf_counter() - start, flush=True)


class Workers:
    """N worker processes, each ready to generate when told."""

    def __init__(self, args: argparse.Namespace, count: int) -> None:
        command = [sys.executable, __file__, "--worker", "--plan", str(args.plan), "--threads", str(args.threads),
                   "--prompt_len", str(args.prompt_len), "--output_len", str(args.output_len)]
        self.procs = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for _ in range(count)]
        for proc in self.procs:
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"a worker did not start (exit code {proc.wait()})")

    def generate(self, indices: list[int]) -> list[float]:
        """The given workers generate at once; each one's seconds."""
        for i in indices:
            self.procs[i].stdin.write("go\n")
            self.procs[i].stdin.flush()
        return [float(self.procs[i].stdout.readline()) for i in indices]

    def close(self) -> None:
        for proc in self.procs:
            proc.stdin.close()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", type=Path, required=True, help="a plan directory (kvtool build)")
    parser.add_argument("--processes", type=int, nargs="+", default=[2], help="process counts, a table row each")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="kvtool's threads in each process")
    parser.add_argument("--prompt_len", type=int, default=1024)
    parser.add_argument("--output_len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path, default=None, help="a markdown file for the table")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if min(args.processes) < 2 or args.threads < 1 or args.rounds < 1:
        parser.error("--processes must be >= 2, --threads and --rounds >= 1")

    cores = os.cpu_count() or 1
    lines = [
        "# Decoding with more threads than cores: kvtool processes generating at once",
        "",
        (f"`python bench/cpu_contention.py --plan {args.plan.name} --processes "
         f"{' '.join(map(str, args.processes))} --threads {args.threads}` on {cores} cores: each process "
         f"generates {args.output_len} tokens (greedy) after a {args.prompt_len}-token prompt, alone and with "
         f"the others at once, {args.rounds} rounds; medians. Slowdown per share: together / alone over the "
         "share of the cores each process gets (processes x threads / cores, at least 1)."),
        "",
        "| processes x threads | alone (s) | together (s) | together / alone | cores' share | slowdown per share |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for count in args.processes:
        alone, together = measure(args, count)
        share = max(1.0, count * args.threads / cores)
        slowdown = statistics.median(together) / statistics.median(alone)
        lines.append(f"| {count} x {args.threads} | {statistics.median(alone):.2f} | {statistics.median(together):.2f} "
                     f"| {slowdown:.2f} | {share:.2f} | {slowdown / share:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output is not None:
        args.output.write_text(text)


def measure(args: argparse.Namespace, count: int) -> tuple[list[float], list[float]]:
    """Each of ``count`` processes' generation times alone and all at once, over the rounds."""
    workers = Workers(args, count)
    alone: list[float] = []
    together: list[float] = []
    try:
        for _ in range(args.rounds):
            alone += [workers.generate([i])[0] for i in range(count)]
            together += workers.generate(list(range(count)))
    finally:
        workers.close()
    return alone, together


if __name__ == "__main__":
    main()
