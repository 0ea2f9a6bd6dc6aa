"""`kvtool explain`: a report's cache misses in a few sentences, each what-if backed by a simulation.

The summary row's miss split (why each missed full prompt block was missed) says where the misses
come from; for the causes a configuration can change (evictions, reuse switched off), the report's
own configuration is simulated with the change and the predicted hit rate and TTFT are quoted
beside the simulated baseline, so both sides of a comparison come from the same model.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from kvtool.errors import KvtoolError
from kvtool.flags import configs, flags_from_row
from kvtool.reports.csv_report import SUMMARY_FILE
from kvtool.reports.repeats import as_number, median_row
from kvtool.units import format_bytes
from kvtool.workloads.datasets import load_dataset

# (summary column, what the missed blocks of that reason were), in the order they are told.
REASONS = (
    ("missed_never_seen_blocks", "were seen for the first time (no cache can avoid these)"),
    ("missed_evicted_primary_blocks", "had been evicted from the primary pool and dropped, with no host cache "
                                      "to take them"),
    ("missed_evicted_host_blocks", "had been offloaded to the host cache and evicted from it too"),
    ("missed_evicted_disk_blocks", "had been spilled to the disk tier and dropped from it too"),
    ("missed_evicted_remote_blocks", "had been stored in the remote tier and were gone from it"),
    ("missed_fetch_failed_blocks", "were in the third tier, but fetching them failed (the store's failure counters "
                                   "say why)"),
    ("missed_not_staged_blocks", "were in the third tier, but not staged into the host tier before their request "
                                 "was admitted (a staging needs room for them in the host tier)"),
    ("missed_identity_blocks", "had been computed under another cache salt, LoRA task or extra ids"),
    ("missed_partial_blocks", "were reused partly (their first tokens copied from a cached block)"),
    ("missed_last_token_blocks", "were cached but hold the prompt's last token, which is always computed"),
    ("missed_reuse_off_blocks", "were missed because block reuse is off"),
)
NOTABLE_SHARE = 0.10  # a reason below this share of the misses gets no what-if


@dataclass(frozen=True)
class WhatIf:
    """A change to a report's configuration, and what it is called in a sentence."""

    description: str
    overrides: Mapping[str, object]


def _round_up(num_bytes: float) -> int:
    """Up to two significant digits of the binary unit format_bytes shows it in: a size a user would type
    (17.3 MiB -> 18 MiB)."""
    if num_bytes <= 0:
        return 0
    unit = next((size for size in (1 << 40, 1 << 30, 1 << 20, 1 << 10) if num_bytes >= size), 1)
    value = num_bytes / unit
    scale = 10 ** max(0, int(math.floor(math.log10(value))) - 1)
    return int(math.ceil(value / scale) * scale * unit)


def what_ifs(row: Mapping) -> list[WhatIf]:
    """The configuration changes that the row's misses point at."""
    missed = as_number(row.get("missed_blocks")) or 0
    if not missed:
        return []

    def share(column: str) -> float:
        return (as_number(row.get(column)) or 0) / missed

    out = []
    block_bytes = (as_number(row.get("kv_primary_bytes")) or 0) / max(as_number(row.get("kv_primary_blocks")) or 1, 1)
    host_bytes = as_number(row.get("kv_host_bytes")) or 0
    primary_tokens = as_number(row.get("kv_primary_tokens"))
    if share("missed_reuse_off_blocks") >= NOTABLE_SHARE:
        out.append(WhatIf("with block reuse on", {"enable_kv_cache_reuse": True}))
    evicted_primary = as_number(row.get("missed_evicted_primary_blocks")) or 0
    if share("missed_evicted_primary_blocks") >= NOTABLE_SHARE and block_bytes:
        # Room on the host for every block that came back missing.
        size = _round_up(max(evicted_primary * block_bytes, host_bytes * 2))
        out.append(WhatIf(f"with a host cache of {format_bytes(size)}", {"kv_host_cache_bytes": size}))
        if primary_tokens:
            out.append(WhatIf(f"with a primary pool twice as large, {int(2 * primary_tokens):,} tokens",
                              {"max_tokens_in_paged_kv_cache": int(2 * primary_tokens)}))
    evicted_host = as_number(row.get("missed_evicted_host_blocks")) or 0
    if share("missed_evicted_host_blocks") >= NOTABLE_SHARE and host_bytes:
        four_times = _round_up(4 * host_bytes)
        out.append(WhatIf(f"with a host cache 4x as large, {format_bytes(four_times)}",
                          {"kv_host_cache_bytes": four_times}))
        # Room for every block that came back missing (an upper bound: a block may have been missed twice).
        room = _round_up(host_bytes + evicted_host * block_bytes)
        if room > four_times:
            out.append(WhatIf(f"with a host cache of {format_bytes(room)}, room for every block evicted from it",
                              {"kv_host_cache_bytes": room}))
    return out


