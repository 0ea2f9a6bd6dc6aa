"""`kvtool compare`: bench reports side by side, with ratios against the first, and a TTFT plot."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvtool.reports.compare_table import (compare_rows, format_metric, format_ratio, format_spread, load_variants,
                                  plot_ttft, setup_differences, verdicts)
from kvtool.reports.csv_report import write_summary_csv
from kvtool.cli import app
from kvtool.cli.user_errors import user_errors
from kvtool.cli.help import KvtoolCommand
from kvtool.cli.paths import check_writable_file


def _title(variant) -> str:
    status = variant.status()
    runs = f" (median of {variant.num_runs} runs)" if variant.num_runs > 1 else ""
    return f"{variant.name}{runs}" + (f" ({status})" if status else "")


def _table(rows, variants) -> Table:
    repeated = any(v.num_runs > 1 for v in variants)
    table = Table(title=f"kvtool compare (ratios against {variants[0].name})")
    table.add_column("metric", no_wrap=True)
    for position, variant in enumerate(variants):
        table.add_column(_title(variant), justify="right")
        if repeated:
            table.add_column("runs' range", justify="right", style="dim")
        if position:
            table.add_column("ratio", justify="right", style="cyan")
    for row in rows:
        cells = []
        for position, (value, ratio) in enumerate(zip(row.values, row.ratios)):
            cells.append(format_metric(row.column, value))
            if repeated:
                cells.append(format_spread(row.spreads[position] if row.spreads else None))
            if position:
                cells.append(format_ratio(ratio))
        table.add_row(row.name, *cells)
    return table


def _table_width(rows, variants) -> int:
    """Wide enough that no number is cut short: at least the terminal's width."""
    metric = max(len(row.name) for row in rows) if rows else 10
    repeated = any(v.num_runs > 1 for v in variants)
    values = sum(max(len(_title(v)), 12) + 3 + (20 if repeated else 0) for v in variants) + 9 * (len(variants) - 1)
    return max(Console().width, metric + 4 + values)


def _status_note(variant) -> str:
    return f"{variant.status()}: its figures cover the requests that finished without error"


def _write_html(path: Path, rows, variants) -> Path:
    """The comparison as one self-contained HTML page (kvtool.reports.html.compare_page): the lines
    printed around the table, the table, the TTFT plot, missed blocks by reason, errors, every column."""
    from kvtool.reports.html import compare_page, write_html

    recorder = Console(record=True, file=io.StringIO(), width=100_000)
    _print_setup(recorder, variants)
    notes = recorder.export_text().splitlines()
    notes += [f"{variant.name}: {_status_note(variant)}" for variant in variants if variant.status()]
    notes += verdicts(variants)
    return write_html(path, compare_page(variants, compare_table=_table(rows, variants), notes=notes))


def _print_setup(console: Console, variants) -> None:
    """What the variants share, and (in yellow) what else differs between them besides the flags compared."""
    same, different = setup_differences(variants)
    if same:
        console.print("same for all: " + "; ".join(f"{name} {value}" for name, value in same), highlight=False,
                      soft_wrap=True)
    # Names made of what differs say which value is whose: then the values alone, in column order.
    named = not all(v.name_from_config for v in variants)
    for name, values in different:
        shown = ", ".join(f"{v.name}: {value or '?'}" if named else (value or "?")
                          for v, value in zip(variants, values))
        console.print(f"[yellow]differs[/]: {name} ({escape(shown)})", highlight=False, soft_wrap=True)


@app.command(cls=KvtoolCommand)
def compare(
    reports: Annotated[list[Path], typer.Argument(help="Run or scenario directories (kvtool bench --output), summary "
                                                  "CSVs (a row per variant, or per run of a repeated variant) and/or "
                                                  "per-request CSVs.", show_default=False)],
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG of the TTFT distributions.")] = None,
    output: Annotated[Path | None, typer.Option("--output", help="Also write the table as CSV.")] = None,
    html: Annotated[Path | None, typer.Option("--html", help="Also write one self-contained HTML page: the table, "
                                              "the TTFT plot, missed blocks by reason, errors.")] = None,
) -> None:
    """Print the reports' metrics side by side (rows = what differs, then metrics; columns = variants, named by
    what sets them apart unless labelled; ratios vs the first)."""
    with user_errors():
        if plot is not None:
            check_writable_file(plot, "--plot", "ttft.png")
        if output is not None:
            check_writable_file(output, "--output", "compare.csv")
        if html is not None:
            check_writable_file(html, "--html", "compare.html")
        variants = load_variants(reports)
        rows = compare_rows(variants)
        console = Console(width=_table_width(rows, variants))
        _print_setup(console, variants)
        console.print(_table(rows, variants))
        for variant in variants:
            for note in variant.notes:
                console.print(f"[yellow]{escape(variant.name)}[/]: {escape(note)}", highlight=False, soft_wrap=True)
            if variant.status() and not variant.cut_short:
                console.print(f"[yellow]{escape(variant.name)}[/]: {escape(_status_note(variant))}", highlight=False,
                              soft_wrap=True)
        for line in verdicts(variants):
            console.print(line, highlight=False, soft_wrap=True)
        if output is not None:
            csv_rows = []
            for row in rows:
                line = {"metric": row.column}
                for variant, value, ratio in zip(variants, row.values, row.ratios):
                    line[variant.name] = value
                    if variant is not variants[0]:
                        line[f"{variant.name} / {variants[0].name}"] = ratio
                csv_rows.append(line)
            typer.echo(f"wrote {write_summary_csv(output, csv_rows)}")
        if plot is not None:
            typer.echo(f"wrote {plot_ttft(variants, plot)}")
        if html is not None:
            typer.echo(f"wrote {_write_html(html, rows, variants)}")
