"""How long `kvtool dataset import --format mooncake` takes on the whole Mooncake conversation trace
(12,031 requests, 145M prompt tokens; target: seconds), and how long loading slices of the result
takes (what a replay pays before it starts). Not a test. The trace is read from shared/data above
the checkout (see tests/trace_data.py), or --trace.

    .venv/bin/python bench/trace_import.py --output results/traces/import.md
"""

from __future__ import annotations

import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvtool.runtime.device import host_description
from kvtool.version import git_revision
from kvtool.workloads.datasets import load_dataset
from kvtool.workloads.traces import TraceImportOptions, import_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from trace_data import TRACE_NAME, benchmark_arguments  # noqa: E402


def main() -> None:
    args = benchmark_arguments(__doc__)
    trace = args.trace
    lines = ["| step | median (s) | runs (s) | detail |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as scratch:
        # As hash ids (the default: token ids made when read), and with every token id written.
        for name, write_token_ids in (("hash ids", False), ("--write_token_ids", True)):
            output = Path(scratch) / "trace.jsonl"
            times = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                result = import_trace(trace, "mooncake", output, TraceImportOptions(write_token_ids=write_token_ids))
                times.append(time.perf_counter() - start)
            size = output.stat().st_size
            lines.append(f"| import the whole trace ({name}) | {statistics.median(times):.2f} | "
                         f"{', '.join(f'{t:.2f}' for t in times)} | {result.num_requests:,} requests, "
                         f"{result.num_prompt_tokens:,} prompt tokens, {size / 2**20:,.1f} MiB written |")
            for count in (1000, 3000, None):
                sliced = Path(scratch) / f"slice{count}.jsonl"
                with output.open() as source, sliced.open("w") as out:
                    out.writelines(itertools.islice(source, count))
                times = []
                for _ in range(args.repeat):
                    start = time.perf_counter()
                    dataset = load_dataset(sliced)
                    times.append(time.perf_counter() - start)
                tokens = sum(len(record.input_ids) for record in dataset.records)
                what = "the whole trace" if count is None else f"the first {count:,} requests"
                lines.append(f"| load {what} ({name}) | {statistics.median(times):.2f} | "
                             f"{', '.join(f'{t:.2f}' for t in times)} | {tokens:,} prompt tokens |")
                print(lines[-1], flush=True)
    report = "\n".join([
        "# Importing the Mooncake conversation trace",
        "",
        f"Machine: `{host_description()}` ({platform.machine()}), load average {os.getloadavg()[0]:.1f} at the end "
        f"(other jobs share the cores), revision {git_revision()}. "
        f"Trace: `{TRACE_NAME}`. Command: `python bench/trace_import.py` (medians of {args.repeat} runs).",
        "",
        *lines,
        "",
    ])
    print(report)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(report, encoding="utf-8")


if __name__ == "__main__":
    main()