def simulate_row(row: Mapping, overrides: Mapping[str, object], *, report_dir: Path, profile: str | None) -> dict:
    """The summary row of the report's configuration with ``overrides``, simulated."""
    from kvtool.bench.runner import run_bench
    from kvtool.plan.load import is_built_plan
    from kvtool.simulate.profiles import create_simulated_llm
    from kvtool.simulate.shapes import is_preset

    flags = {**flags_from_row(row), **overrides}
    # The cost model times greedy steps: a sampled run's what-ifs are its greedy twin's (each held to the
    # twin's simulated baseline, as every what-if is to its own).
    for name in ("temperature", "top_p", "top_k"):
        flags.pop(name, None)
    plan = str(row.get("plan_path") or "")
    if is_built_plan(plan):
        flags.pop("tokens_per_block", None)  # a built plan's own (a model simulated from its shapes needs it)
    engine, replay = configs(flags)
    dataset_path = Path(str(row.get("dataset")))
    if not dataset_path.is_file() and (report_dir / dataset_path.name).is_file():
        dataset_path = report_dir / dataset_path.name
    if not dataset_path.is_file():
        raise KvtoolError(f"the dataset {row.get('dataset')} of this report is gone: what-ifs replay it; put it back "
                          f"(or beside the report, as {report_dir / dataset_path.name})")
    if not plan or not (Path(plan).is_dir() or is_preset(plan)):
        raise KvtoolError(f"the plan {plan or '(none: an endpoint run)'} of this report is not here: what-ifs need "
                          "it; rebuild it with `kvtool build` (or explain a report of a kvtool bench run)")
    dataset = load_dataset(dataset_path)
    llm = create_simulated_llm(plan, engine, replay, dataset, profile=profile, dtype=row.get("plan_dtype") or None)
    with tempfile.TemporaryDirectory() as scratch:
        result = run_bench(llm, dataset, replay, label=str(row.get("label")), requests_csv=Path(scratch) / "r.csv",
                           console=Console(quiet=True))
    return result.row


def _span(values: Sequence[float], show: Callable[[float], str]) -> str:
    """One run's figure, or the range of several ('12-15'); one figure when every run agrees."""
    low, high = show(min(values)), show(max(values))
    return low if low == high else f"{low}-{high}"


def _figures(runs: Sequence[Mapping], column: str) -> list[float]:
    return [as_number(run.get(column)) or 0 for run in runs]


def explain_runs(runs: Sequence[Mapping], *, report_dir: Path, profile: str | None) -> list[str]:
    """Sentences for one variant of a report: one run, or the runs of a repeated one (``repeat: N``),
    their figures as ranges; the what-ifs simulated once, on the runs' median figures and the
    configuration they share."""
    row = runs[0] if len(runs) == 1 else median_row(runs)
    label = row.get("label")
    kind = "simulated" if str(row.get("simulated")) == "True" else "measured"
    reused, missed = _figures(runs, "reused_blocks"), _figures(runs, "missed_blocks")
    totals = [r + m for r, m in zip(reused, missed)]
    p50s = [value for value in (as_number(run.get("ttft_ms_p50")) for run in runs) if value is not None]
    p50 = f"{_span(p50s, _ms)} ms" if p50s else "-"
    if len(set(map(_ms, p50s))) > 1:
        p50 += f", median {_ms(as_number(row.get('ttft_ms_p50')))} ms"
    rates = [value for value in (as_number(run.get("cache_hit_rate")) for run in runs) if value is not None]
    count = "requests" if len(runs) == 1 else f"requests each, over {len(runs)} runs"
    sentences = [f"{label}: {_span(_figures(runs, 'num_requests'), _count)} {count}; {_span(reused, _count)} of "
                 f"{_span(totals, _count)} full prompt blocks were reused (hit rate "
                 f"{_span(rates, _rate) if rates else '-'}); TTFT p50 {p50} ({kind})."]
    sentences += _tiers(runs)
    if not any(missed):
        return sentences
    if row.get("missed_never_seen_blocks") in (None, ""):
        sentences.append("This report has no miss split (written by an older kvtool): rerun it to see why blocks "
                         "were missed.")
        return sentences
    sentences += _reasons(runs)
    changes = what_ifs(row)
    if not changes:
        return sentences
    baseline = simulate_row(runs[0], {}, report_dir=report_dir, profile=profile)
    profile_name = baseline.get("cost_profile")
    for change in changes:
        predicted = simulate_row(runs[0], change.overrides, report_dir=report_dir, profile=profile)
        sentences.append(
            f"{change.description[0].upper()}{change.description[1:]} (simulated), the hit rate goes from "
            f"{_rate(baseline.get('cache_hit_rate'))} to {_rate(predicted.get('cache_hit_rate'))} and TTFT p50 from "
            f"{_ms(as_number(baseline.get('ttft_ms_p50')))} to {_ms(as_number(predicted.get('ttft_ms_p50')))} ms.")
    sentences.append(f"(Simulated with the {profile_name} step cost model; its baseline predicts TTFT p50 "
                     f"{_ms(as_number(baseline.get('ttft_ms_p50')))} ms for this configuration.)")
    return sentences


