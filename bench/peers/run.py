"""kvtool, vLLM's CPU build and transformers side by side on one real model and one real-text workload.

Prepares the model (gguf:smollm2-135m, dequantized to float32: a kvtool plan and a Hugging Face
checkpoint for the peers) and the dataset (groups of requests sharing a ~1,024-token passage of
examples/text, each with its own ~32-token question, chat template applied, one extra first line
as the uncounted warm-up), then runs every variant in turn, several cycles, the order rotating
each cycle so no engine always runs first. Each variant is a fresh process. While they run, the
machine's load is sampled: the load average, and the CPU share of processes that are not the
benchmark (other users of the machine).

Writes to --output (results/peers by default): summary.csv (one row per variant, every cycle's
requests pooled, plus the median over cycles of each cycle's TTFT p50), requests-VARIANT.csv,
cycles.csv (per cycle and variant), load.csv, compare.txt/.csv and ttft.png (`kvtool compare`),
dataset.jsonl, and table.md (the headline table, the counters, whether every engine generated the
same token ids, and the partial-reuse check). Peers run in their own venv (`make peers` sets it up).

    .venv/bin/python bench/peers/run.py --peer_python /work/peers/vllm-venv/bin/python --cycles 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from common import load_requests, read_outputs  # noqa: E402

from kvtool.reports.metrics import summarize  # noqa: E402
from kvtool.reports.csv_report import RequestCsvWriter, read_csv, request_metrics_from_row, write_summary_csv  # noqa: E402

MODEL = "gguf:smollm2-135m"
TEXT = REPO / "examples" / "text" / "ordinary_things.txt"
# vLLM's CPU backend, as its start-up advice asks: threads pinned to the cores, tcmalloc + Intel OpenMP.
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


@dataclass(frozen=True)
class Variant:
    name: str
    engine: str
    reuse: bool
    args: tuple[str, ...]


VARIANTS = (
    Variant("kvtool reuse-on", "kvtool", True, ("--reuse", "on")),
    Variant("kvtool reuse-off", "kvtool", False, ("--reuse", "off")),
    Variant("kvtool reuse-on no-partial", "kvtool", True, ("--reuse", "on", "--partial_reuse", "off")),
    Variant("vllm reuse-on", "vllm", True, ("--prefix_caching", "on")),
    Variant("vllm reuse-off", "vllm", False, ("--prefix_caching", "off")),
    Variant("transformers copied-prefix", "transformers", True, ("--prefix_cache", "copy")),
    Variant("transformers no-cache", "transformers", False, ("--prefix_cache", "off")),
)


def slug(name: str) -> str:
    return name.replace(" ", "-")


# -- preparation -------------------------------------------------------------------------------

def prepare(work: Path, args) -> tuple[Path, Path, Path]:
    """(plan, checkpoint, dataset) under ``work``; each is made once and reused."""
    from kvtool.workloads.generators import GeneratorOptions
    from kvtool.workloads.text import TextSource, text_system_prompt
    from kvtool.models.gguf import dequantize_gguf, resolve_gguf
    from kvtool.plan import BuildOptions, build_plan, load_plan

    plan, checkpoint, dataset = work / "plan", work / "checkpoint", work / "dataset.jsonl"
    if not (plan / "plan.json").is_file():
        print(f"building {MODEL} into {plan}", flush=True)
        build_plan(MODEL, plan, BuildOptions(tokens_per_block=args.tokens_per_block, max_seq_len=2048))
    if not (checkpoint / "config.json").is_file():
        print(f"dequantizing {MODEL} into {checkpoint} (for the peers)", flush=True)
        dequantize_gguf(resolve_gguf(MODEL).path, checkpoint)
    if not dataset.is_file():
        source = TextSource.from_file(TEXT, load_plan(plan, verify_checksum=False).tokenizer, chat=True)
        # One group more than measured: its first request is the warm-up, the rest of it is dropped,
        # so the warm-up shares no passage with the measured groups.
        lines = text_system_prompt(source, GeneratorOptions(), num_groups=args.num_groups + 1,
                                   prompts_per_group=args.prompts_per_group,
                                   system_prompt_len=args.system_prompt_len, question_len=args.question_len,
                                   output_len=args.output_len)
        lines = lines[:1] + lines[args.prompts_per_group:]
        for number, line in enumerate(lines):
            line["request_id"] = "warmup" if number == 0 else f"g{(number - 1) // args.prompts_per_group}" \
                                                             f"q{(number - 1) % args.prompts_per_group}"
        dataset.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return plan, checkpoint, dataset


def command(variant: Variant, plan: Path, checkpoint: Path, dataset: Path, output: Path, args) -> list[str]:
    common = ["--dataset", str(dataset), "--output", str(output), "--label", variant.name, *variant.args]
    if variant.engine == "kvtool":
        return [sys.executable, str(HERE / "kvtool_replay.py"), "--plan", str(plan), *common]
    if variant.engine == "vllm":
        return [args.peer_python, str(HERE / "vllm_replay.py"), "--model", str(checkpoint),
                "--block_size", str(args.tokens_per_block), *common]
    return [sys.executable, str(HERE / "transformers_replay.py"), "--model", str(checkpoint), *common]


def environment(variant: Variant, args) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]))
    if variant.engine == "vllm":
        iomp = Path(args.peer_python).resolve().parent.parent / "lib" / "libiomp5.so"
        env.update(VLLM_ENV, LD_PRELOAD=":".join(str(p) for p in (TCMALLOC, iomp) if Path(p).is_file()))
    return env


# -- load ----------------------------------------------------------------------------------------

class LoadSampler:
    """Samples the machine every few seconds: load average, total CPU busy share and the share used
    by processes outside the benchmark's process tree (other users of the machine)."""

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self.variant = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        ticks_per_s = os.sysconf("SC_CLK_TCK")
        num_cpus = os.cpu_count() or 1
        previous = (time.monotonic(), _cpu_busy_ticks(), _tree_ticks(os.getpid()))
        while not self._stop.wait(self.interval_s):
            now = (time.monotonic(), _cpu_busy_ticks(), _tree_ticks(os.getpid()))
            elapsed = now[0] - previous[0]
            capacity = elapsed * ticks_per_s * num_cpus
            busy = 100.0 * (now[1] - previous[1]) / capacity
            ours = 100.0 * max(0, now[2] - previous[2]) / capacity
            self.samples.append({"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "variant": self.variant,
                                 "loadavg_1m": os.getloadavg()[0], "cpu_busy_pct": round(busy, 1),
                                 "cpu_benchmark_pct": round(min(ours, busy), 1),
                                 "cpu_other_pct": round(max(0.0, busy - ours), 1)})
            previous = now


