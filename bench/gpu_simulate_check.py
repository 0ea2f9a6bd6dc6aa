"""`kvtool simulate` checked on a GPU (issue 21, target 7): calibrate the plan on this device, then
simulate five scenarios measured here with `kvtool bench` and set TTFT p50 / p90 side by side.

Scenarios (preset:qwen3-8b by default, the plan `kvtool bench --model` builds here):
  reuse         bench_configs/system_prompt.yaml: reuse on and reuse off (two variants)
  offload_abab  bench_configs/offload_abab.yaml: A,B,A,B without reuse, with reuse, with host offload
  concurrency8  system_prompt's dataset, 8 requests in flight (--concurrency 8 --max_batch_size 8)
  poisson       system_prompt's dataset, Poisson arrivals (--request_rate 8)
Each is simulated on the very dataset file measured, with the same flags, twice: with this device's
calibration (`kvtool calibrate --plan PLAN`, the default profile of `kvtool simulate`), and with the
published-spec estimate of the device (`--profile h100` or `h200`). Targets for the calibrated
simulation: TTFT p50 within 10%, p90 within 20%; the published estimate's errors are reported.

A measured directory that already holds a summary.csv is reused (scripts/gpu_check.sh's card step
measures system_prompt and offload_abab on the same plan): --reuse NAME=DIR.
Writes OUTPUT/measured/<scenario>/, OUTPUT/predicted-{calibrated,published}/<scenario>/,
OUTPUT/calibrate.txt and OUTPUT/gpu_simulate.{csv,md}.

    python bench/gpu_simulate_check.py --output out/simulate
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from gpu_reports import write_rows_csv
from simulate_validation import error, read_rows

ROOT = Path(__file__).resolve().parent.parent
KVTOOL = [sys.executable, "-c", "from kvtool.cli import main; main()"]
P50_TARGET, P90_TARGET = 0.10, 0.20


class Scenario(NamedTuple):
    name: str
    args: tuple[str, ...]  # `kvtool bench` / `kvtool simulate` flags; {reuse} is the reuse scenario's directory


SCENARIOS = (
    Scenario("reuse", ("--config", "bench_configs/system_prompt.yaml")),
    Scenario("offload_abab", ("--config", "bench_configs/offload_abab.yaml")),
    Scenario("concurrency8", ("--dataset", "{reuse}/dataset.jsonl", "--tokens_per_block", "32", "--concurrency", "8",
                              "--max_batch_size", "8", "--label", "concurrency-8")),
    Scenario("poisson", ("--dataset", "{reuse}/dataset.jsonl", "--tokens_per_block", "32", "--request_rate", "8",
                         "--label", "poisson-8")),
)


class CheckRow(NamedTuple):
    scenario: str
    variant: str
    profile: str  # "calibrated" or the published device
    measured_p50_ms: float
    predicted_p50_ms: float
    error_p50: float
    measured_p90_ms: float
    predicted_p90_ms: float
    error_p90: float
    target_p50: float | None
    target_p90: float | None


def scenario_args(scenario: Scenario, measured: Path) -> list[str]:
    return [a.replace("{reuse}", str(measured / "reuse")) for a in scenario.args]


def kvtool(args: list[str], log: Path) -> float:
    """Runs a kvtool command (its output appended to ``log``); its seconds. Raises on failure."""
    start = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"$ kvtool {' '.join(args)}\n")
        out.flush()
        subprocess.run([*KVTOOL, *args], check=True, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    return time.perf_counter() - start


def published_profile(device_name: str) -> str | None:
    """h100 / h200 for a device of that name (the published estimates `kvtool simulate --profile` knows)."""
    for name in ("h200", "h100"):
        if name in device_name.lower():
            return name
    return None


def compare(scenario: str, profile: str, measured: list[dict], predicted: list[dict]) -> list[CheckRow]:
    """One row per variant: measured and predicted TTFT p50 / p90 and the relative errors."""
    by_label = {row["label"]: row for row in predicted}
    rows = []
    for real in measured:
        guess = by_label.get(real["label"])
        if guess is None:
            raise RuntimeError(f"{scenario}: the simulation has no variant {real['label']!r}")
        m50, m90 = float(real["ttft_ms_p50"]), float(real["ttft_ms_p90"])
        p50, p90 = float(guess["ttft_ms_p50"]), float(guess["ttft_ms_p90"])
        calibrated = profile == "calibrated"
        rows.append(CheckRow(scenario, real["label"], profile, m50, p50, error(p50, m50), m90, p90, error(p90, m90),
                             P50_TARGET if calibrated else None, P90_TARGET if calibrated else None))
    return rows


def write_reports(rows: list[CheckRow], output: Path, header: dict[str, str]) -> None:
    write_rows_csv(output / "gpu_simulate.csv", rows, header)

    def mark(value: float, target: float | None) -> str:
        return f"{value:+.0%}" + ("" if target is None or abs(value) <= target else " ✗")

    lines = ["# kvtool simulate vs measured on this GPU", ""] + [f"- {k}: {v}" for k, v in header.items()] + [""]
    lines += ["| scenario | variant | profile | TTFT p50 measured / predicted (ms) | error | "
              "TTFT p90 measured / predicted (ms) | error |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.scenario} | {r.variant} | {r.profile} | {r.measured_p50_ms:,.1f} / {r.predicted_p50_ms:,.1f} "
                     f"| {mark(r.error_p50, r.target_p50)} | {r.measured_p90_ms:,.1f} / {r.predicted_p90_ms:,.1f} | "
                     f"{mark(r.error_p90, r.target_p90)} |")
    calibrated = [r for r in rows if r.profile == "calibrated"]
    lines += ["", f"calibrated: p50 within 10% for {sum(abs(r.error_p50) <= P50_TARGET for r in calibrated)} of "
              f"{len(calibrated)} variants, p90 within 20% for {sum(abs(r.error_p90) <= P90_TARGET for r in calibrated)}"]
    (output / "gpu_simulate.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="preset:qwen3-8b")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--reuse", action="append", default=[], metavar="NAME=DIR",
                        help="a scenario already measured (its directory holds summary.csv and dataset.jsonl)")
    args = parser.parse_args()
    import torch

    output = args.output.resolve()
    log = output / "simulate_check.log"
    measured = output / "measured"
    measured.mkdir(parents=True, exist_ok=True)
    for item in args.reuse:
        name, _, directory = item.partition("=")
        if name not in {s.name for s in SCENARIOS} or not (Path(directory) / "summary.csv").is_file():
            parser.error(f"--reuse {item}: expected NAME=DIR with NAME one of {[s.name for s in SCENARIOS]} and "
                         "a measured directory holding summary.csv")
        if not (measured / name / "summary.csv").is_file():
            shutil.copytree(directory, measured / name, dirs_exist_ok=True)
    seconds = {}
    for scenario in SCENARIOS:
        if not (measured / scenario.name / "summary.csv").is_file():
            seconds[f"measure {scenario.name}"] = kvtool(
                ["bench", "--model", args.model, "--output", str(measured / scenario.name),
                 *scenario_args(scenario, measured)], log)
    plan_path = read_rows(measured / "reuse" / "summary.csv")[0]["plan_path"]
    with open(output / "calibrate.txt", "w") as out:
        start = time.perf_counter()
        subprocess.run([*KVTOOL, "calibrate", "--plan", plan_path], check=True, stdout=out,
                       stderr=subprocess.STDOUT, cwd=ROOT)
        seconds["calibrate"] = time.perf_counter() - start
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    profiles = {"calibrated": []}
    published = published_profile(device)
    if published is not None:
        profiles[published] = ["--profile", published]
    rows: list[CheckRow] = []
    for scenario in SCENARIOS:
        real = read_rows(measured / scenario.name / "summary.csv")
        for profile, flags in profiles.items():
            predicted_dir = output / f"predicted-{'calibrated' if profile == 'calibrated' else 'published'}" / scenario.name
            extra = [] if "--dataset" in scenario.args else ["--dataset", str(measured / scenario.name / "dataset.jsonl")]
            seconds[f"simulate {scenario.name} ({profile})"] = kvtool(
                ["simulate", "--model", args.model, "--output", str(predicted_dir), *scenario_args(scenario, measured),
                 *extra, *flags], log)
            rows += compare(scenario.name, profile, real, read_rows(predicted_dir / "summary.csv"))
    header = {"model": args.model, "device": device, "plan": plan_path,
              "seconds": "; ".join(f"{k} {v:.0f}" for k, v in seconds.items())}
    write_reports(rows, output, header)
    print((output / "gpu_simulate.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
