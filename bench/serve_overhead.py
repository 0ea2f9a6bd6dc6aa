"""What serving over HTTP costs: the same workload through `kvtool bench --endpoint` against
`kvtool serve` and through `kvtool bench` in-process, at concurrency 1 (TTFT added) and 1 / 8 / 32
(throughput).

Each run is a fresh process with a fresh cache (a fresh `kvtool serve` for every endpoint run), so
both variants start from the same state. The variants alternate within each cycle, in the opposite
order in the next cycle, so a slow minute of the machine hits both; the report takes medians over
cycles. The load average is recorded around every run: on a shared machine it says how far to trust
the milliseconds.

    python bench/serve_overhead.py --model preset:tiny-llama --cycles 5 --output results/serve/tiny-llama
"""

from __future__ import annotations

import argparse
import csv
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

KVTOOL = str(Path(sys.executable).parent / "kvtool")
COLUMNS = ("cycle", "variant", "concurrency", "ttft_ms_p50", "ttft_ms_mean", "tpot_ms_p50", "itl_ms_p50",
           "e2e_ms_p50", "output_tokens_per_s", "requests_per_s", "reused_blocks", "missed_blocks", "num_errors",
           "load1_before", "load1_after")


def load1() -> float:
    return os.getloadavg()[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(command: list[str], env: dict[str, str]) -> None:
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")


def summary_row(out: Path) -> dict[str, str]:
    with (out / "summary.csv").open(newline="") as source:
        return next(csv.DictReader(source))


class Server:
    """`kvtool serve` in its own process, on a free port, stopped by SIGTERM."""

    def __init__(self, plan: Path, engine_flags: list[str], env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([KVTOOL, "serve", "--plan", str(plan), "--port", str(self.port),
                                         *engine_flags], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kvtool serve did not start: {self.process.stderr.read().decode()}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(30)


def one_run(variant: str, concurrency: int, plan: Path, dataset: Path, out: Path, engine_flags: list[str],
            warmup: int, env: dict[str, str]) -> dict:
    replay = ["--dataset", str(dataset), "--warmup", str(warmup), "--output", str(out), "--label", variant]
    replay += ["--mode", "sequential"] if concurrency == 1 else ["--concurrency", str(concurrency)]
    before = load1()
    if variant == "in-process":
        run([KVTOOL, "bench", "--plan", str(plan), *engine_flags, *replay], env)
    else:
        server = Server(plan, engine_flags, env)
        try:
            run([KVTOOL, "bench", "--endpoint", server.url, *replay], env)
        finally:
            server.stop()
    row = summary_row(out)
    measured = {k: row.get(k, "") for k in COLUMNS if k in row and k not in ("cycle", "variant", "concurrency")}
    return {"variant": variant, "concurrency": concurrency, **measured,
            "load1_before": f"{before:.2f}", "load1_after": f"{load1():.2f}"}


def median_of(rows: list[dict], variant: str, concurrency: int, column: str) -> float:
    return statistics.median(float(r[column]) for r in rows if r["variant"] == variant
                             and int(r["concurrency"]) == concurrency and r[column] != "")


def report(rows: list[dict], args, host: str) -> str:
    cycles = sorted({r["cycle"] for r in rows})
    paired = []
    for cycle in cycles:
        pair = {r["variant"]: float(r["ttft_ms_p50"]) for r in rows if r["cycle"] == cycle and int(r["concurrency"]) == 1}
        paired.append(pair["endpoint"] - pair["in-process"])
    loads = [float(r[k]) for r in rows for k in ("load1_before", "load1_after")]
    lines = [f"# kvtool serve vs in-process: {args.model}", "",
             f"Machine: {host}. Load average (1 min) around the runs: {min(loads):.2f}-{max(loads):.2f} "
             f"(median {statistics.median(loads):.2f}). torch threads: {args.threads}. {len(cycles)} cycles, "
             f"variants alternated; medians over cycles.", "",
             f"Workload: `kvtool dataset system-prompt --num_groups {args.num_groups} --prompts_per_group "
             f"{args.prompts_per_group} --system_prompt_len {args.system_prompt_len} --question_len "
             f"{args.question_len} --output_len {args.output_len}` (token ids), warm-up {args.warmup} requests, "
             f"pool {args.max_tokens} tokens, plan max_batch_size {args.max_batch_size}.", "",
             "## TTFT at concurrency 1 (sequential)", "",
             "| variant | TTFT p50 (ms) | TTFT mean (ms) | TPOT p50 (ms) |", "|---|---:|---:|---:|"]
    for variant in ("in-process", "endpoint"):
        lines.append(f"| {variant} | {median_of(rows, variant, 1, 'ttft_ms_p50'):.2f} | "
                     f"{median_of(rows, variant, 1, 'ttft_ms_mean'):.2f} | {median_of(rows, variant, 1, 'tpot_ms_p50'):.2f} |")
    added = median_of(rows, "endpoint", 1, "ttft_ms_p50") - median_of(rows, "in-process", 1, "ttft_ms_p50")
    lines += ["", f"TTFT p50 added by serving: **{added:+.2f} ms** (difference of the medians); per cycle "
              f"(endpoint - in-process): {', '.join(f'{d:+.2f}' for d in paired)} ms, median "
              f"{statistics.median(paired):+.2f} ms.", "",
              "## Throughput", "", "| concurrency | in-process output tok/s | endpoint output tok/s | ratio | "
              "in-process req/s | endpoint req/s |", "|---:|---:|---:|---:|---:|---:|"]
    for concurrency in args.concurrency:
        a = median_of(rows, "in-process", concurrency, "output_tokens_per_s")
        b = median_of(rows, "endpoint", concurrency, "output_tokens_per_s")
        lines.append(f"| {concurrency} | {a:.1f} | {b:.1f} | {b / a:.2f} | "
                     f"{median_of(rows, 'in-process', concurrency, 'requests_per_s'):.2f} | "
                     f"{median_of(rows, 'endpoint', concurrency, 'requests_per_s'):.2f} |")
    counters = {(r["concurrency"], r["reused_blocks"], r["missed_blocks"]) for r in rows}
    same = len(counters) == len({r["concurrency"] for r in rows})
    lines += ["", f"Every run: [runs.csv](runs.csv). Reused / missed blocks "
              f"{'were the same in every run of both variants' if same else 'DIFFERED between runs'} at each concurrency.",
              f"Command: `python bench/serve_overhead.py {' '.join(a for a in sys.argv[1:] if a != '--report_only')}`", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="preset:tiny-llama")
    parser.add_argument("--tokens_per_block", type=int, default=16)
    parser.add_argument("--max_batch_size", type=int, default=32)
    parser.add_argument("--max_tokens", type=int, default=32768, help="primary pool (tokens), both variants")
    parser.add_argument("--num_groups", type=int, default=4)
    parser.add_argument("--prompts_per_group", type=int, default=16)
    parser.add_argument("--system_prompt_len", type=int, default=256)
    parser.add_argument("--question_len", type=int, default=32)
    parser.add_argument("--output_len", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads in every process (OMP_NUM_THREADS)")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--report_only", action="store_true", help="rewrite table.md from OUTPUT/runs.csv")
    args = parser.parse_args()
    if args.report_only:
        from kvtool.runtime.device import host_description

        with (args.output / "runs.csv").open(newline="") as source:
            rows = list(csv.DictReader(source))
        (args.output / "table.md").write_text(report(rows, args, host_description()))
        return

    from kvtool.runtime.device import host_description

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    args.output.mkdir(parents=True, exist_ok=True)
    engine_flags = ["--max_tokens_in_paged_kv_cache", str(args.max_tokens)]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        plan, dataset = tmp / "plan", args.output / "dataset.jsonl"
        run([KVTOOL, "build", "--model", args.model, "--output", str(plan), "--tokens_per_block",
             str(args.tokens_per_block), "--max_batch_size", str(args.max_batch_size)], env)
        run([KVTOOL, "dataset", "system-prompt", "--output", str(dataset), "--num_groups", str(args.num_groups),
             "--prompts_per_group", str(args.prompts_per_group), "--system_prompt_len", str(args.system_prompt_len),
             "--question_len", str(args.question_len), "--output_len", str(args.output_len)], env)
        for cycle in range(args.cycles):
            variants = ("in-process", "endpoint") if cycle % 2 == 0 else ("endpoint", "in-process")
            for concurrency in args.concurrency:
                for variant in variants:
                    out = tmp / f"c{cycle}-{variant}-{concurrency}"
                    row = {"cycle": cycle, **one_run(variant, concurrency, plan, dataset, out, engine_flags,
                                                     args.warmup, env)}
                    rows.append(row)
                    print(f"cycle {cycle} {variant:10} c={concurrency:<3} TTFT p50 {float(row['ttft_ms_p50']):8.2f} ms  "
                          f"{float(row['output_tokens_per_s']):8.1f} tok/s  load {row['load1_after']}", flush=True)
                    with (args.output / "runs.csv").open("w", newline="") as target:
                        writer = csv.DictWriter(target, COLUMNS)
                        writer.writeheader()
                        writer.writerows(rows)
    (args.output / "table.md").write_text(report(rows, args, host_description()))
    print((args.output / "table.md").read_text())


if __name__ == "__main__":
    main()
