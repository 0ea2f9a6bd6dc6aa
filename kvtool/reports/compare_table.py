"""Side-by-side comparison of bench reports, and a plot of their TTFT distributions.

The variants come from kvtool.reports.variants (summary CSVs, per-request CSVs, run directories); the
table starts with the configuration fields that differ between them (kvtool.reports.differences),
then every metric, with ratios against the first.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtool.reports.differences import config_fields, differing_fields
from kvtool.reports.metrics import LATENCY_METRICS, percentile_columns
from kvtool.reports.repeats import Spread, spread, verdict
from kvtool.reports.csv_report import format_hit_rate
from kvtool.reports.variants import CompareVariant, load_variants  # noqa: F401 - compare's readers import both here
from kvtool.errors import KvtoolError
from kvtool.units import format_bytes

# (column, display name) in table order.
METRICS: tuple[tuple[str, str], ...] = (
    ("num_requests", "requests"),
    ("num_errors", "errors"),
    *((f"ttft_ms_{s}", f"TTFT {s} (ms)") for s in ("mean", "p50", "p90", "p99")),
    *((f"tpot_ms_{s}", f"TPOT {s} (ms)") for s in ("mean", "p50", "p90", "p99")),
    *((f"itl_ms_{s}", f"ITL {s} (ms)") for s in ("mean", "p50", "p90", "p99")),
    *((f"e2e_ms_{s}", f"E2E {s} (ms)") for s in ("mean", "p50", "p90", "p99")),
    ("total_input_tokens", "input tokens"),
    ("total_output_tokens", "output tokens"),
    ("output_tokens_per_s", "output tokens/s"),
    ("input_tokens_per_s", "input tokens/s"),
    ("total_tokens_per_s", "total tokens/s"),
    ("requests_per_s", "requests/s"),
    ("slo_attainment", "met the SLO"),
    ("goodput_requests_per_s", "goodput (requests/s)"),
    ("slo_met", "percentile objectives met"),
    ("load_imbalance", "load imbalance (max / mean)"),
    ("computed_tokens", "tokens computed"),
    ("total_reused_tokens", "reused tokens"),
    ("reused_blocks", "reused blocks"),
    ("missed_blocks", "missed blocks"),
    ("missed_never_seen_blocks", "missed: never seen"),
    ("missed_evicted_primary_blocks", "missed: evicted from primary"),
    ("missed_evicted_host_blocks", "missed: evicted from host"),
    ("missed_identity_blocks", "missed: other identity"),
    ("missed_partial_blocks", "missed: partly reused"),
    ("missed_last_token_blocks", "missed: last token"),
    ("missed_reuse_off_blocks", "missed: reuse off"),
    ("cache_hit_rate", "cache hit rate"),
    ("token_hit_rate", "token hit rate (reused / prompt)"),
    ("early_reused_blocks", "early reused blocks"),
    ("offloaded_blocks", "offloaded blocks"),
    ("onboarded_blocks", "onboarded blocks"),
    ("evicted_blocks", "evicted blocks"),
    ("offloaded_bytes", "offloaded bytes"),
    ("onboarded_bytes", "onboarded bytes"),
)
# Configuration columns never worth a row (they differ on every run, or the header shows them).
_NOISY_COLUMNS = frozenset({"label", "label_source", "started_at", "requests_csv", "duration_s", "repeat",
                            "num_runs", "dataset_sha256"})  # the header shows the dataset with its sha256


@dataclass(frozen=True)
class CompareRow:
    name: str
    column: str
    values: tuple[float | str | None, ...]
    ratios: tuple[float | None, ...]     # value / first variant's value
    spreads: tuple[Spread | None, ...] = ()  # over the runs of a variant that ran more than once


def _number(text) -> float | str | None:
    if text is None or text == "":
        return None
    if isinstance(text, (int, float)):
        return float(text)
    try:
        return float(text)
    except ValueError:
        return str(text)


def compared_metrics(variants: Sequence[CompareVariant]) -> list[tuple[str, str]]:
    """METRICS, each latency metric with the percentiles the reports hold (p50, p90, p99, and any
    other that bench --percentiles added: ttft_ms_p99.9)."""
    rows = [variant.row for variant in variants]
    columns: list[tuple[str, str]] = []
    for column, name in METRICS:
        metric, _, stat = column.rpartition("_")
        if metric not in LATENCY_METRICS:
            columns.append((column, name))
        elif stat == "mean":
            title = name.partition(" ")[0]
            columns += [(c, f"{title} {s} (ms)") for s, c in percentile_columns(rows, metric)]
    return columns


def compare_rows(variants: Sequence[CompareVariant]) -> list[CompareRow]:
    """The configuration fields whose values differ (kvtool.reports.differences), the metric rows (those
    any variant has), then the other columns whose values differ."""
    rows = []
    differing = differing_fields([v.row for v in variants])
    for config in differing:
        values = tuple(config.value(v.row) for v in variants)
        rows.append(CompareRow(config.name, config.column, values, (None,) * len(values)))
    for column, name in compared_metrics(variants):
        values = tuple(_number(v.row.get(column)) for v in variants)
        if all(value is None for value in values):
            continue
        first = values[0]
        ratios = tuple(value / first if isinstance(value, float) and isinstance(first, float) and first else None
                       for value in values)
        spreads = tuple(spread(v.runs, column) if v.num_runs > 1 else None for v in variants)
        rows.append(CompareRow(name, column, values, ratios, spreads))
    shown = {column for column, _ in METRICS} | {config.column for config in config_fields([v.row for v in variants])}
    other_columns: dict[str, None] = {}
    for variant in variants:
        other_columns.update(dict.fromkeys(variant.row))
    for column in other_columns:
        if column in shown or column in _NOISY_COLUMNS or "_ms_" in column:
            continue
        values = tuple(variant.row.get(column, "") for variant in variants)
        if len({value for value in values if value != ""}) > 1:  # variants without the column do not count
            rows.append(CompareRow(column, column, tuple(v if v != "" else None for v in values),
                                   (None,) * len(values)))
    return rows


# What must match for a comparison to mean what it seems to: the header says what the variants share.
SETUP: tuple[tuple[str, str], ...] = (("model", "model"), ("dataset", "dataset"), ("tokens_per_block", "block size"),
                                      ("kv_primary_tokens", "primary pool"), ("kv_host_bytes", "host pool"),
                                      ("device", "device"))


def _setup_value(row: dict, column: str) -> str | None:
    value = row.get(column)
    if column == "model" and value in (None, "") and row.get("plan_path"):
        value = row["plan_path"]
    if value in (None, ""):
        return None
    if column == "dataset":
        digest = row.get("dataset_sha256") or ""
        return f"{Path(str(value)).name} (sha256 {digest[:12]})" if digest else Path(str(value)).name
    if column == "kv_primary_tokens":
        return f"{int(float(value)):,} tokens"
    if column == "kv_host_bytes":
        return "off" if not float(value) else format_bytes(float(value))
    if column == "tokens_per_block":
        return f"{int(float(value))} tokens"
    return str(value)


def setup_differences(variants: Sequence[CompareVariant]) -> tuple[list[tuple[str, str]], list[tuple[str, list]]]:
    """(what every variant shares: [(name, value)], where they differ: [(name, [value per variant])]):
    every configuration field whose recorded values differ (kvtool.reports.differences.differing_fields:
    flags, build options, model, dataset and its sha256, engine, endpoint, simulation, device, pools);
    a value a report does not record is None."""
    rows = [v.row for v in variants]
    same = []
    for column, name in SETUP:
        values = {_setup_value(row, column) for row in rows}
        if len(values) == 1 and None not in values:
            same.append((name, values.pop()))
    different = [(config.name, [config.value(row) for row in rows]) for config in differing_fields(rows)]
    return same, different


def verdicts(variants: Sequence[CompareVariant], columns: Sequence[tuple[str, str]] = (
        ("ttft_ms_p50", "TTFT p50"), ("ttft_ms_mean", "TTFT mean"))) -> list[str]:
    """For each variant after the first: how its TTFT compares with the first's, and whether the runs
    show it (kvtool.reports.repeats.verdict)."""
    lines = []
    baseline = variants[0]
    for column, name in columns:
        base = spread(baseline.runs or [baseline.row], column)
        if base is None:
            continue
        for variant in variants[1:]:
            figure = spread(variant.runs or [variant.row], column)
            if figure is None:
                continue
            found = verdict(variant.name, figure, baseline.name, base)
            if found is not None:
                lines.append(f"{name}: {found.text}")
    return lines


def format_metric(column: str, value) -> str:
    """A cell of the table: the cache hit rate and shares as the bench table shows them (82.4%), sizes in
    binary units (1.5 GiB), other values by format_value."""
    if column in ("cache_hit_rate", "slo_attainment", "token_hit_rate") and isinstance(value, float):
        return format_hit_rate(value)
    if column.endswith("_bytes") and isinstance(value, float):
        return format_bytes(value)
    return format_value(value)


def format_spread(figure: Spread | None) -> str:
    return "" if figure is None or figure.low == figure.high else f"{figure.low:,.1f}-{figure.high:,.1f}"


def format_value(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return f"{int(value):,}"
        return f"{value:,.3f}" if abs(value) < 1 else f"{value:,.2f}"
    return str(value)


def format_ratio(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.2f}x"


def workload_name(variants: Sequence[CompareVariant]) -> str:
    """What the variants replayed: the scenario's name, else the dataset files' names ('' when unknown)."""
    for column in ("scenario", "dataset"):
        names = list(dict.fromkeys(Path(str(v.row[column])).stem for v in variants if v.row.get(column)))
        if names:
            return " / ".join(names)
    return ""


def plot_ttft(variants: Sequence[CompareVariant], path: str | os.PathLike) -> Path:
    """A PNG with the TTFT distribution of every variant that has per-request data (every run's requests
    pooled): a box plot and a CDF, titled with the workload and the unit."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    with_data = [(v, sorted(r.ttft_ms for r in v.requests if r.ok and r.ttft_ms is not None))
                 for v in variants if v.requests]
    with_data = [(v, values) for v, values in with_data if values]
    if not with_data:
        raise KvtoolError("the TTFT plot needs per-request data: pass per-request CSVs, or keep each summary's "
                          "requests_csv file beside it")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, (box_axes, cdf_axes) = plt.subplots(1, 2, figsize=(13, 5))
    workload = workload_name([v for v, _ in with_data])
    figure.suptitle(f"Time to first token{f' on the {workload} workload' if workload else ''} "
                    "(ms, lower is better)", fontsize=13)
    names = [v.name for v, _ in with_data]
    box_axes.boxplot([values for _, values in with_data], showmeans=True)
    box_axes.set_xticks(range(1, len(names) + 1), names, rotation=20, ha="right")
    box_axes.set_ylabel("TTFT (ms, lower is better)")
    box_axes.set_title("per request (box: quartiles, whiskers: 1.5 IQR, triangle: mean)", fontsize=10)
    box_axes.grid(axis="y", alpha=0.3)
    for variant, values in with_data:
        fractions = [(i + 1) / len(values) for i in range(len(values))]
        runs = f", {variant.num_runs} runs" if variant.num_runs > 1 else ""
        cdf_axes.step(values, fractions, where="post", label=f"{variant.name} (n={len(values)}{runs})")
    low, high = min(v[0] for _, v in with_data), max(v[-1] for _, v in with_data)
    if low > 0 and high / low > 20:  # reuse on vs off spans orders of magnitude
        cdf_axes.set_xscale("log")
        box_axes.set_yscale("log")
    cdf_axes.set_xlabel("TTFT (ms, lower is better)")
    cdf_axes.set_ylabel("fraction of requests with at most this TTFT")
    cdf_axes.set_title("CDF (a curve further left is better)", fontsize=10)
    cdf_axes.grid(alpha=0.3)
    # Beside the axes, never over the curves.
    cdf_axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=9)
    skipped = [v.name for v in variants if v.name not in names]
    if skipped:
        figure.text(0.01, 0.01, f"no per-request data: {', '.join(skipped)}", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path
