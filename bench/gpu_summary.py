"""One screen of a `make gpu-check` run: each target of issue 21 with its measured value, the target and
met / missed, read from the files the run wrote under OUT (either call's: the summary covers whatever
is there; a figure not measured says so, with the step that measures it).

    python bench/gpu_summary.py OUT      # writes OUT/summary.md and prints it
"""

from __future__ import annotations

import csv
import re
import statistics
import sys
from pathlib import Path
from typing import NamedTuple


class Line(NamedTuple):
    target: str        # the target, in words
    measured: str      # the figure(s), with what they are made of
    wanted: str        # the target value
    verdict: str       # "met", "missed" or "not measured (step ...)"


def read_csv(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def read_result(out: Path, name: str, directory: str) -> list[dict]:
    """A result CSV as gpu-check writes it (OUT/DIRECTORY/NAME) or as results/gpu/ keeps it (flat)."""
    return read_csv(out / directory / name) or read_csv(out / name)


def number(value: str | None) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


def find(rows: list[dict], **contains: str) -> dict | None:
    """The first row whose columns contain the given texts."""
    return next((r for r in rows if all(text in r.get(column, "") for column, text in contains.items())), None)


def missing(target: str, wanted: str, step: str) -> Line:
    return Line(target, "", wanted, f"not measured (step {step})")


def verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def reuse_lines(e2e: list[dict]) -> list[Line]:
    lines = []
    speedup = find(e2e, case="shared prompt: TTFT reuse off / on")
    off, on = find(e2e, case="question, reuse off", metric="median TTFT"), find(e2e, case="question, reuse on",
                                                                                  metric="median TTFT")
    if speedup is None or off is None or on is None:
        lines.append(missing("1. reuse off / on, qwen3-8b 2k prefix + 128, batch 1", ">= 10x", "e2e"))
    else:
        ratio = number(speedup["value"])
        lines.append(Line("1. reuse off / on, qwen3-8b 2k prefix + 128, batch 1",
                          f"{ratio:.1f}x ({number(off['value']):.1f} / {number(on['value']):.2f} ms)", ">= 10x",
                          verdict(ratio >= 10)))
    floor, ratio_row = find(e2e, case="floor: ", metric="TTFT floor"), find(e2e, case="reuse on: TTFT floor")
    if floor is None or ratio_row is None:
        lines.append(missing("1. hit TTFT / its floor", "<= 1.5x", "e2e"))
    else:
        times = 1 / number(ratio_row["ratio"])
        lines.append(Line("1. hit TTFT / its floor (weights/D2D + GEMM FLOPs/matmul rate)",
                          f"{times:.2f}x ({number(ratio_row['baseline']):.2f} / {number(floor['value']):.2f} ms)",
                          "<= 1.5x", verdict(times <= 1.5)))
    eager = find(e2e, case="CUDA graphs: hit TTFT eager / replayed")
    if eager is not None:
        lines.append(Line("   hit without / with its CUDA graph", f"{number(eager['value']):.2f}x", "", ""))
    return lines


def step_lines(steps: list[dict]) -> list[Line]:
    if not steps:
        return [missing("2. host time per step <= 512 tokens (graphs)", "<= 1000 us", "e2e")]
    lines = []
    for row in steps:
        if row["cuda_graphs"] != "on":
            continue
        eager = find(steps, case=row["case"], cuda_graphs="off")
        eager_text = "" if eager is None else (f"; eager {number(eager['host_launch_calls']):.0f} launches, "
                                               f"host {number(eager['host_us']):,.0f} us")
        measured = (f"host {number(row['host_us']):,.0f} us, GPU {number(row['gpu_us']):,.0f} us, "
                    f"{number(row['host_launch_calls']):.0f} launches ({number(row['gpu_kernels']):.0f} kernels)"
                    f"{eager_text}")
        target = number(row.get("target_host_us"))
        lines.append(Line(f"2. step: {row['case']}", measured, "" if target is None else f"host <= {target:.0f} us",
                          "" if target is None else verdict(number(row["host_us"]) <= target)))
    return lines


def tpot_line(e2e: list[dict]) -> Line:
    row = find(e2e, case="decode: TPOT byte floor")
    if row is None:
        return missing("3. TPOT at batch 1 / its byte floor", "<= 1.2x", "e2e")
    floor = find(e2e, metric="TPOT byte floor")
    times = 1 / number(row["ratio"])
    return Line("3. TPOT at batch 1 / its byte floor ((weights + KV) / D2D)",
                f"{times:.2f}x ({number(row['baseline']):.2f} / {number(floor['value']):.2f} ms)", "<= 1.2x",
                verdict(times <= 1.2))


def kernel_lines(suite: list[dict]) -> list[Line]:
    lines = []
    for batch in (1, 64):
        row = find(suite, section="decode", case=f"batch {batch} x ctx 4096", metric="effective KV bandwidth")
        row = row if row is not None and number(row.get("target")) else None
        if row is None:
            lines.append(missing(f"4. decode attention / D2D, batch {batch}", ">= 0.8", "bench"))
            continue
        ratio = number(row["ratio"])
        lines.append(Line(f"4. decode attention / D2D bandwidth, batch {batch}, 4k context",
                          f"{ratio:.3f} ({number(row['value']):,.0f} / {number(row['baseline']):,.0f} GB/s)", ">= 0.8",
                          verdict(ratio >= 0.8)))
    context = [r for r in suite if r.get("section") == "context" and number(r.get("target"))]
    if not context:
        lines.append(missing("4. context attention / fastest SDPA", ">= 0.8", "bench"))
    else:
        best = max(context, key=lambda r: number(r["ratio"]) or 0)
        ratio = number(best["ratio"])
        lines.append(Line("4. context attention / fastest SDPA (4 x 4k causal)",
                          f"{ratio:.2f} ({number(best['value']):.0f} / {number(best['baseline']):.0f} TFLOP/s)",
                          ">= 0.8", verdict(ratio >= 0.8)))
    split = find(suite, section="context", case="key splits", metric="speed-up")
    if split is not None:  # the reuse hit's attention alone: a few query rows over a long prefix
        lines.append(Line(f"   context attention, {split['case']}", f"{number(split['value']):.2f}x", "", ""))
    return lines


def copy_lines(suite: list[dict], out: Path) -> list[Line]:
    lines = []
    runtime = [r for r in suite if r.get("section") == "swap" and "runtime step" in r.get("case", "")
               and ", memcpy:" in r.get("case", "")]
    if not runtime:
        lines.append(missing("5. offload + onboard on the copy engines / pinned H2D + D2H", ">= 0.8", "bench"))
    else:
        ratio = number(runtime[0]["ratio"])
        lines.append(Line("5. offload + onboard step (copy engines) / pinned H2D + D2H",
                          f"{ratio:.2f} ({number(runtime[0]['value']):.1f} / {number(runtime[0]['baseline']):.1f} GB/s)",
                          ">= 0.8", verdict(ratio >= 0.8)))
    requests = read_csv(out / "card" / "offload_abab_host45GB" / "requests-reuse_offload.csv")
    ttfts = [number(r["ttft_ms"]) for r in requests if number(r.get("ttft_ms")) is not None and not r.get("error")]
    if not ttfts:
        lines.append(missing("5. A,B,A,B with a 45 GB host cache: max / median TTFT", "<= 1.5", "card"))
    else:
        median = statistics.median(ttfts)
        lines.append(Line("5. A,B,A,B with a 45 GB host cache: max / median TTFT",
                          f"{max(ttfts) / median:.2f} ({max(ttfts):.1f} / {median:.1f} ms)", "<= 1.5",
                          verdict(max(ttfts) / median <= 1.5)))
    return lines


def peer_lines(e2e: list[dict], peer: list[dict]) -> list[Line]:
    if not peer:
        return [missing("6. transformers (sdpa_paged) on the same GPU", "kvtool faster", "peer")]
    lines = []
    for label, case, metric in (("TTFT reuse off", "question, reuse off", "median TTFT"),
                                ("TTFT reuse on", "question, reuse on", "median TTFT"),
                                ("TPOT", "-token prompt, decode", "median TPOT")):
        theirs = find(peer, case=case, metric=metric)
        # kvtool's row of the very case (e2e also has "..., decode without CUDA graphs" and the like)
        ours = theirs and next((r for r in e2e if (r["case"], r["metric"]) == (theirs["case"], metric)), None)
        if theirs is None or ours is None:
            lines.append(missing(f"6. {label}: kvtool / transformers", "kvtool faster", "peer and e2e"))
            continue
        a, b = number(ours["value"]), number(theirs["value"])
        lines.append(Line(f"6. {label}: kvtool / transformers", f"{a:.2f} / {b:.2f} ms", "kvtool faster",
                          verdict(a < b)))
    return lines


def simulate_lines(rows: list[dict]) -> list[Line]:
    if not rows:
        return [missing("7. simulate vs measured, 5 scenarios (calibrated here)", "p50 10%, p90 20%", "simcheck")]
    calibrated = [r for r in rows if r["profile"] == "calibrated"]
    p50 = sum(abs(number(r["error_p50"])) <= 0.10 for r in calibrated)
    p90 = sum(abs(number(r["error_p90"])) <= 0.20 for r in calibrated)
    lines = [Line("7. simulate vs measured, 5 scenarios (calibrated here)",
                  f"p50 within 10%: {p50}/{len(calibrated)}, p90 within 20%: {p90}/{len(calibrated)} variants",
                  "all", verdict(p50 == p90 == len(calibrated)))]
    published = [r for r in rows if r["profile"] != "calibrated"]
    if published:
        errors = [abs(number(r["error_p50"])) for r in published], [abs(number(r["error_p90"])) for r in published]
        lines.append(Line(f"7. published-spec --profile {published[0]['profile']}",
                          f"median |error| p50 {statistics.median(errors[0]):.0%}, p90 {statistics.median(errors[1]):.0%}",
                          "(reported)", ""))
    return lines


def other_target_lines(e2e: list[dict], suite: list[dict]) -> list[Line]:
    """Every other row with a target (issue 12's, re-measured in this run)."""
    counted = ("reuse off / on", "TTFT floor /", "TPOT byte floor /")
    rows = [r for r in e2e if number(r.get("target")) and not any(c in r["case"] for c in counted)]
    rows += [r for r in suite if number(r.get("target")) and r.get("section") in ("blocks",)]
    return [Line(f"   {r['case']}", f"{number(r['ratio']):.3g}", f">= {number(r['target']):.3g}",
                 verdict(number(r["ratio"]) >= number(r["target"]))) for r in rows]


def test_line(out: Path) -> Line:
    log = out / "pytest_gpu.log"
    log = log if log.is_file() else out / "pytest_gpu.txt"
    if not log.is_file():
        return missing("GPU tests (pytest -m gpu)", "all pass", "test")
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
    failed = re.search(r"(\d+) (failed|error)", tail[0])
    return Line("GPU tests (pytest -m gpu)", tail[0].strip("= "), "all pass", verdict(failed is None and "passed" in tail[0]))


def guarded(group: str, build) -> list[Line]:
    """``build()``'s lines; a row it cannot read (a figure missing or not a number) costs one line, not
    the summary of the whole run."""
    try:
        lines = build()
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        return [Line(group, f"could not read the files: {type(error).__name__}: {error}", "", "missed")]
    return lines if isinstance(lines, list) else [lines]


def summarize(out: Path) -> str:
    e2e = read_result(out, "gpu_e2e.csv", "gpu_e2e")
    suite = read_result(out, "gpu_suite.csv", "gpu_suite")
    device = (e2e or suite or [{}])[0].get("device", "") or _device_from_env(out)
    groups = [("GPU tests", lambda: test_line(out)), ("1. reuse", lambda: reuse_lines(e2e)),
              ("2. steps", lambda: step_lines(read_result(out, "gpu_steps.csv", "gpu_e2e"))),
              ("3. TPOT", lambda: tpot_line(e2e)), ("4. kernels", lambda: kernel_lines(suite)),
              ("5. copies", lambda: copy_lines(suite, out)),
              ("6. peer", lambda: peer_lines(e2e, read_result(out, "gpu_peer.csv", "peer"))),
              ("7. simulate", lambda: simulate_lines(read_result(out, "gpu_simulate.csv", "simulate"))),
              ("other targets", lambda: other_target_lines(e2e, suite))]
    lines = [line for group, build in groups for line in guarded(group, build)]
    met = sum(line.verdict == "met" for line in lines)
    missed = sum(line.verdict == "missed" for line in lines)
    text = [f"# kvtool gpu-check: {device or 'device unknown'}", "",
            f"{met} met, {missed} missed, {sum(line.verdict.startswith('not') for line in lines)} not measured "
            f"(files under {out})", "", "| target (issue 21) | measured | target | |", "|---|---|---|---|"]
    text += [f"| {line.target} | {line.measured} | {line.wanted} | {line.verdict} |" for line in lines]
    return "\n".join(text) + "\n"


def _device_from_env(out: Path) -> str:
    env = out / "env.txt"
    match = re.search(r"^device (.+?) capability", env.read_text(), re.M) if env.is_file() else None
    return match.group(1) if match else ""


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if sys.argv[1:] in (["-h"], ["--help"]) else 2
    out = Path(sys.argv[1])
    text = summarize(out)
    (out / "summary.md").write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
