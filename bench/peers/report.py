"""bench/peers/run.py's results: the CSVs, the floors, `kvtool compare`'s table and plot, and
table.md: the machine and its load, TTFT (hits, misses), decode (TPOT, ITL), throughput
(sequential, 8 in flight, Poisson arrivals), bfloat16, the targets against vLLM and the floors,
and whether every engine generated the same token ids.

Each figure of a variant is the median over cycles of that cycle's figure (TTFT p50, TPOT p50 ...);
hits and misses pool the requests of every cycle.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from common import load_requests, read_outputs
from load import OTHER_CPU_LIMIT_PCT, is_loaded, other_cpu_pct

from kvtool.reports.metrics import summarize
from kvtool.reports.csv_report import RequestCsvWriter, read_csv, request_metrics_from_row, write_summary_csv

FIGURES = ("ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "tpot_ms_p90", "itl_ms_p50", "output_tokens_per_s",
           "requests_per_s")
TPOT_FLOOR_RATIO, MISS_FLOOR_RATIO = 1.3, 1.5
RATE_SPLIT_MIN = 1.3  # reads whose 90th percentile is this times their 10th or more: the memory held two rates
MIN_REQUESTS_AT_RATE = 3  # a rate's memory-floor target is checked on at least this many requests


def write_results(work: Path, out: Path, variants, datasets: dict[str, Path], samples: list[dict], cpu, args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows, cycle_rows, requests, outputs, around_by_row = [], [], {}, {}, []
    floors = {when: json.loads((work / f"floors-{when}.json").read_text())
              for when in ("start", "end") if (work / f"floors-{when}.json").is_file()}
    for variant in variants:
        runs = [run for run in (work / f"cycle-{c}" / variant.slug for c in range(args.cycles))
                if (run / "summary.csv").is_file()]
        if not runs:
            continue
        pooled, figures = [], {name: [] for name in FIGURES + ("read_bandwidth_gb_s", "tpot_vs_floor_around_requests")}
        around = []  # the variant's requests with the rates read around them, every cycle's (sequential replays)
        for cycle, run in enumerate(runs):
            summary = read_csv(run / "summary.csv")[0]
            pooled += [request_metrics_from_row(r) for r in read_csv(run / "requests.csv")]
            load = [s for s in samples if s["variant"] == f"{cycle}:{variant.name}"]
            for name in FIGURES:
                figures[name].append(_float(summary.get(name)))
            figures["read_bandwidth_gb_s"].append(_own_bandwidth(run))
            reads = _reads_around_requests(run)
            around += reads
            figures["tpot_vs_floor_around_requests"].append(_median(_ratios_to_floor(reads, floors, variant.dtype)))
            cycle_rows.append({"variant": variant.name, "cycle": cycle, **{n: figures[n][-1] for n in figures},
                               "cpu_other_pct_mean": other_cpu_pct(load)})
        with RequestCsvWriter(out / f"requests-{variant.slug}.csv") as writer:
            for row in pooled:
                writer.write(row)
        last = read_csv(runs[-1] / "summary.csv")[0]
        config = {k: v for k, v in last.items() if not k.startswith(("ttft_", "tpot_", "itl_", "e2e_"))}
        medians = {f"{name}_median_of_cycles": _median(values) for name, values in figures.items()}
        medians["read_bandwidth_gb_s_by_cycle"] = " / ".join(
            f"{b:.0f}" for b in figures["read_bandwidth_gb_s"] if b is not None) or None
        rows.append({**config, "label": variant.name, "dtype_variant": variant.dtype, "load": variant.load,
                     "cycles": len(runs), **medians, **summarize(pooled).as_row(),
                     "requests_csv": f"requests-{variant.slug}.csv"})
        around_by_row.append((rows[-1], variant.dtype, around))
        requests[variant.name] = pooled
        outputs[variant.name] = [read_outputs(run / "outputs.jsonl") for run in runs]
    # Each request against the floor at the rate read around it, the requests of each memory rate apart.
    split = _rate_split([read for _, _, around in around_by_row for read in around])
    for row, dtype, around in around_by_row:
        row["rate_split_gb_s"] = split
        for rate, figure in tpot_vs_floor_by_rate(around, floors, dtype, split).items():
            row.update({f"{name}_{rate}_rate": value for name, value in figure._asdict().items()})
    (out / "floors.json").write_text(json.dumps(floors, indent=1) + "\n")
    write_summary_csv(out / "summary.csv", rows)
    write_summary_csv(out / "cycles.csv", cycle_rows)
    write_summary_csv(out / "load.csv", samples or [{"at": None}])
    for dataset in datasets.values():
        shutil.copyfile(dataset, out / dataset.name)
    kvtool = str(Path(sys.executable).parent / "kvtool")
    compare = subprocess.run([kvtool, "compare", str(out / "summary.csv"), "--plot", str(out / "ttft.png"),
                              "--output", str(out / "compare.csv")], capture_output=True, text=True,
                             env=dict(os.environ, COLUMNS="200"))
    (out / "compare.txt").write_text(compare.stdout + compare.stderr)
    (out / "table.md").write_text(table(rows, requests, outputs, samples, floors, cpu, datasets["fixed"], args))


def table(rows, requests, outputs, samples, floors, cpu, dataset: Path, args) -> str:
    by_name = {row["label"]: row for row in rows}
    measured = load_requests(dataset)[1:]
    loaded = [name for name in by_name if is_loaded(_samples_of(samples, name))]
    isa = getattr(args, "isa", None)
    lines = [f"# kvtool vs vLLM vs transformers on SmolLM2-135M-Instruct (CPU): {cpu.model}, {cpu.isa}"
             f"{f' run as {isa}' if isa else ''}", ""]
    if isa:
        lines += [f"**Run as {isa}** (bench/peers/run.py --isa {isa}): kvtool's CPU kernels in {isa}, and torch's "
                  f"and oneDNN's code limited to it for every engine and the floors (ATEN_CPU_CAPABILITY="
                  f"{os.environ.get('ATEN_CPU_CAPABILITY')}, "
                  f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA')}). "
                  "vLLM loads the build of its compiled kernels that such a CPU gets (torch.cpu's feature queries "
                  "answer as that CPU would, bench/peers/peer_isa.py; the build it loaded is named below); the "
                  "memory, caches and clock are this machine's. A stand-in for a CPU with only that set, not a "
                  "measurement of one.", ""]
    if loaded:
        lines += [f"**LOADED RUN**: other processes used more than {OTHER_CPU_LIMIT_PCT:.0f}% of the CPU while "
                  f"{len(loaded)} variant(s) ran ({', '.join(loaded)}): their timings are not the machine's.", ""]
    lines += [f"Machine: {cpu.describe()}; flags {cpu.as_row()['cpu_flags']}.", "", _kernels(by_name), "",
              f"Workload: {dataset.name}: {len(measured)} measured requests ({args.num_groups} groups x "
              f"{args.prompts_per_group}), prompts {min(len(r.input_ids) for r in measured)}-"
              f"{max(len(r.input_ids) for r in measured)} tokens (a ~{args.system_prompt_len}-token passage as system "
              f"prompt + a ~{args.question_len}-token question, chat template), {args.output_len} output tokens "
              "(greedy; every engine ignores EOS: a sampled EOS is kept and generation goes on), one uncounted "
              f"warm-up, {args.tokens_per_block}-token blocks. Loads: sequential; 8 requests in flight; Poisson "
              f"arrivals at {args.request_rate:g} requests/s (the same schedule for every engine). Each figure: the "
              f"median over {args.cycles} cycles of that cycle's figure (variants alternate, order rotating).", ""]
    lines += _ttft(by_name, requests) + _decode(by_name) + _throughput(by_name) + _targets(by_name, requests, floors)
    lines += ["## Greedy token ids across engines", ""] + identity(outputs, len(measured), args.output_len) + [""]
    lines += _counters(rows) + _load(rows, samples)
    return "\n".join(lines) + "\n"


def _kernels(by_name) -> str:
    parts = []
    kvtool = next((r for r in by_name.values() if r.get("engine") == "kvtool"), None)
    if kvtool:
        # cpu_kernels: the set in use (kvtool bench's column); older runs wrote it as cpu_kernels_isa.
        isa = kvtool.get("cpu_kernels") or kvtool.get("cpu_kernels_isa")
        onednn = kvtool.get("onednn_max_cpu_isa")
        parts.append(f"kvtool: its CPU kernels in {isa if isa and isa != 'off' else 'none (torch path)'}, "
                     f"projections in torch's oneDNN (torch CPU capability {kvtool.get('torch_cpu_capability')}"
                     f"{f', ONEDNN_MAX_CPU_ISA={onednn}' if onednn else ''})"
                     f"{', a bfloat16 prompt on its AMX tile products' if isa == 'amx' else ''}")
    vllm = next((r for r in by_name.values() if r.get("engine") == "vllm"), None)
    if vllm:
        parts.append(f"vLLM {vllm.get('engine_version')}: kernels {vllm.get('vllm_kernels')}, attention "
                     f"'{vllm.get('vllm_attention_isa')}', torch CPU capability {vllm.get('torch_cpu_capability')}")
    return "ISA in use: " + "; ".join(parts) + "." if parts else ""


def _ttft(by_name, requests) -> list[str]:
    lines = ["## TTFT (sequential, float32 and bfloat16)", "",
             "Hits: a group's later requests with reuse on (their passage is cached); misses: reuse off (every "
             "request), and each group's first request with reuse on.", "",
             "| engine | dtype | hits p50 (ms) | misses, reuse off p50 (ms) | misses, reuse on (ms) | hits vs vLLM | "
             "misses vs vLLM |", "|---|---|---:|---:|---:|---:|---:|"]
    for dtype, tag in (("float32", ""), ("bfloat16", " bf16")):
        vllm_hits = _hits(requests.get(f"vllm{tag} reuse-on"), hits=True)
        vllm_misses = _figure(by_name, f"vllm{tag} reuse-off", "ttft_ms_p50")
        for engine in ("kvtool", "vllm", "transformers"):
            on, off = (f"{engine}{tag} reuse-on", f"{engine}{tag} reuse-off") if engine != "transformers" else \
                ("transformers copied-prefix", "transformers no-cache")
            if (on not in by_name and off not in by_name) or (engine == "transformers" and tag):
                continue
            hits, misses = _hits(requests.get(on), hits=True), _figure(by_name, off, "ttft_ms_p50")
            lines.append(f"| {engine} | {dtype} | {_fmt(hits)} | {_fmt(misses)} | "
                         f"{_fmt(_hits(requests.get(on), hits=False))} | {_ratio(hits, vllm_hits)} | "
                         f"{_ratio(misses, vllm_misses)} |")
    return lines + [""]


def _decode(by_name) -> list[str]:
    lines = ["## Decode at batch 1 (sequential)", "",
             "Read GB/s: each cycle's replay read in its own process just before and after it, the better of the "
             "two (kvtool's replays; see Targets for the rates read around each request).",
             "", "| variant | TPOT p50 (ms) | TPOT p90 (ms) | ITL p50 (ms) | TPOT vs vLLM | read GB/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, row in by_name.items():
        if row["load"] != "sequential":
            continue
        tpot = _figure(by_name, name, "tpot_ms_p50")
        lines.append(f"| {name} | {_fmt(tpot, 1)} | {_fmt(_figure(by_name, name, 'tpot_ms_p90'), 1)} | "
                     f"{_fmt(_figure(by_name, name, 'itl_ms_p50'), 1)} | "
                     f"{_ratio(tpot, _figure(by_name, _vllm_twin(name), 'tpot_ms_p50'))} | "
                     f"{row.get('read_bandwidth_gb_s_by_cycle') or '-'} |")
    return lines + [""]


def _throughput(by_name) -> list[str]:
    lines = ["## Throughput by load (reuse on)", "",
             "| variant | load | output tokens/s | requests/s | TTFT p50 (ms) | TTFT p90 (ms) | TPOT p50 (ms) | "
             "tokens/s vs vLLM | read GB/s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in by_name.items():
        if not name.startswith(("kvtool", "vllm")) or "reuse-on" not in name or "no-partial" in name:
            continue
        figure = {f: _figure(by_name, name, f) for f in FIGURES}
        tokens = figure["output_tokens_per_s"]
        lines.append(f"| {name} | {row['load']} | {_fmt(tokens, 1)} | {_fmt(figure['requests_per_s'], 3)} | "
                     f"{_fmt(figure['ttft_ms_p50'])} | {_fmt(figure['ttft_ms_p90'])} | "
                     f"{_fmt(figure['tpot_ms_p50'], 1)} | "
                     f"{_ratio(tokens, _figure(by_name, _vllm_twin(name), 'output_tokens_per_s'))} | "
                     f"{row.get('read_bandwidth_gb_s_by_cycle') or '-'} |")
    return lines + [""]


def _targets(by_name, requests, floors) -> list[str]:
    lines = ["## Targets (issue 24)", "", "| target | kvtool | reference | ratio | met |", "|---|---:|---:|---:|---|"]
    unchecked = []  # a memory rate too few requests ran at

    def check(label: str, ours, reference, limit: float, higher_is_better: bool = False) -> None:
        if ours is None or reference is None:
            return
        ratio = ours / reference
        met = ratio >= limit if higher_is_better else ratio <= limit
        lines.append(f"| {label} | {_fmt(ours, 1)} | {_fmt(reference, 1)} | {ratio:.2f}x | {'yes' if met else 'NO'} |")

    for dtype, tag in (("float32", ""), ("bfloat16", " bf16")):
        kvtool, vllm = f"kvtool{tag} reuse", f"vllm{tag} reuse"
        tpot, miss = _figure(by_name, f"{kvtool}-on", "tpot_ms_p50"), _figure(by_name, f"{kvtool}-off", "ttft_ms_p50")
        check(f"TTFT hit p50 <= vLLM's ({dtype}, ms)", _hits(requests.get(f"{kvtool}-on"), hits=True),
              _hits(requests.get(f"{vllm}-on"), hits=True), 1.0)
        check(f"TTFT miss p50 <= vLLM's ({dtype}, reuse off, ms)", miss,
              _figure(by_name, f"{vllm}-off", "ttft_ms_p50"), 1.0)
        check(f"TPOT p50 <= vLLM's ({dtype}, batch 1, ms)", tpot, _figure(by_name, f"{vllm}-on", "tpot_ms_p50"), 1.0)
        check(f"output tokens/s at concurrency 8 >= vLLM's ({dtype})",
              _figure(by_name, f"{kvtool}-on c8", "output_tokens_per_s"),
              _figure(by_name, f"{vllm}-on c8", "output_tokens_per_s"), 1.0, higher_is_better=True)
        best = _best_floors(floors, dtype)
        own = by_name.get(f"{kvtool}-on", {})
        split = own.get("rate_split_gb_s")
        for rate, which in (("all", ""), ("faster", "read at or above"), ("slower", "read below")):
            ratio, count = own.get(f"tpot_vs_floor_{rate}_rate"), own.get(f"num_requests_{rate}_rate")
            if count is None:
                continue
            if ratio is None or count < MIN_REQUESTS_AT_RATE:
                at = f"{which} {split:.0f} GB/s throughout" if which else "with the rate read around them"
                unchecked.append(f"- {dtype}: {count} request(s) {at}")
                continue
            requests_at = f"; the {count} requests {which} {split:.0f} GB/s" if which else ""
            rate_tpot = own[f"tpot_ms_p50_{rate}_rate"]
            check(f"TPOT p50 <= {TPOT_FLOOR_RATIO}x memory floor at the rate read around each request ({dtype}, "
                  f"ms{requests_at})", rate_tpot, rate_tpot / ratio, TPOT_FLOOR_RATIO)
        if best:
            check(f"TPOT p50 <= {TPOT_FLOOR_RATIO}x memory floor of the separate probes ({dtype}, ms)", tpot,
                  best.get("memory_floor_ms"), TPOT_FLOOR_RATIO)
            check(f"TTFT miss p50 <= {MISS_FLOOR_RATIO}x compute floor ({dtype}, ms)", miss,
                  best.get("compute_floor_ms"), MISS_FLOOR_RATIO)
    if unchecked:
        lines += ["", f"The memory floor at the rate read around each request, not checked where fewer than "
                  f"{MIN_REQUESTS_AT_RATE} requests ran at one rate throughout (kvtool reuse-on):", ""] + unchecked
    lines += ["", "Floors, measured before the first variant and after the last (bench/peers/floors.py):", ""]
    for when, probe in floors.items():
        parts = [f"read bandwidth {probe['read_bandwidth_gb_s']:.1f} GB/s ({probe['threads']} threads)"]
        cores = probe.get("core_gemm_gflop_s")  # absent from runs before it was probed
        if cores:
            parts.append("each core's own GEMM rate (one thread pinned to it) " +
                         ", ".join(f"{cpu} {rate:,.0f}" for cpu, rate in cores.items()) + " GFLOP/s")
        for dtype, model in probe["models"].items():
            tiles = model.get("tile_gemm_gflop_s")  # absent from runs before it was probed
            rates = f" (oneDNN {_fmt(model.get('onednn_gemm_gflop_s'))}, kvtool's tiles {_fmt(tiles)})" if tiles else ""
            parts.append(f"{dtype}: GEMM {_fmt(model.get('gemm_gflop_s'))} GFLOP/s{rates}, a decode step reads "
                         f"{model['decode_bytes'] / 1e6:,.0f} MB (context {probe['context_len']}): memory floor "
                         f"{model['memory_floor_ms']:.1f} ms; a miss of {probe['prompt_len']} tokens is "
                         f"{model['miss_flops'] / 1e9:,.0f} GFLOP: compute floor "
                         f"{_fmt(model.get('compute_floor_ms'))} ms")
        lines.append(f"- {when}: " + "; ".join(parts))
    return lines + ["", "The separate probes' targets use the lower (better) floor of the two. A process's read "
                    "bandwidth on this kind of VM flips between two rates (~33 and ~60 GB/s on the latest), each held "
                    "for seconds to minutes: the probes at the start and the end of a run say little of the rate while "
                    "a replay ran, nor do reads just before and after a whole replay. So a sequential kvtool replay "
                    "reads 64 MB after each request, before the next one starts (two buffers, each read once: a buffer "
                    "read twice in a row is partly still cached), and each request's TPOT is held to "
                    "the memory floor at the better of the rates read just before and after it. Where the run's reads "
                    "fall in two rates (their 90th percentile 1.3x their 10th or more), the requests that ran at each "
                    "rate are checked apart (a request with a read on each side of the split is in neither): a median "
                    "over both would hide the faster rate, where a step's fixed costs weigh most. Kvtool column: those "
                    "requests' TPOT p50; ratio: the median of their TPOT / floor; reference: the one over the other.",
                    ""]


def identity(outputs_by_variant, num_requests: int, output_len: int) -> list[str]:
    """Each variant's greedy ids against the float32 reference (transformers without a cache, else the
    first variant); bfloat16 variants against kvtool's bfloat16 (rounding differs across engines)."""
    names = list(outputs_by_variant)
    float_ref = "transformers no-cache" if "transformers no-cache" in names else names[0]
    bf16_ref = next((n for n in names if " bf16 " in f" {n} " and n.startswith("kvtool")), None)
    lines = []
    for name, runs in outputs_by_variant.items():
        ref_name = bf16_ref if " bf16" in name and bf16_ref else float_ref
        reference = outputs_by_variant[ref_name][0]
        for cycle, run in enumerate(runs):
            if (name, cycle) == (ref_name, 0):
                continue
            first_diffs = sorted(_first_difference(run.get(rid, []), ids) for rid, ids in reference.items()
                                 if run.get(rid) != ids)
            verdict = "identical" if not first_diffs else \
                f"{len(first_diffs)} of {len(reference)} differ (first differing token at {first_diffs[:6]})"
            lines.append(f"- {name} cycle {cycle} vs {ref_name}: {verdict}")
    total = sum(len(r) for r in outputs_by_variant.values())
    return [f"{num_requests} requests x {output_len} tokens, {total} runs:", ""] + lines + \
        _bf16_against_float32(outputs_by_variant, float_ref)