TIERS = (("primary", "the primary pool"), ("host", "the host tier"), ("disk", "the disk tier"),
         ("remote", "the remote tier"))


def _tiers(runs: Sequence[Mapping]) -> list[str]:
    """Where the reused blocks came from, which tiers dropped blocks, and what third-tier stagings cost
    (none for a report without per-tier counts)."""
    if not any(as_number(run.get("primary_hit_blocks")) is not None for run in runs):
        return []

    def by_tier(what: str) -> str:
        parts = [f"{where} ({_span(counts, _count)})" for tier, where in TIERS
                 if any(counts := _figures(runs, f"{tier}_{what}_blocks"))]
        return ", ".join(parts) or "none"

    sentences = []
    if any(_figures(runs, "reused_blocks")):
        sentences.append(f"The reused blocks came from {by_tier('hit')}.")
    if any(any(_figures(runs, f"{tier}_evicted_blocks")) for tier, _ in TIERS):
        sentences.append(f"Blocks dropped from the cache: {by_tier('evicted')}.")
    staged = _figures(runs, "tier3_staged_blocks")
    seconds = _figures(runs, "tier3_staging_s")
    if any(staged) and any(seconds):
        per_block = [1e6 * s / n for s, n in zip(seconds, staged) if n]
        sentences.append(f"Staging {_span(staged, _count)} blocks from the third tier took "
                         f"{_span([1000 * s for s in seconds], _ms)} ms on the step path, lookups included "
                         f"({_span(per_block, lambda v: f'{v:,.0f}')} µs per staged block).")
    return sentences


def _reasons(runs: Sequence[Mapping]) -> list[str]:
    """'67% of missed blocks (386) had been ...' per reason, as ranges over several runs."""
    missed = _figures(runs, "missed_blocks")
    sentences = []
    for column, what in REASONS:
        counts = _figures(runs, column)
        if any(counts):
            shares = [count / total if total else 0.0 for count, total in zip(counts, missed)]
            share = _span([round(100 * s) for s in shares], lambda v: f"{v:.0f}")
            sentences.append(f"{share}% of missed blocks ({_span(counts, _count)}) {what}.")
    return sentences


def explain_requests(variant, *, report_dir: Path) -> list[str]:
    """Sentences for a variant known only by its per-request rows (a run cut short before its summary):
    what they show, marked as such; no what-ifs, which need the configuration only a summary records."""
    row = variant.row
    source = variant.source
    summary = "its summary.csv has no row for it" if (report_dir / SUMMARY_FILE).is_file() else "no summary.csv"
    why = (f"the run was cut short: {summary} (it was killed, or its disk filled, before writing one)"
           if variant.cut_short else f"per-request rows only ({source.name})")
    num_rows = f"{len(variant.requests or []):,}"
    sentences = [f"{row.get('label') or variant.name}: {why}. From the {num_rows} complete rows of {source}: "
                 f"{_count(as_number(row.get('missed_blocks')) or 0)} full prompt blocks "
                 f"were missed, {_count(as_number(row.get('total_reused_tokens')) or 0)} prompt tokens reused; TTFT "
                 f"p50 {_ms(as_number(row.get('ttft_ms_p50')))} ms (measured as far as it ran)."]
    sentences += [f"({note}.)" for note in variant.notes if "is cut short" in note]
    if as_number(row.get("missed_blocks")):
        sentences += _reasons([row])
    sentences.append("What-ifs need the run's configuration, which only its summary records: rerun the bench to see "
                     "them.")
    return sentences


def _count(value: float) -> str:
    return f"{round(value):,}"


def _rate(value) -> str:
    number = as_number(value)
    return "-" if number is None else f"{number:.2f}"


def _ms(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def explain(report: Path, *, profile: str | None = None, label: str | None = None) -> list[list[str]]:
    """A paragraph (list of sentences) per variant of a report: a run or scenario directory, or its
    summary.csv (only ``label``'s variant when given). The runs of a repeated variant make one
    paragraph; a run cut short before its summary is told from its per-request rows."""
    from kvtool.reports.variants import load_variants

    report = Path(report)
    variants = load_variants([report], with_requests=False)
    if label is not None:
        variants = [v for v in variants if v.row.get("label") == label]
        if not variants:
            raise KvtoolError(f"no variant labelled {label!r} in {report}")
    report_dir = report if report.is_dir() else report.parent
    return [explain_runs(v.runs, report_dir=report_dir, profile=profile) if v.runs
            else explain_requests(v, report_dir=report_dir) for v in variants]