def _cpu_busy_ticks() -> int:
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]) - idle


def _tree_ticks(root: int) -> int:
    """CPU ticks (user + system) of ``root`` and every live descendant."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        ticks[int(entry)] = int(fields[11]) + int(fields[12])
    total, frontier = 0, [root]
    while frontier:
        pid = frontier.pop()
        total += ticks.get(pid, 0)
        frontier.extend(children.get(pid, ()))
    return total


# -- results -------------------------------------------------------------------------------------

def aggregate(work: Path, out: Path, cycles: int, dataset: Path, sampler: LoadSampler, args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary_rows, cycle_rows = [], []
    requests_by_variant, outputs_by_variant = {}, {}
    for variant in VARIANTS:
        runs = [work / f"cycle-{c}" / slug(variant.name) for c in range(cycles)]
        runs = [run for run in runs if (run / "summary.csv").is_file()]
        if not runs:
            continue
        pooled, per_cycle_p50 = [], []
        for cycle, run in enumerate(runs):
            rows = [request_metrics_from_row(r) for r in read_csv(run / "requests.csv")]
            pooled += rows
            load = [s for s in sampler.samples if s["variant"] == f"{cycle}:{variant.name}"]
            summary = summarize(rows)
            per_cycle_p50.append(summary.ttft_ms.p50)
            cycle_rows.append({"variant": variant.name, "cycle": cycle, "ttft_ms_p50": summary.ttft_ms.p50,
                               "ttft_ms_mean": summary.ttft_ms.mean, "total_reused_tokens": summary.total_reused_tokens,
                               "cpu_other_pct_mean": _mean(s["cpu_other_pct"] for s in load),
                               "loadavg_1m_mean": _mean(s["loadavg_1m"] for s in load)})
        requests_csv = out / f"requests-{slug(variant.name)}.csv"
        with RequestCsvWriter(requests_csv) as writer:
            for row in pooled:
                writer.write(row)
        last = read_csv(runs[-1] / "summary.csv")[0]
        config = {k: v for k, v in last.items() if not k.startswith(("ttft_", "tpot_", "itl_", "e2e_"))}
        summary_rows.append({**config, "label": variant.name, "cycles": len(runs),
                             "ttft_ms_p50_median_of_cycles": statistics.median(per_cycle_p50),
                             "ttft_ms_p50_per_cycle": " ".join(f"{v:.1f}" for v in per_cycle_p50),
                             **summarize(pooled).as_row(), "requests_csv": requests_csv.name})
        requests_by_variant[variant.name] = pooled
        outputs_by_variant[variant.name] = [read_outputs(run / "outputs.jsonl") for run in runs]
    write_summary_csv(out / "summary.csv", summary_rows)
    write_summary_csv(out / "cycles.csv", cycle_rows)
    write_summary_csv(out / "load.csv", sampler.samples)
    (out / "dataset.jsonl").write_text(dataset.read_text())
    compare = subprocess.run([str(Path(sys.executable).parent / "kvtool"), "compare", str(out / "summary.csv"),
                              "--plot", str(out / "ttft.png"), "--output", str(out / "compare.csv")],
                             capture_output=True, text=True, env=dict(os.environ, COLUMNS="200"))
    (out / "compare.txt").write_text(compare.stdout + compare.stderr)
    (out / "table.md").write_text(headline(summary_rows, requests_by_variant, outputs_by_variant, sampler, dataset,
                                           args))


def _mean(values) -> float | None:
    values = list(values)
    return round(sum(values) / len(values), 1) if values else None


def headline(rows, requests_by_variant, outputs_by_variant, sampler, dataset: Path, args) -> str:
    by_name = {row["label"]: row for row in rows}
    requests = load_requests(dataset)[1:]
    lines = ["# kvtool vs vLLM vs transformers: TTFT on SmolLM2-135M-Instruct (float32, CPU)", "",
             f"Workload: {dataset.name}: {len(requests)} measured requests ({args.num_groups} groups x "
             f"{args.prompts_per_group}), prompts {min(len(r.input_ids) for r in requests)}-"
             f"{max(len(r.input_ids) for r in requests)} tokens (a ~{args.system_prompt_len}-token passage of "
             f"examples/text as system prompt + a ~{args.question_len}-token question, chat template), "
             f"{args.output_len} output tokens (EOS ignored), sequential, one uncounted warm-up, "
             f"{args.tokens_per_block}-token blocks. Each figure: the median over {args.cycles} cycles of that "
             "cycle's TTFT p50 (variants alternate, order rotating).", "",
             f"Machine: {rows[0].get('host', '?')}.", "",
             "| engine | TTFT p50, reuse on (ms) | TTFT p50, reuse off (ms) | reuse speed-up | on vs vLLM | off vs vLLM |",
             "|---|---:|---:|---:|---:|---:|"]
    pairs = {"kvtool": ("kvtool reuse-on", "kvtool reuse-off"), "vllm": ("vllm reuse-on", "vllm reuse-off"),
             "transformers": ("transformers copied-prefix", "transformers no-cache")}
    vllm = [by_name.get(name, {}).get("ttft_ms_p50_median_of_cycles") for name in pairs["vllm"]]
    for engine, (on_name, off_name) in pairs.items():
        on = by_name.get(on_name, {}).get("ttft_ms_p50_median_of_cycles")
        off = by_name.get(off_name, {}).get("ttft_ms_p50_median_of_cycles")
        if on is None and off is None:
            continue
        lines.append(f"| {engine} | {_fmt(on)} | {_fmt(off)} | {_ratio(off, on)} | {_ratio(on, vllm[0])} | "
                     f"{_ratio(off, vllm[1])} |")
    lines += ["", "Per cycle (TTFT p50, ms):", ""]
    lines += [f"- {row['label']}: {row['ttft_ms_p50_per_cycle']}" for row in rows]
    lines += ["", "## Cache counters (over one cycle's measured requests)", ""]
    for row in rows:
        cycles = int(row["cycles"])
        reused = int(row["total_reused_tokens"]) // cycles
        total = int(row["total_input_tokens"]) // cycles
        detail = f"{reused:,} of {total:,} prompt tokens reused"
        if row.get("reused_blocks") not in (None, ""):
            detail += f"; blocks reused / missed {row['reused_blocks']} / {row['missed_blocks']}"
        if row.get("prefix_cache_hits_tokens") not in (None, ""):
            detail += (f"; vLLM prefix cache hits / queries {float(row['prefix_cache_hits_tokens']):,.0f} / "
                       f"{float(row['prefix_cache_queries_tokens']):,.0f} tokens")
        lines.append(f"- {row['label']}: {detail}")
    lines += ["", "## Greedy token ids across engines", "", identity(outputs_by_variant, len(requests),
                                                                      args.output_len), ""]
    lines += partial_reuse_check(requests_by_variant, args.prompts_per_group)
    lines += ["", "## Load while each variant ran", "",
              "CPU share of processes other than the benchmark (mean of samples), and the 1-minute load average:", ""]
    for variant in VARIANTS:
        samples = [s for s in sampler.samples if s["variant"].split(":", 1)[-1] == variant.name]
        if samples:
            lines.append(f"- {variant.name}: other processes {_mean(s['cpu_other_pct'] for s in samples)}% CPU "
                         f"(max {max(s['cpu_other_pct'] for s in samples)}%), load average "
                         f"{_mean(s['loadavg_1m'] for s in samples)}")
    return "\n".join(lines) + "\n"


def identity(outputs_by_variant, num_requests: int, output_len: int) -> str:
    reference_name = "transformers no-cache" if "transformers no-cache" in outputs_by_variant else \
        next(iter(outputs_by_variant))
    reference = outputs_by_variant[reference_name][0]
    differing = []
    for name, runs in outputs_by_variant.items():
        for cycle, outputs in enumerate(runs):
            bad = sorted(rid for rid in reference if outputs.get(rid) != reference[rid])
            if bad:
                differing.append(f"{name} cycle {cycle}: {len(bad)} requests differ ({', '.join(bad[:4])})")
    runs = sum(len(r) for r in outputs_by_variant.values())
    if not differing:
        return (f"All {num_requests} x {output_len} greedy token ids are identical in every variant and cycle "
                f"({runs} runs, against {reference_name}).")
    return f"Against {reference_name}: " + "; ".join(differing)


def partial_reuse_check(requests_by_variant, prompts_per_group: int) -> list[str]:
    """TTFT of each group's first request (a miss: nothing of its passage is cached, but its chat
    header may match the previous prompt's first, partial block)."""
    lines = ["## Misses: each group's first request", "",
             "These share only the chat header (a few tokens of the first block) with earlier prompts. "
             "Median TTFT of these misses over all cycles:", ""]
    for name in ("kvtool reuse-on", "kvtool reuse-on no-partial", "kvtool reuse-off", "vllm reuse-on",
                 "vllm reuse-off"):
        rows = requests_by_variant.get(name)
        if not rows:
            continue
        misses = [r.ttft_ms for r in rows if r.request_id.endswith("q0") and r.ttft_ms is not None]
        hits = [r.ttft_ms for r in rows if not r.request_id.endswith("q0") and r.ttft_ms is not None]
        lines.append(f"- {name}: misses {_fmt(statistics.median(misses))} ms (n={len(misses)}), "
                     f"hits {_fmt(statistics.median(hits))} ms (n={len(hits)})")
    return lines