def _bf16_against_float32(outputs_by_variant, float_ref: str) -> list[str]:
    """How far each bfloat16 variant's greedy ids follow the float32 reference: bfloat16 paths round in
    their own orders, so ids part somewhere; an engine whose ids part much sooner than its peer's rounds worse."""
    if " bf16" in float_ref:  # a run of bfloat16 variants alone
        return []
    reference = outputs_by_variant[float_ref][0]
    lines = []
    for name, runs in outputs_by_variant.items():
        if " bf16" not in name:
            continue
        agreed = [_first_difference(runs[0].get(rid, []), ids) for rid, ids in reference.items()]
        same = sum(runs[0].get(rid) == ids for rid, ids in reference.items())
        lines.append(f"- {name} cycle 0: {same} of {len(reference)} identical; the same ids for the first "
                     f"{statistics.median(agreed):g} tokens (median; mean {statistics.fmean(agreed):.1f})")
    if not lines:
        return []
    return ["", f"Bfloat16 runs against {float_ref} (float32): how long each follows float32's greedy ids", ""] + lines


def _first_difference(ours: list[int], reference: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))


def _counters(rows) -> list[str]:
    lines = ["## Cache counters (over one cycle's measured requests)", ""]
    for row in rows:
        cycles = int(row["cycles"])
        detail = (f"{int(row['total_reused_tokens']) // cycles:,} of {int(row['total_input_tokens']) // cycles:,} "
                  "prompt tokens reused")
        if row.get("reused_blocks") not in (None, ""):
            detail += f"; blocks reused / missed {row['reused_blocks']} / {row['missed_blocks']}"
        if row.get("prefix_cache_hits_tokens") not in (None, ""):
            detail += (f"; vLLM prefix cache hits / queries {float(row['prefix_cache_hits_tokens']):,.0f} / "
                       f"{float(row['prefix_cache_queries_tokens']):,.0f} tokens")
        lines.append(f"- {row['label']}: {detail}")
    return lines + [""]


