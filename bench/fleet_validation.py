"""Validates `kvtool simulate --replicas N --router R` against N real `kvtool serve` processes on this CPU
(not a test): the same trace slice is replayed through `kvtool bench --endpoint URL ... --router R
--mode trace` and simulated with the plan's calibration on this machine; per-replica cache counters and
TTFT p50 are set side by side. Targets (issue 25): counters exact for deterministic routers (round_robin:
its choice does not depend on timing), TTFT p50 within 20%.

Each server runs with OMP_NUM_THREADS=--threads (the calibration too), on fresh caches for each router.

    .venv/bin/python bench/fleet_validation.py --output results/fleets/validation
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from trace_data import TRACE_NAME, find_conversation_trace  # the shared trace, found above the checkout

ROOT = Path(__file__).resolve().parent.parent
KVTOOL = str(Path(sys.executable).parent / "kvtool")
COUNTERS = ("reused_blocks", "missed_blocks", "evicted_blocks")
P50_TARGET = 0.20


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def run(args: list[str], env: dict, log: Path) -> None:
    with open(log, "w") as out:
        subprocess.run(args, check=True, stdout=out, stderr=subprocess.STDOUT, env=env)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def servers(plan: Path, count: int, pool_tokens: int, env: dict, logs: Path):
    """``count`` kvtool serve processes of ``plan``; their URLs once each lists its model."""
    processes, urls = [], []
    with contextlib.ExitStack() as stack:
        stack.callback(_stop, processes)  # however the start ends
        for i in range(count):
            port = free_port()
            log = stack.enter_context(open(logs / f"serve-{i}.log", "w"))
            processes.append(subprocess.Popen([KVTOOL, "serve", "--plan", str(plan), "--port", str(port),
                                               "--max_tokens_in_paged_kv_cache", str(pool_tokens)],
                                              stdout=log, stderr=subprocess.STDOUT, env=env))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 120
        for url, process in zip(urls, processes):
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"kvtool serve at {url} exited: see {logs}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kvtool serve at {url} did not start")
                time.sleep(0.2)
        yield urls


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait(30)


def error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=ROOT / "results" / "fleets" / "validation")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--routers", default="round_robin,least_loaded,prefix_aware")
    parser.add_argument("--requests", type=int, default=150, help="the trace's first N lines")
    parser.add_argument("--pool_tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each server and the calibration")
    parser.add_argument("--trace", type=Path, help="the Mooncake trace (default: shared/data above the checkout)")
    parser.add_argument("--time_scale", type=float, default=1.0)
    parser.add_argument("--no_served", dest="served", action="store_false",
                        help="simulate the engine alone (without `kvtool calibrate --served`'s costs of serving)")
    args = parser.parse_args()
    args.trace = args.trace or find_conversation_trace()
    if args.trace is None:
        parser.error(f"no shared/data/{TRACE_NAME} above the checkout: give --trace PATH")
    out = args.output
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}

    plan = out / "plan"
    if not plan.is_dir():
        run([KVTOOL, "build", "--model", "preset:tiny-llama", "--tokens_per_block", "16", "--max_seq_len", "2048",
             "--output", str(plan)], env, out / "build.log")
    if not list((plan / "cost_models").glob("*.json")):
        # --served: what kvtool serve and the bench's client add here too (the fleet below is served).
        run([KVTOOL, "calibrate", "--plan", str(plan), *(["--served"] if args.served else [])], env,
            out / "calibrate.log")
    dataset = out / "slice.jsonl"
    if not dataset.is_file():
        head = out / "trace-head.jsonl"
        with open(args.trace) as source, open(head, "w") as sink:
            for _, line in zip(range(args.requests), source):
                sink.write(line)
        run([KVTOOL, "dataset", "import", str(head), "--format", "mooncake", "--shrink", "16", "--plan", str(plan),
             "--max_seq_len", "2048", "--skip_too_long", "--max_output_tokens", "16", "--output", str(dataset)],
            env, out / "import.log")
        head.unlink()

    replay = ["--dataset", str(dataset), "--mode", "trace", "--time_scale", str(args.time_scale)]
    lines = ["| router | row | requests real / sim | " + " | ".join(f"{c} real / sim" for c in COUNTERS)
             + " | TTFT p50 real / sim (ms) | error |", "|" + "---|" * (4 + len(COUNTERS))]
    for router in args.routers.split(","):
        real_dir, sim_dir = out / f"{router}-real", out / f"{router}-simulated"
        # One server: the baseline of what a single simulated engine predicts here (no router).
        fleet = ["--router", router, "--router_block_size", "16"] if args.replicas > 1 else []
        with servers(plan, args.replicas, args.pool_tokens, env, out) as urls:
            bench = [KVTOOL, "bench", *(a for url in urls for a in ("--endpoint", url)), *fleet, *replay,
                     "--output", str(real_dir)]
            started, load = time.perf_counter(), os.getloadavg()[0]
            run(bench, env, out / f"{router}-bench.log")
            print(f"{router}: measured in {time.perf_counter() - started:.1f} s; load average {load:.1f} before, "
                  f"{os.getloadavg()[0]:.1f} after", flush=True)
        run([KVTOOL, "simulate", "--plan", str(plan), *(["--replicas", str(args.replicas)] if fleet else []),
             *(["--served"] if args.served else []),
             *fleet[:2], "--max_tokens_in_paged_kv_cache", str(args.pool_tokens), *replay, "--output", str(sim_dir)],
            env, out / f"{router}-simulate.log")
        for real, sim in zip(read_rows(real_dir / "summary.csv"), read_rows(sim_dir / "summary.csv")):
            name = "one server" if not fleet else "fleet" if real["replica"] == "" else f"replica {real['replica']}"
            counters = " | ".join(f"{real[c]} / {sim[c]}{'' if real[c] == sim[c] else ' ≠'}" for c in COUNTERS)
            p50_real, p50_sim = float(real["ttft_ms_p50"]), float(sim["ttft_ms_p50"])
            lines.append(f"| {router} | {name} | {real['num_requests']} / {sim['num_requests']} | {counters} | "
                         f"{p50_real:.1f} / {p50_sim:.1f} | {error(p50_sim, p50_real):+.1%} |")
    table = "\n".join(lines)
    print(table)
    (out / "table.md").write_text(table + "\n")
    # The cost model's own error on held-out steps, and the load the measurements ran under.
    if (out / "calibrate.log").is_file():
        print("\n".join(line for line in (out / "calibrate.log").read_text().splitlines()
                        if line.startswith(("held-out", "served by"))))


if __name__ == "__main__":
    main()