def _fmt(value) -> str:
    return "-" if value in (None, "") else f"{float(value):,.0f}"


def _ratio(a, b) -> str:
    if a in (None, "") or b in (None, "") or not float(b):
        return "-"
    return f"{float(a) / float(b):.2f}x"


# -- main ----------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=REPO / "results" / "peers")
    parser.add_argument("--work", type=Path, default=REPO / "out" / "peers",
                        help="plan, checkpoint, dataset and every cycle's raw reports")
    parser.add_argument("--peer_python", default="/work/peers/vllm-venv/bin/python",
                        help="python of the venv with vllm-cpu (make peers sets it up); '' skips vLLM")
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--engines", default="kvtool,vllm,transformers")
    parser.add_argument("--tokens_per_block", type=int, default=32)
    parser.add_argument("--num_groups", type=int, default=4)
    parser.add_argument("--prompts_per_group", type=int, default=6)
    parser.add_argument("--system_prompt_len", type=int, default=1024)
    parser.add_argument("--question_len", type=int, default=32)
    parser.add_argument("--output_len", type=int, default=16)
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in --work (and their load samples); run only the missing ones")
    parser.add_argument("--report_only", action="store_true", help="only rebuild the results from --work")
    args = parser.parse_args()

    engines = set(args.engines.split(","))
    if not args.peer_python:
        engines.discard("vllm")
    elif "vllm" in engines and not Path(args.peer_python).is_file():
        sys.exit(f"--peer_python {args.peer_python} does not exist: run `make peers` (it creates the vLLM venv), "
                 "or pass --engines kvtool,transformers")
    args.work.mkdir(parents=True, exist_ok=True)
    plan, checkpoint, dataset = prepare(args.work, args)
    sampler = LoadSampler()
    samples_file = args.work / "load.json"
    if (args.report_only or args.resume) and samples_file.is_file():
        sampler.samples = json.loads(samples_file.read_text())
    if not args.report_only:
        variants = [v for v in VARIANTS if v.engine in engines]
        sampler.start()
        try:
            for cycle in range(args.cycles):
                shift = cycle % len(variants)
                for variant in variants[shift:] + variants[:shift]:
                    output = args.work / f"cycle-{cycle}" / slug(variant.name)
                    if args.resume and (output / "summary.csv").is_file():
                        continue
                    sampler.variant = f"{cycle}:{variant.name}"
                    print(f"== cycle {cycle + 1}/{args.cycles}: {variant.name}", flush=True)
                    log = output.parent / f"{slug(variant.name)}.log"
                    output.parent.mkdir(parents=True, exist_ok=True)
                    with log.open("w") as log_file:
                        done = subprocess.run(command(variant, plan, checkpoint, dataset, output, args),
                                              env=environment(variant, args), stdout=log_file,
                                              stderr=subprocess.STDOUT, cwd=REPO)
                    sampler.variant = ""
                    tail = log.read_text().strip().splitlines()[-1:] or [""]
                    if done.returncode != 0:
                        sys.exit(f"{variant.name} failed (exit {done.returncode}); see {log}")
                    print(f"   {tail[0]}", flush=True)
        finally:
            sampler.stop()
            samples_file.write_text(json.dumps(sampler.samples))
    aggregate(args.work, args.output, args.cycles, dataset, sampler, args)
    print((args.output / "table.md").read_text())


if __name__ == "__main__":
    main()
