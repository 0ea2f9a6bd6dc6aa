"""One self-contained HTML page per bench run (`kvtool bench --html`) or comparison (`kvtool compare --html`).

The page holds the tables the terminal shows (converted from the same rich tables, so the two never
disagree), the TTFT plot and any other PNG the run wrote (embedded as data: URIs), the missed
blocks by reason, the errors, and every summary column exactly as summary.csv holds it. It loads
nothing: no script, no stylesheet or font from anywhere, and a Content-Security-Policy that lets
the browser load nothing but the embedded images, so it opens the same offline, mailed, or years later.
"""

from __future__ import annotations

import base64
import html
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from rich.table import Table
from rich.text import Text

from kvtool.reports.compare_table import METRICS, CompareVariant, plot_ttft
from kvtool.reports.csv_report import format_cell
from kvtool.reports.repeats import as_number
from kvtool.errors import KvtoolError
from kvtool.files import atomic_write
from kvtool.runtime.request import MISS_REASONS

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 1400px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.8em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: .6em 0; }
caption { text-align: left; font-weight: 600; padding: .3em 0; white-space: nowrap; }
ul.about { color: #555; padding-left: 1.2em; } ul.about li { margin: .1em 0; }
th, td { border: 1px solid #ddd; padding: .25em .6em; vertical-align: top; }
th { background: #f4f4f4; text-align: left; }
td.number { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tbody tr:nth-child(even) { background: #fafafa; }
img { max-width: 100%; border: 1px solid #eee; }
.muted { color: #666; }
"""
# The browser loads nothing but the embedded images and the inline style.
_POLICY = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"


def _cell_text(cell) -> str:
    if isinstance(cell, Text):
        return cell.plain
    if isinstance(cell, str):
        return Text.from_markup(cell).plain
    return str(cell)


def table_html(table: Table, *, table_id: str | None = None, numbers: bool = True) -> str:
    """A rich table as an HTML table: its title as the caption, its header and cells as plain text
    (right-aligned after the first column, where ``numbers``)."""
    columns = table.columns
    cells = [[_cell_text(cell) for cell in column.cells] for column in columns]
    head = "".join(f"<th>{html.escape(_cell_text(column.header))}</th>" for column in columns)
    body = []
    for row in zip(*cells):
        body.append("<tr>" + "".join(
            f'<td class="number">{html.escape(text)}</td>' if i and numbers else
            f"<td>{html.escape(text)}</td>" for i, text in enumerate(row)) + "</tr>")
    title = f"<caption>{html.escape(_cell_text(table.title))}</caption>" if table.title else ""
    identity = f' id="{html.escape(table_id)}"' if table_id else ""
    return f"<table{identity}>{title}<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def grid_html(header: Sequence[str], rows: Iterable[Sequence[str]], *, table_id: str | None = None,
              caption: str | None = None, numbers: bool = True) -> str:
    """A table of plain strings (the first column a row name)."""
    table = Table(title=caption)
    for name in header:
        table.add_column(Text(name))
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    return table_html(table, table_id=table_id, numbers=numbers)


def png_html(png: bytes, alt: str) -> str:
    """An <img> holding the PNG itself (a data: URI)."""
    data = base64.b64encode(png).decode("ascii")
    return f'<p><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"></p>'


def paragraphs_html(lines: Iterable[str], css_class: str = "") -> str:
    attribute = f' class="{css_class}"' if css_class else ""
    return "".join(f"<p{attribute}>{html.escape(line)}</p>" for line in lines)


def ttft_plot_png(variants: Sequence[CompareVariant]) -> bytes | None:
    """kvtool.reports.compare_table.plot_ttft's PNG (the box plot and CDF `kvtool compare --plot` writes), or
    None when no variant has per-request data."""
    if not any(v.requests for v in variants):
        return None
    with tempfile.TemporaryDirectory(prefix="kvtool-html-") as directory:
        path = Path(directory) / "ttft.png"
        try:
            plot_ttft(variants, path)
        except KvtoolError:  # requests, but none finished with a first token
            return None
        return path.read_bytes()


_MISS_TITLES = {column: name.removeprefix("missed: ") for column, name in METRICS if column.startswith("missed_")}


def miss_reasons_html(rows: Sequence[Mapping], names: Sequence[str]) -> str:
    """Missed blocks by reason, one column per variant: the count and its share of the missed blocks."""
    if all(as_number(row.get("missed_blocks")) is None for row in rows):
        return paragraphs_html(["The engine reported no miss reasons (an endpoint or a peer engine does not say "
                                "why blocks were missed)."], "muted")
    lines = []
    for reason in ("missed_blocks", *(f"missed_{reason}_blocks" for reason in MISS_REASONS)):
        cells = []
        for row in rows:
            count, total = as_number(row.get(reason)), as_number(row.get("missed_blocks"))
            if count is None:
                cells.append("-")
            elif reason == "missed_blocks" or not total:
                cells.append(f"{count:,.0f}")
            else:
                cells.append(f"{count:,.0f} ({count / total:.0%})")
        name = "missed blocks (all reasons)" if reason == "missed_blocks" else _MISS_TITLES.get(reason, reason)
        lines.append([name, *cells])
    lines.append(["reused blocks", *(format_cell(row.get("reused_blocks")) or "-" for row in rows)])
    return grid_html(["reason", *names], lines, table_id="miss-reasons",
                     caption="Full prompt blocks not reused, by reason (share of the missed blocks)")


def errors_html(variants: Sequence[CompareVariant]) -> str:
    """The distinct errors of the requests that failed, with how often each happened."""
    lines = []
    for variant in variants:
        counts: dict[str, int] = {}
        for request in variant.requests or ():
            if request.error:
                counts[request.error] = counts.get(request.error, 0) + 1
        for error, count in sorted(counts.items(), key=lambda item: -item[1]):
            lines.append([variant.name, f"{count:,}", error])
        run_error = variant.row.get("run_error")
        if run_error:
            lines.append([variant.name, "stopped the run", str(run_error)])
    if not lines:
        return paragraphs_html(["No request failed."], "muted")
    return grid_html(["variant", "requests", "error"], lines, table_id="errors", numbers=False)


def columns_html(rows: Sequence[Mapping], names: Sequence[str]) -> str:
    """Every summary column, one column per row, each cell as summary.csv writes it."""
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    lines = [[column, *(format_cell(row.get(column)) for row in rows)] for column in columns]
    return grid_html(["column", *names], lines, table_id="summary-columns", numbers=False)


def page_html(title: str, sections: Sequence[tuple[str, str]], *, subtitle: Sequence[str] = ()) -> str:
    """The whole page: a title, lines under it, then (heading, HTML) sections."""
    parts = [f"<h2>{html.escape(heading)}</h2>{body}" if heading else body for heading, body in sections]
    items = "".join(f"<li>{html.escape(line)}</li>" for line in subtitle)
    about = f'<ul class="about">{items}</ul>' if subtitle else ""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{_POLICY}\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{about}{''.join(parts)}</body></html>\n")


def write_html(path: str | os.PathLike, page: str) -> Path:
    """Writes the page atomically."""
    path = Path(path)
    with atomic_write(path) as out:
        out.write(page)
    return path


def run_names(rows: Sequence[Mapping]) -> list[str]:
    """A name per summary row: its label, and its run number when the variant ran several times."""
    return [str(row.get("label", "")) + (f" run {row['repeat']}" if row.get("repeat") not in (None, "") else "")
            for row in rows]


def what_ran(rows: Sequence[Mapping]) -> list[str]:
    """The lines under the title: the workload, the model, the device, the version, how the run ended."""
    first = rows[0]
    lines = []
    labels = list(dict.fromkeys(str(row.get("label", "")) for row in rows))
    lines.append(f"{len(labels)} variant{'s' if len(labels) > 1 else ''}: {', '.join(labels)}")
    for column, name in (("model", "model"), ("endpoint", "endpoint"), ("dataset", "dataset"),
                         ("replay", "replay"), ("device", "device"), ("cost_profile", "cost model"),
                         ("started_at", "started at")):
        values = list(dict.fromkeys(str(row[column]) for row in rows if row.get(column) not in (None, "")))
        if values:
            digest = str(first.get("dataset_sha256") or "")[:12] if column == "dataset" else ""
            lines.append(f"{name}: {' / '.join(values)}" + (f" (sha256 {digest})" if digest else ""))
    if first.get("kvtool_version"):
        lines.append(f"kvtool {first['kvtool_version']}" + (f", git {first['git_revision']}"
                                                             if first.get("git_revision") else ""))
    interrupted = [str(row.get("label")) for row in rows if str(row.get("interrupted")) == "True"]
    if interrupted:
        lines.append(f"interrupted: {', '.join(interrupted)} (the figures cover the requests that finished)")
    return lines


def _variant_rows(variants: Sequence[CompareVariant]) -> list[Mapping]:
    return [variant.row for variant in variants]


def bench_page(rows: Sequence[Mapping], *, summary_table: Table, variants: Sequence[CompareVariant],
               pngs: Sequence[Path] = ()) -> str:
    """The page of a bench (or simulate) run: ``rows`` are its summary rows, ``summary_table`` the
    end-of-run table, ``variants`` the run read back from its CSVs (kvtool.reports.compare_table.load_variants:
    the per-request rows, for the TTFT plot and the errors), ``pngs`` other plots it wrote (sweep.png)."""
    simulated = any(str(row.get("simulated")) == "True" for row in rows)
    title = "kvtool simulate report (simulated)" if simulated else "kvtool bench report"
    plot = ttft_plot_png(variants)
    plots = ([png_html(plot, "TTFT distribution per variant")] if plot else [])
    plots += [png_html(Path(png).read_bytes(), Path(png).name) for png in pngs]
    sections = [("Summary", table_html(summary_table, table_id="summary")),
                ("Plots", "".join(plots) or paragraphs_html(["No per-request data to plot."], "muted")),
                ("Why blocks were missed", miss_reasons_html(_variant_rows(variants) or rows,
                                                             [v.name for v in variants] or run_names(rows))),
                ("Errors", errors_html(variants)),
                ("Every summary column (as summary.csv holds it)", columns_html(rows, run_names(rows)))]
    return page_html(title, sections, subtitle=what_ran(rows))


def compare_page(variants: Sequence[CompareVariant], *, compare_table: Table, notes: Sequence[str]) -> str:
    """The page of `kvtool compare`: the notes it prints (what the variants share and where they
    differ, statuses, verdicts), its table, the TTFT plot, missed blocks by reason, errors, and every
    summary column of each variant."""
    plot = ttft_plot_png(variants)
    rows = _variant_rows(variants)
    names = [variant.name for variant in variants]
    sources = list(dict.fromkeys(str(variant.source) for variant in variants))
    sections = [("", paragraphs_html(notes)),
                ("Comparison", table_html(compare_table, table_id="compare")),
                ("TTFT", png_html(plot, "TTFT distribution per variant") if plot else paragraphs_html(
                    ["No per-request data to plot: keep each summary's requests CSV beside it."], "muted")),
                ("Why blocks were missed", miss_reasons_html(rows, names)),
                ("Errors", errors_html(variants)),
                ("Every summary column (medians of repeated runs)", columns_html(rows, names))]
    return page_html("kvtool compare report", sections, subtitle=[f"reports: {', '.join(sources)}"])
