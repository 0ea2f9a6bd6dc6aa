"""`kvtool explain`: a report's cache misses in a few sentences, each what-if backed by a simulation.

The summary row's miss split (why each missed full prompt block was missed) says where the misses
come from; for the causes a configuration can change (evictions, reuse switched off), the report's
own configuration is simulated with the change and the predicted hit rate and TTFT are quoted
beside the simulated baseline, so both sides of a comparison come from the same model.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from kvtool.bench.config import BenchConfig, flags_from_row
from kvtool.bench.datasets import load_dataset
from kvtool.bench.repeats import as_number
from kvtool.bench.report import SUMMARY_FILE, read_csv
from kvtool.errors import KvtoolError

# (summary column, what the missed blocks of that reason were), in the order they are told.
REASONS = (
    ("missed_never_seen_blocks", "were seen for the first time (no cache can avoid these)"),
    ("missed_evicted_primary_blocks", "had been evicted from the primary pool and dropped, with no host cache "
                                      "to take them"),
    ("missed_evicted_host_blocks", "had been offloaded to the host cache and evicted from it too"),
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


def _bytes(num_bytes: float) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.3g} {unit}"
    return f"{num_bytes:,.0f} B"


def _round_up(num_bytes: float) -> int:
    """Up to two significant digits: a size a user would type."""
    if num_bytes <= 0:
        return 0
    scale = 10 ** max(0, int(math.floor(math.log10(num_bytes))) - 1)
    return int(math.ceil(num_bytes / scale) * scale)


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
        out.append(WhatIf(f"with a host cache of {_bytes(size)}", {"kv_host_cache_bytes": size}))
        if primary_tokens:
            out.append(WhatIf(f"with a primary pool twice as large, {int(2 * primary_tokens):,} tokens",
                              {"max_tokens_in_paged_kv_cache": int(2 * primary_tokens)}))
    evicted_host = as_number(row.get("missed_evicted_host_blocks")) or 0
    if share("missed_evicted_host_blocks") >= NOTABLE_SHARE and host_bytes:
        four_times = _round_up(4 * host_bytes)
        out.append(WhatIf(f"with a host cache 4x as large, {_bytes(four_times)}", {"kv_host_cache_bytes": four_times}))
        # Room for every block that came back missing (an upper bound: a block may have been missed twice).
        room = _round_up(host_bytes + evicted_host * block_bytes)
        if room > four_times:
            out.append(WhatIf(f"with a host cache of {_bytes(room)}, room for every block evicted from it",
                              {"kv_host_cache_bytes": room}))
    return out


def simulate_row(row: Mapping, overrides: Mapping[str, object], *, report_dir: Path, profile: str | None) -> dict:
    """The summary row of the report's configuration with ``overrides``, simulated."""
    from kvtool.bench.runner import run_bench
    from kvtool.plan.load import is_built_plan
    from kvtool.simulate.profiles import create_simulated_llm
    from kvtool.simulate.shapes import is_preset

    flags = {**flags_from_row(row), **overrides}
    plan = str(row.get("plan_path") or "")
    if is_built_plan(plan):
        flags.pop("tokens_per_block", None)  # a built plan's own (a model simulated from its shapes needs it)
    config = BenchConfig.from_flags(flags)
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
    llm = create_simulated_llm(plan, config, dataset, profile=profile, dtype=row.get("plan_dtype") or None)
    with tempfile.TemporaryDirectory() as scratch:
        result = run_bench(llm, dataset, config, label=str(row.get("label")), requests_csv=Path(scratch) / "r.csv",
                           console=Console(quiet=True))
    return result.row


def explain_row(row: Mapping, *, report_dir: Path, profile: str | None) -> list[str]:
    """Sentences for one variant of a report."""
    label = row.get("label")
    reused, missed = as_number(row.get("reused_blocks")) or 0, as_number(row.get("missed_blocks")) or 0
    kind = "simulated" if str(row.get("simulated")) == "True" else "measured"
    p50 = as_number(row.get("ttft_ms_p50"))
    sentences = [f"{label}: {int(as_number(row.get('num_requests')) or 0):,} requests; {int(reused):,} of "
                 f"{int(reused + missed):,} full prompt blocks were reused (hit rate {_rate(row.get('cache_hit_rate'))}); "
                 f"TTFT p50 {_ms(p50)} ms ({kind})."]
    if not missed:
        return sentences
    if row.get("missed_never_seen_blocks") in (None, ""):
        sentences.append("This report has no miss split (written by an older kvtool): rerun it to see why blocks "
                         "were missed.")
        return sentences
    for column, what in REASONS:
        count = as_number(row.get(column)) or 0
        if count:
            sentences.append(f"{count / missed:.0%} of missed blocks ({int(count):,}) {what}.")
    changes = what_ifs(row)
    if not changes:
        return sentences
    baseline = simulate_row(row, {}, report_dir=report_dir, profile=profile)
    profile_name = baseline.get("cost_profile")
    for change in changes:
        predicted = simulate_row(row, change.overrides, report_dir=report_dir, profile=profile)
        sentences.append(
            f"{change.description[0].upper()}{change.description[1:]} (simulated), the hit rate goes from "
            f"{_rate(baseline.get('cache_hit_rate'))} to {_rate(predicted.get('cache_hit_rate'))} and TTFT p50 from "
            f"{_ms(as_number(baseline.get('ttft_ms_p50')))} to {_ms(as_number(predicted.get('ttft_ms_p50')))} ms.")
    sentences.append(f"(Simulated with the {profile_name} step cost model; its baseline predicts TTFT p50 "
                     f"{_ms(as_number(baseline.get('ttft_ms_p50')))} ms for this configuration.)")
    return sentences


def _rate(value) -> str:
    number = as_number(value)
    return "-" if number is None else f"{number:.2f}"


def _ms(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def explain(report_dir: Path, *, profile: str | None = None, label: str | None = None) -> list[list[str]]:
    """A paragraph (list of sentences) per variant of the report in ``report_dir`` (or only ``label``'s)."""
    report_dir = Path(report_dir)
    summary = report_dir / SUMMARY_FILE if report_dir.is_dir() else report_dir
    rows = read_csv(summary)
    if label is not None:
        rows = [r for r in rows if r.get("label") == label]
        if not rows:
            raise KvtoolError(f"no variant labelled {label!r} in {summary}")
    return [explain_row(row, report_dir=summary.parent, profile=profile) for row in rows]
