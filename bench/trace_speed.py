"""The whole Mooncake conversation trace through `kvtool simulate` (issue 25 item 3; not a test):

- speed: the trace imported, then simulated timed (`--mode trace`) on the h100 profile with
  preset:qwen3-8b-128k, each run a `kvtool simulate` process pinned to one core (target: 20 s);
  once more one step at a time from Python (the path before kvtool._core.StepSimulator), whose
  requests.csv must be the same file;
- exactness: a sequential run's reused tokens, request by request, against the independent LRU
  model of tests/lru_reference.py fed the token ids `kvtool dataset import --write_token_ids` writes,
  in a pool of the run's size.

    .venv/bin/python bench/trace_speed.py --output results/traces/speed.md
"""

from __future__ import annotations

import csv
import filecmp
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from kvtool.runtime.device import host_description
from kvtool.version import git_revision

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from lru_reference import sequential_reuse  # noqa: E402
from trace_data import benchmark_arguments  # noqa: E402

KVTOOL = [sys.executable, "-c", "import sys; from kvtool.cli import app; app(sys.argv[1:])"]
# The same command with the C++ steps taken away: the engine runs step() once per step.
STEP_BY_STEP = [sys.executable, "-c", "import sys; from kvtool.simulate.executor import CostModelExecutor; "
                "del CostModelExecutor.run_steps; from kvtool.cli import app; app(sys.argv[1:])"]
SIMULATE = ["simulate", "--model", "preset:qwen3-8b-128k", "--profile", "h100", "--max_seq_len", "131072",
            "--enable_chunked_context"]


def one_core() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


class Timing(NamedTuple):
    wall: float  # seconds, start to exit (imports included)
    cpu: float   # user + system seconds: what the one core spent on it, whatever else runs beside it


def timed(command: list[str]) -> Timing:
    """A kvtool process pinned to one core."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=one_core)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return Timing(wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)


def cells(timings: list[Timing]) -> str:
    """Median wall and CPU seconds, then every run's wall (CPU) seconds: three table cells."""
    runs = ", ".join(f"{t.wall:.2f} ({t.cpu:.2f})" for t in timings)
    return (f"{statistics.median(t.wall for t in timings):.2f} | {statistics.median(t.cpu for t in timings):.2f} | "
            f"{runs}")


def read_rows(path: Path) -> list[dict]:
    with path.open(newline="") as source:
        return list(csv.DictReader(source))


def main() -> None:
    args = benchmark_arguments(__doc__)
    trace = args.trace
    lines = ["| step | wall (s, median) | CPU (s, median) | runs: wall (CPU) s | detail |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        dataset, with_ids = scratch / "trace.jsonl", scratch / "trace_ids.jsonl"
        imports = [timed([*KVTOOL, "dataset", "import", str(trace), "--format", "mooncake", "--output", str(dataset)])
                   for _ in range(args.repeat)]
        size = dataset.stat().st_size / 2**20
        lines.append(f"| `kvtool dataset import` (hash ids) | {cells(imports)} | {size:.1f} MiB |")
        print(lines[-1], flush=True)

        trace_run = [*SIMULATE, "--dataset", str(dataset), "--mode", "trace"]
        runs = [timed([*KVTOOL, *trace_run, "--output", str(scratch / f"trace{i}")]) for i in range(args.repeat)]
        [summary] = read_rows(scratch / "trace0" / "summary.csv")
        lines.append(f"| `kvtool simulate --mode trace` | {cells(runs)} | {int(summary['num_requests']):,} requests, "
                     f"{int(summary['total_input_tokens']):,} prompt tokens, token hit rate "
                     f"{float(summary['token_hit_rate']):.1%}, "
                     f"TTFT p50 {float(summary['ttft_ms_p50']) / 1000:,.0f} s |")
        print(lines[-1], flush=True)
        slow = timed([*STEP_BY_STEP, *trace_run, "--output", str(scratch / "step_by_step")])
        same = filecmp.cmp(scratch / "trace0" / "requests.csv", scratch / "step_by_step" / "requests.csv",
                           shallow=False)
        lines.append(f"| the same, one step at a time from Python | {cells([slow])} | requests.csv "
                     f"{'identical' if same else 'DIFFERENT'} |")
        print(lines[-1], flush=True)

        sequential = timed([*KVTOOL, *SIMULATE, "--dataset", str(dataset), "--mode", "sequential",
                            "--output", str(scratch / "sequential")])
        [summary] = read_rows(scratch / "sequential" / "summary.csv")
        rows = sorted(read_rows(scratch / "sequential" / "requests.csv"), key=lambda row: int(row["request_id"]))
        lines.append(f"| `kvtool simulate --mode sequential` | {cells([sequential])} | token hit rate "
                     f"{float(summary['token_hit_rate']):.1%} |")
        print(lines[-1], flush=True)

        timed([*KVTOOL, "dataset", "import", str(trace), "--format", "mooncake", "--output", str(with_ids),
               "--write_token_ids"])
        start = time.process_time()
        with with_ids.open(encoding="utf-8") as source:
            requests = ((line["input_ids"], line["output_tokens"]) for line in map(json.loads, source))
            expected = sequential_reuse(requests, tokens_per_block=int(summary["tokens_per_block"]),
                                        num_blocks=int(summary["kv_primary_blocks"]))
        reference_s = time.process_time() - start
    reused = [int(row["reused_tokens"]) for row in rows]
    num_prompt = int(summary["total_input_tokens"])
    mismatched = (sum(a != b for a, b in zip(reused, expected.reused_tokens))
                  + abs(len(reused) - len(expected.reused_tokens)))
    lines.append(f"| LRU reference (tests/lru_reference.py), in this process | - | {reference_s:.2f} | - | "
                 f"reused-token "
                 f"ratio {sum(expected.reused_tokens) / num_prompt:.6f} (simulate: {sum(reused) / num_prompt:.6f}); "
                 f"requests that differ: {mismatched} of {len(reused):,}; "
                 f"evicted blocks {expected.num_evicted_blocks:,} "
                 f"(simulate: {int(summary['evicted_blocks']):,}) |")
    print(lines[-1], flush=True)

    load = os.getloadavg()[0]
    text = "\n".join([
        "# The whole conversation trace through `kvtool simulate`", "",
        f"Machine: `cpu: {host_description()}` ({platform.machine()}), each kvtool process pinned to one core; "
        f"load average {load:.1f} at the end (other jobs share the cores); Python {platform.python_version()}; "
        f"revision {git_revision()}. Trace: `{trace.name}`. Command: `python bench/trace_speed.py --repeat "
        f"{args.repeat}`. Simulated: preset:qwen3-8b-128k (YaRN to 131,072 tokens), `--profile h100` (estimated), "
        f"`--max_seq_len 131072 --enable_chunked_context`, the default pool of "
        f"{int(summary['kv_primary_blocks']):,} blocks of {summary['tokens_per_block']} tokens. "
        "Times are seconds of the whole "
        "process (Python start, imports, loading the dataset, reports): wall, and CPU (user + system), which "
        "other jobs on the machine do not inflate.", "",
        *lines, "",
        "Sequential mode (one request at a time) must reuse exactly what the LRU reference reuses: "
        + ("it does, request by request." if mismatched == 0 else f"{mismatched} requests DIFFER."), ""])
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
    print(text)
    if mismatched or not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
