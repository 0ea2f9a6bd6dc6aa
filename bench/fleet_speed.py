"""How fast `kvtool simulate` runs fleets (not a test). Targets (issue 25): 8 replicas over a trace in
≤ 60 s; an SLO search over 50 configurations or more in ≤ 5 minutes on 2 cores.

1. The Mooncake conversation trace, timed (--mode trace), on 8 replicas behind prefix_aware:
   llama-3.1-8b's shapes with a 128k context and chunked prefill, --profile h100, 64 output tokens at most.
2. `--slo ttft_p90=2s,tpot_p90=80ms --search replicas=1..16 --search max_batch_size=8,16,32
   --search router=round_robin,prefix_aware` (96 configurations) over the trace (or its first --search_requests).

    .venv/bin/python bench/fleet_speed.py --output results/fleets/speed.md
"""

from __future__ import annotations

import argparse
import csv
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from trace_data import TRACE_NAME, find_conversation_trace  # the shared trace, found above the checkout

KVTOOL = str(Path(sys.executable).parent / "kvtool")
MODEL = ["--model", "preset:llama-3.1-8b", "--max_seq_len", "131072", "--enable_chunked_context", "--profile", "h100",
         "--mode", "trace"]
SLO = "ttft_p90=2s,tpot_p90=80ms"
SEARCH = ["--search", "replicas=1..16", "--search", "max_batch_size=8,16,32", "--search",
          "router=round_robin,prefix_aware"]


def timed(args: list[str], log: Path) -> float:
    started = time.perf_counter()
    with open(log, "w") as out:
        subprocess.run(args, check=True, stdout=out, stderr=subprocess.STDOUT)
    return time.perf_counter() - started


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="the Markdown file to write")
    parser.add_argument("--trace", type=Path, help="the Mooncake trace (default: shared/data above the checkout)")
    parser.add_argument("--search_requests", type=int, help="search over the trace's first N requests (default: all)")
    args = parser.parse_args()
    trace = args.trace or find_conversation_trace()
    if trace is None:
        parser.error(f"no shared/data/{TRACE_NAME} above the checkout: give --trace PATH")
    work = Path(tempfile.mkdtemp(prefix="fleet-speed-"))
    dataset = work / "trace.jsonl"
    subprocess.run([KVTOOL, "dataset", "import", str(trace), "--format", "mooncake", "--max_output_tokens", "64",
                    "--output", str(dataset)], check=True, stdout=subprocess.DEVNULL)
    head = work / "head.jsonl"
    with open(dataset) as source, open(head, "w") as sink:
        num_searched = sum(sink.write(line) > 0 for _, line in zip(range(args.search_requests or 10**9), source))

    fleet_s = timed([KVTOOL, "simulate", *MODEL, "--dataset", str(dataset), "--replicas", "8", "--router",
                     "prefix_aware", "--slo", SLO, "--output", str(work / "fleet8")], work / "fleet8.log")
    fleet = read_rows(work / "fleet8" / "summary.csv")[0]
    search_s = timed([KVTOOL, "simulate", *MODEL, "--dataset", str(head), "--slo", SLO, *SEARCH,
                      "--output", str(work / "search")], work / "search.log")
    tried = read_rows(work / "search" / "search.csv")
    answer = next(line for line in (work / "search.log").read_text().splitlines()
                  if ("cheapest" in line and "meeting" in line) or "no configuration searched" in line)
    covered = 16 * 3 * 2
    searched = ("the whole trace" if num_searched == int(fleet["num_requests"])
                else f"the trace's first {num_searched} requests")
    text = f"""# Fleet simulation speed (issue 25)

Machine: {cpu_model()}, 2 cores shared with other sessions (timings are wall clock and noisy).
Written by `bench/fleet_speed.py`.

| what | wall (s) | target (s) |
|---|---|---|
| 8 replicas, prefix_aware, the whole conversation trace ({fleet['num_requests']} requests) | {fleet_s:.1f} | 60 |
| SLO search, {covered} configurations ({len(tried)} run), {searched} | {search_s:.1f} | 300 |

8 replicas: TTFT p90 {float(fleet['ttft_ms_p90']):,.0f} ms, TPOT p90 {float(fleet['tpot_ms_p90']):,.1f} ms, token hit rate
{float(fleet['token_hit_rate']):.1%}, load imbalance {float(fleet['load_imbalance']):.2f}.

Search: `--slo {SLO} {' '.join(SEARCH)}`; {answer.strip()}
"""
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
