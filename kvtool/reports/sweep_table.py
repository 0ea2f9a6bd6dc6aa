"""What a simulated sweep shows: hit rate and predicted TTFT p50 / p90 against the swept value."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvtool.reports.csv_report import format_hit_rate
from kvtool.reports.repeats import as_number


def _ms(value) -> str:
    number = as_number(value)
    return "-" if number is None else f"{number:,.1f}"


def print_sweep(rows: Sequence[Mapping], console: Console) -> None:
    """One line per variant: hit rate and predicted TTFT p50 / p90; the title names the cost model(s)."""
    profiles = sorted({str(row.get("cost_profile", "")) for row in rows})
    table = Table(title=f"simulated with {', '.join(profiles)}: hit rate and predicted TTFT")
    for name in ("variant", "cache hit rate", "TTFT p50 (ms)", "TTFT p90 (ms)"):
        table.add_column(name, justify="left" if name == "variant" else "right", no_wrap=True)
    for row in rows:
        table.add_row(str(row.get("label")), format_hit_rate(row.get("cache_hit_rate")), _ms(row.get("ttft_ms_p50")),
                      _ms(row.get("ttft_ms_p90")))
    console.print(table)


def plot_sweep(rows: Sequence[Mapping], path: Path) -> Path:
    """sweep.png: hit rate (left axis) and TTFT p50 / p90 (right axis) per variant, in sweep order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(row.get("label")) for row in rows]
    names = {label.partition("=")[0] for label in labels}
    swept = names.pop() if len(names) == 1 and all("=" in label and "," not in label for label in labels) else None
    if swept is not None:  # one --sweep: the values on the axis, the flag under it
        labels = [label.partition("=")[2] for label in labels]
    x = range(len(rows))
    fig, hit_axis = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 4.0))
    hit_axis.plot(x, [as_number(row.get("cache_hit_rate")) for row in rows], "o-", color="tab:green", label="hit rate")
    hit_axis.set_ylabel("cache hit rate")
    hit_axis.set_ylim(0, 1.05)
    ttft_axis = hit_axis.twinx()
    for key, style, name in (("ttft_ms_p50", "s-", "TTFT p50"), ("ttft_ms_p90", "^--", "TTFT p90")):
        ttft_axis.plot(x, [as_number(row.get(key)) for row in rows], style, color="tab:blue", label=name)
    ttft_axis.set_ylabel("predicted TTFT (ms)")
    ttft_axis.set_ylim(bottom=0)
    hit_axis.set_xticks(list(x), labels, rotation=20, ha="right")
    if swept is not None:
        hit_axis.set_xlabel(swept)
    estimated = any(str(row.get("cost_profile_estimated")) == "True" for row in rows)
    profile = rows[0].get("cost_profile", "")
    hit_axis.set_title(f"simulated ({profile}{', ESTIMATED' if estimated and 'estimated' not in profile else ''})")
    lines = hit_axis.get_legend_handles_labels()
    more = ttft_axis.get_legend_handles_labels()
    hit_axis.legend(lines[0] + more[0], lines[1] + more[1], loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
