"""The end-of-run table of `kvtool bench` and `simulate`: one column per variant (label), repeated runs
as their medians."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from rich.table import Table

from kvtool.reports.csv_report import format_hit_rate
from kvtool.reports.metrics import LATENCY_METRICS, percentile_columns
from kvtool.reports.repeats import as_number, group_by_label, median_row
from kvtool.reports.slo import describe_bounds
from kvtool.units import format_bytes


def _ms(value) -> str:
    return "-" if value is None else f"{value:,.2f}"


def _count(value) -> str:
    number = as_number(value)
    return "-" if number is None else f"{round(number):,}"


def summary_table(rows: list[Mapping], *, title: str = "kvtool bench summary") -> Table:
    """The end-of-run table: one column per variant (label); repeated runs show their medians."""
    rows = [group[0] if len(group) == 1 else median_row(group) for group in group_by_label(rows)]
    table = Table(title=title, show_lines=False)
    table.add_column("metric")
    for row in rows:
        title = str(row.get("label", ""))
        if row.get("num_runs"):
            title += f" (median of {row['num_runs']} runs)"
        if row.get("interrupted"):
            title += " (interrupted)"
        table.add_column(title, justify="right")
    lines: list[tuple[str, Callable[[Mapping], str]]] = [
        ("requests (errors)", lambda r: f"{_count(r.get('num_requests'))} ({_count(r.get('num_errors'))})"),
    ]
    for metric, name in zip(LATENCY_METRICS, ("TTFT", "TPOT", "ITL", "E2E latency")):
        for stat, column in percentile_columns(rows, metric):  # p95, p99.9 too where --percentiles asked
            lines.append((f"{name} {stat} (ms)", lambda r, k=column: _ms(r.get(k))))
    lines += [
        ("output tokens/s", lambda r: _ms(r.get("output_tokens_per_s"))),
        ("input tokens/s", lambda r: _ms(r.get("input_tokens_per_s"))),
        ("total tokens/s", lambda r: _ms(r.get("total_tokens_per_s"))),
        ("requests/s", lambda r: _ms(r.get("requests_per_s"))),
        *_goodput_lines(rows),
        ("reused / missed blocks", lambda r: f"{_count(r.get('reused_blocks'))} / {_count(r.get('missed_blocks'))}"),
        ("missed blocks by reason", _miss_reasons),
        ("cache hit rate", lambda r: format_hit_rate(r.get("cache_hit_rate"))),
        ("token hit rate (reused / prompt)", lambda r: format_hit_rate(r.get("token_hit_rate"))),
        *_fleet_lines(rows),
        ("offloaded / onboarded blocks",
         lambda r: f"{_count(r.get('offloaded_blocks'))} / {_count(r.get('onboarded_blocks'))}"),
        ("bytes offloaded / onboarded", lambda r: f"{format_bytes(as_number(r.get('offloaded_bytes')))} / {format_bytes(as_number(r.get('onboarded_bytes')))}"),
        *_tier_lines(rows),
    ]
    for name, cell in lines:
        table.add_row(name, *(cell(row) for row in rows))
    return table


def _goodput_lines(rows: list[Mapping]) -> list[tuple[str, Callable[[Mapping], str]]]:
    """With --slo: the share of requests that met the objectives, and goodput (requests/s)."""
    if not any(as_number(row.get("slo_attainment")) is not None for row in rows):
        return []
    objectives = describe_bounds(rows[0])
    lines = [(f"met the SLO ({objectives})", lambda r: format_hit_rate(as_number(r.get("slo_attainment")))),
             ("goodput (requests/s)", lambda r: _ms(r.get("goodput_requests_per_s")))]
    if any(row.get("slo_met") not in (None, "") for row in rows):  # percentile objectives (--slo ttft_p90=2s)
        lines.append(("percentile objectives met", lambda r: {"True": "yes", "False": "no"}.get(
            str(r.get("slo_met")), "-")))
    return lines


def _fleet_lines(rows: list[Mapping]) -> list[tuple[str, Callable[[Mapping], str]]]:
    """A fleet's (kvtool.fleet.fleet_rows): the tokens each replica computed, and the fleet's imbalance."""
    if not any(row.get("num_replicas") not in (None, "") for row in rows):
        return []
    return [("tokens computed", lambda r: _count(r.get("computed_tokens"))),
            ("load imbalance (max / mean)", lambda r: "-" if as_number(r.get("load_imbalance")) is None
             else f"{as_number(r.get('load_imbalance')):.2f}")]


_MISS_NAMES = {"never_seen": "new", "evicted_primary": "evicted from primary", "evicted_host": "evicted from host",
               "identity": "other identity", "partial": "partial", "last_token": "last token",
               "reuse_off": "reuse off"}
# The third tier's reasons (MissReasons.to_dict(tier3=True)), in rows of an engine that has one.
_TIER3_MISS_NAMES = {"evicted_disk": "evicted from disk", "evicted_remote": "evicted from remote",
                     "fetch_failed": "fetch failed", "not_staged": "not staged"}
TIER_NAMES = ("primary", "host", "disk", "remote")


def _tier_lines(rows: list[Mapping]) -> list[tuple[str, Callable[[Mapping], str]]]:
    """Where the reused blocks came from and which tier dropped blocks; with a third tier (disk or
    remote), its traffic and what a staging cost on the step path. None for rows without them."""
    if not any(as_number(row.get("primary_hit_blocks")) is not None for row in rows):
        return []
    lines = [("reused blocks by tier", lambda r: _by_tier(r, "hit")),
             ("evicted blocks by tier", lambda r: _by_tier(r, "evicted"))]
    if any(as_number(row.get("tier3_staged_blocks")) is not None for row in rows):
        lines += [("third tier: spilled / staged blocks",
                   lambda r: f"{_count(r.get('tier3_spilled_blocks'))} / {_count(r.get('tier3_staged_blocks'))}"),
                  ("third tier: staging time, lookups included (per staged block)", _staging_cost),
                  ("third tier: failed fetches / writes / lookups", lambda r: " / ".join(
                      _count(r.get(f"tier3_{name}")) for name in ("fetch_failed_blocks", "write_failures",
                                                                   "lookup_failures")))]
    return lines


def _by_tier(row: Mapping, what: str) -> str:
    """'59 primary, 19 host, 18 disk' ('-' when the row has no per-tier counts)."""
    counts = {tier: as_number(row.get(f"{tier}_{what}_blocks")) for tier in TIER_NAMES}
    if all(count is None for count in counts.values()):
        return "-"
    return ", ".join(f"{_count(count)} {tier}" for tier, count in counts.items() if count) or "none"


def _staging_cost(row: Mapping) -> str:
    """'4.1 ms (227 µs/block)': lookups and fetches of the third tier, on the step path."""
    seconds, staged = as_number(row.get("tier3_staging_s")), as_number(row.get("tier3_staged_blocks"))
    if seconds is None:
        return "-"
    per_block = f" ({seconds * 1e6 / staged:,.0f} µs/block)" if staged else ""
    return f"{seconds * 1000:,.1f} ms{per_block}"


def _miss_reasons(row: Mapping) -> str:
    """'12 new, 3 evicted from host': the reasons that missed blocks ('-' when the engine gave none)."""
    counts = {name: as_number(row.get(f"missed_{reason}_blocks"))
              for reason, name in {**_MISS_NAMES, **_TIER3_MISS_NAMES}.items()}
    if all(count is None for count in counts.values()):
        return "-"
    return ", ".join(f"{_count(count)} {name}" for name, count in counts.items() if count) or "none"