def _load(rows, samples) -> list[str]:
    lines = ["## Load while each variant ran", "",
             f"CPU share of processes other than the benchmark (mean and max of samples every 2 s; flagged above "
             f"{OTHER_CPU_LIMIT_PCT:.0f}%) and the 1-minute load average:", ""]
    for name in [row["label"] for row in rows] + ["floors (start)", "floors (end)"]:
        found = _samples_of(samples, name)
        if found:
            flag = " **LOADED**" if is_loaded(found) else ""
            lines.append(f"- {name}: other processes {other_cpu_pct(found)}% CPU (max "
                         f"{max(s['cpu_other_pct'] for s in found)}%), load average "
                         f"{statistics.mean(s['loadavg_1m'] for s in found):.1f}{flag}")
    return lines


def _samples_of(samples, name: str) -> list[dict]:
    return [s for s in samples if s["variant"].split(":", 1)[-1] == name]


def _vllm_twin(name: str) -> str | None:
    """vLLM's variant with the same cache, dtype and load as kvtool's ``name`` (None for others)."""
    return "vllm " + name.split(" ", 1)[1] if name.startswith("kvtool ") else None


def _hits(rows, *, hits: bool) -> float | None:
    if not rows:
        return None
    values = [r.ttft_ms for r in rows if r.ttft_ms is not None and r.request_id.endswith("q0") != hits]
    return statistics.median(values) if values else None


