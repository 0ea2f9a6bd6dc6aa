"""Validates `kvtool simulate` against measured runs (not a test): every scenario directory of a
results tree (results/cpu/, written by bench/cpu_results.sh) is simulated on the same dataset file with
the same scenario and model, and the predicted TTFT p50 / p90 and cache counters are set beside the
measured ones. Targets (issue 14): p50 within 15%, p90 within 25%, counters equal. Each variant is
simulated with its own plan's calibration on this machine (`kvtool calibrate --plan PLAN_DIR` for each
plan_path of the measured summaries), or with --profile FILE for all.

    .venv/bin/python bench/simulate_validation.py --measured results/simulate/measured \
        --output results/simulate/predicted
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KVTOOL = [str(Path(sys.executable).parent / "kvtool")]
COUNTERS = ("reused_blocks", "missed_blocks", "offloaded_blocks", "onboarded_blocks", "evicted_blocks")
P50_TARGET, P90_TARGET = 0.15, 0.25


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def simulate(measured_dir: Path, output_dir: Path, profile: str | None) -> tuple[list[dict], float]:
    """Simulates the scenario of a measured directory on its dataset; (summary rows, seconds)."""
    first = read_rows(measured_dir / "summary.csv")[0]
    scenario = ROOT / first["scenario_file"]
    args = [*KVTOOL, "simulate", "--config", str(scenario), "--model", first["model"],
            "--dataset", str(measured_dir / "dataset.jsonl"), "--output", str(output_dir)]
    if profile is not None:
        args += ["--profile", profile]
    start = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    return read_rows(output_dir / "summary.csv"), time.perf_counter() - start


def error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", type=Path, default=ROOT / "results" / "simulate" / "measured")
    parser.add_argument("--profile", help="one cost model file for every variant (default: each plan's own)")
    parser.add_argument("--output", type=Path, default=ROOT / "results" / "simulate" / "predicted")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    table = []
    for measured_dir in sorted(p for p in args.measured.iterdir() if (p / "summary.csv").is_file()):
        measured = {r["label"]: r for r in read_rows(measured_dir / "summary.csv")}
        rows, seconds = simulate(measured_dir, args.output / measured_dir.name, args.profile)
        print(f"{measured_dir.name}: {len(rows)} variants simulated in {seconds:.1f} s", flush=True)
        for row in rows:
            real = measured[row["label"]]
            entry = {"scenario": measured_dir.name, "variant": row["label"]}
            for stat in ("p50", "p90"):
                m, p = float(real[f"ttft_ms_{stat}"]), float(row[f"ttft_ms_{stat}"])
                entry.update({f"measured_ttft_{stat}_ms": round(m, 1), f"predicted_ttft_{stat}_ms": round(p, 1),
                              f"error_{stat}": round(error(p, m), 3)})
            entry["counters_equal"] = all(real[c] == row[c] for c in COUNTERS)
            entry["measured_hit_rate"], entry["predicted_hit_rate"] = real["cache_hit_rate"], row["cache_hit_rate"]
            table.append(entry)
    with open(args.output / "validation.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    lines = ["| scenario | variant | TTFT p50 measured / predicted (ms) | error | TTFT p90 measured / predicted (ms) "
             "| error | counters equal |", "|---|---|---|---|---|---|---|"]
    for e in table:
        def mark(value, target):
            return f"{value:+.0%}" + ("" if abs(value) <= target else " ✗")
        lines.append(f"| {e['scenario']} | {e['variant']} | {e['measured_ttft_p50_ms']:,} / {e['predicted_ttft_p50_ms']:,} "
                     f"| {mark(e['error_p50'], P50_TARGET)} | {e['measured_ttft_p90_ms']:,} / "
                     f"{e['predicted_ttft_p90_ms']:,} | {mark(e['error_p90'], P90_TARGET)} | "
                     f"{'yes' if e['counters_equal'] else 'NO'} |")
    within = sum(abs(e["error_p50"]) <= P50_TARGET for e in table), sum(abs(e["error_p90"]) <= P90_TARGET for e in table)
    lines.append("")
    lines.append(f"p50 within 15%: {within[0]} of {len(table)}; p90 within 25%: {within[1]} of {len(table)}; "
                 f"counters equal: {sum(e['counters_equal'] for e in table)} of {len(table)}")
    (args.output / "validation.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
