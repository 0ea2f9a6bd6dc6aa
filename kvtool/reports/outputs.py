"""What a bench or simulate run reports beyond its CSVs, from the reporting flags: --percentiles and --slo
(more summary columns), --report_json PATH (kvtool.reports.json_report) and --html (kvtool.reports.html).

These are not engine configuration, so they set no configuration field (kvtool.flags): they change
what the reports hold, never how a request runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtool.reports.metrics import PERCENTILES, SummaryOptions, parse_percentiles
from kvtool.reports.slo import parse_slo

HTML_FILE = "report.html"


@dataclass(frozen=True)
class ReportOutputs:
    """The reporting flags of one command: what the summary computes, and the extra files to write."""

    summary: SummaryOptions = SummaryOptions()
    report_json: Path | None = None
    html: bool = False

    @classmethod
    def from_flags(cls, *, percentiles: str | None = None, slo: str | None = None, report_json: Path | None = None,
                   html: bool | None = None) -> ReportOutputs:
        """From the flags' text (a bad value is a ValueError naming the flag)."""
        summary = SummaryOptions(percentiles=parse_percentiles(percentiles) if percentiles is not None else PERCENTILES,
                                 slo=parse_slo(slo) if slo is not None else None)
        return cls(summary, None if report_json is None else Path(report_json), bool(html))

    def write(self, rows: Sequence[Mapping], written: Sequence[Path]) -> list[Path]:
        """Writes the JSON and HTML reports of a run whose summary ``rows`` and files ``written`` (the
        CSVs, any plots) are done; the paths written."""
        paths = []
        if self.report_json is not None:
            from kvtool.reports.json_report import report_document, write_report_json

            simulated = any(str(row.get("simulated")) == "True" for row in rows)
            slo = self.summary.slo
            document = report_document(rows, command="kvtool simulate" if simulated else "kvtool bench",
                                       percentiles=self.summary.percentiles,
                                       slo=None if slo is None else slo_objectives(slo))
            paths.append(write_report_json(self.report_json, document))
        summary_csv = summary_csv_of(rows, written)
        if self.html and summary_csv is not None:
            paths.append(write_run_html(rows, summary_csv, [Path(p) for p in written if Path(p).suffix == ".png"]))
        return paths


def slo_objectives(slo) -> dict[str, float]:
    """The JSON report's objectives: {'ttft_ms': 500.0, 'ttft_ms_p90': 2000.0} (a bound on every request
    by its field, a percentile's by its summary column)."""
    return {**dict(slo.request_bounds()), **{p.column: p.bound_ms for p in slo.percentiles}}


def summary_csv_of(rows: Sequence[Mapping], written: Sequence[Path]) -> Path | None:
    """The summary CSV among a run's files: the CSV that is no row's per-request file."""
    per_request = {str(row.get("requests_csv")) for row in rows}
    for path in map(Path, written):
        if path.suffix.lower() == ".csv" and path.name not in per_request:
            return path
    return None


def html_path(summary_csv: Path) -> Path:
    """report.html beside summary.csv; NAME.html beside NAME.csv (bench --output NAME.csv)."""
    name = HTML_FILE if summary_csv.name == "summary.csv" else f"{summary_csv.stem}.html"
    return summary_csv.with_name(name)


def write_run_html(rows: Sequence[Mapping], summary_csv: Path, pngs: Sequence[Path] = ()) -> Path:
    """The run's HTML page beside its summary CSV (kvtool.reports.html.bench_page)."""
    from kvtool.reports.compare_table import load_variants
    from kvtool.reports.html import bench_page, write_html
    from kvtool.reports.summary_table import summary_table

    page = bench_page(rows, summary_table=summary_table(list(rows)), variants=load_variants([summary_csv]),
                      pngs=pngs)
    return write_html(html_path(summary_csv), page)