def _best_floors(floors: dict, dtype: str) -> dict:
    models = [probe["models"][dtype] for probe in floors.values() if dtype in probe["models"]]
    if not models:
        return {}
    return {key: min((m[key] for m in models if m.get(key) is not None), default=None)
            for key in ("memory_floor_ms", "compute_floor_ms")}


def _own_bandwidth(run: Path) -> float | None:
    """GB/s a kvtool replay's own process read at, the better of before and after (kvtool_replay.py)."""
    path = run / "bandwidth.json"
    if not path.is_file():
        return None
    measured = json.loads(path.read_text())
    return max(measured["before_gb_s"], measured["after_gb_s"])


class AroundRequest(NamedTuple):
    """A request of a sequential kvtool replay: the rates (GB/s) read just before and just after it, its TPOT."""

    before_gb_s: float
    after_gb_s: float
    tpot_ms: float | None


class FloorAtRate(NamedTuple):
    """The requests that ran at one memory rate: how many, their TPOT p50, and the median of each one's TPOT /
    the memory floor at the better of the rates read around it."""

    num_requests: int
    tpot_ms_p50: float | None
    tpot_vs_floor: float | None


def _reads_around_requests(run: Path) -> list[AroundRequest]:
    """A sequential kvtool replay's requests, in the order of requests.csv, with the rates read around each
    (bandwidth.json's after_each_request_gb_s, the first request's before being the replay's before_gb_s);
    [] for a replay that read none (concurrent loads, peers)."""
    path = run / "bandwidth.json"
    measured = json.loads(path.read_text()) if path.is_file() else {}
    after_each = measured.get("after_each_request_gb_s")
    if not after_each:
        return []
    rows = read_csv(run / "requests.csv")
    if len(rows) != len(after_each):
        raise ValueError(f"{run}: {len(rows)} requests but {len(after_each)} reads after them")
    befores = [measured["before_gb_s"]] + after_each[:-1]
    return [AroundRequest(before, after, _float(row.get("tpot_ms")))
            for before, after, row in zip(befores, after_each, rows)]


