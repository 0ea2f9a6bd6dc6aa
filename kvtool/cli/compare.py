"""`kvtool compare`: bench reports side by side, with ratios against the first, and a TTFT plot."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvtool.bench.compare import compare_rows, format_ratio, format_value, load_variants, plot_ttft
from kvtool.bench.report import write_summary_csv
from kvtool.cli import app
from kvtool.cli.errors import user_errors
from kvtool.cli.help import KvtoolCommand
from kvtool.cli.paths import check_writable_file


def _table_width(rows, variants) -> int:
    """Wide enough that no number is cut short: at least the terminal's width."""
    metric = max(len(row.name) for row in rows) if rows else 10
    values = sum(max(len(v.name), 12) + 3 for v in variants) + 9 * (len(variants) - 1)
    return max(Console().width, metric + 4 + values)


@app.command(cls=KvtoolCommand)
def compare(
    reports: Annotated[list[Path], typer.Argument(help="Summary CSVs (a row per variant) and/or per-request CSVs.",
                                                  show_default=False)],
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG of the TTFT distributions.")] = None,
    output: Annotated[Path | None, typer.Option("--output", help="Also write the table as CSV.")] = None,
) -> None:
    """Print the reports' metrics side by side (rows = metrics, columns = variants, ratios vs the first)."""
    with user_errors():
        if plot is not None:
            check_writable_file(plot, "--plot", "ttft.png")
        if output is not None:
            check_writable_file(output, "--output", "compare.csv")
        variants = load_variants(reports)
        rows = compare_rows(variants)
        table = Table(title=f"kvtool compare (ratios against {variants[0].name})")
        table.add_column("metric", no_wrap=True)
        for position, variant in enumerate(variants):
            table.add_column(variant.name, justify="right")
            if position:
                table.add_column("ratio", justify="right", style="cyan")
        for row in rows:
            cells = []
            for position, (value, ratio) in enumerate(zip(row.values, row.ratios)):
                cells.append(format_value(value))
                if position:
                    cells.append(format_ratio(ratio))
            table.add_row(row.name, *cells)
        Console(width=_table_width(rows, variants)).print(table)
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