def _ratios_to_floor(reads: list[AroundRequest], floors: dict, dtype: str) -> list[float]:
    """Each request's TPOT / the memory floor at the better of the rates read just before and after it."""
    ratios = []
    for read in reads:
        floor = _memory_floor_ms(floors, dtype, max(read.before_gb_s, read.after_gb_s))
        if read.tpot_ms and floor:
            ratios.append(read.tpot_ms / floor)
    return ratios


def _rate_split(reads: list[AroundRequest]) -> float | None:
    """The rate (GB/s) between the two the memory read at during the run, or None where it held one: the
    geometric mean of the 10th and 90th percentiles of every read, where those differ by RATE_SPLIT_MIN or more."""
    rates = sorted(rate for read in reads for rate in (read.before_gb_s, read.after_gb_s))
    if not rates:
        return None
    low, high = rates[len(rates) // 10], rates[-1 - len(rates) // 10]
    return math.sqrt(low * high) if high >= RATE_SPLIT_MIN * low else None


def tpot_vs_floor_by_rate(reads: list[AroundRequest], floors: dict, dtype: str,
                          split: float | None) -> dict[str, FloorAtRate]:
    """The requests against their memory floors, by the rate they ran at: 'all' where the run held one rate
    (split None); else 'faster' (both reads around the request at or above split) and 'slower' (both below).
    A request with a read on each side of the split (the rate flipped while it ran) is in neither: the
    floor at either rate would misjudge it."""
    if split is None:
        groups = {"all": reads}
    else:
        groups = {"faster": [r for r in reads if min(r.before_gb_s, r.after_gb_s) >= split],
                  "slower": [r for r in reads if max(r.before_gb_s, r.after_gb_s) < split]}
    return {rate: FloorAtRate(len(group), _median([r.tpot_ms for r in group]),
                              _median(_ratios_to_floor(group, floors, dtype)))
            for rate, group in groups.items()}


def _memory_floor_ms(floors: dict, dtype: str, bandwidth_gb_s: float) -> float | None:
    """A decode step's bytes (as the probes counted them) at ``bandwidth_gb_s``."""
    step_bytes = next((probe["models"][dtype]["decode_bytes"] for probe in floors.values()
                       if dtype in probe["models"]), None)
    return None if step_bytes is None else step_bytes / bandwidth_gb_s / 1e6


def _figure(by_name, name: str | None, figure: str) -> float | None:
    return by_name.get(name, {}).get(f"{figure}_median_of_cycles") if name else None


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _float(value) -> float | None:
    return None if value in (None, "") else float(value)


def _fmt(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"
