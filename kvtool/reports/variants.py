"""The variants of bench reports, as kvtool compare and kvtool explain read them: a summary CSV (every
row a variant; rows of one label numbered by ``repeat`` are the runs of one variant:
kvtool.reports.repeats), a per-request CSV (every label a variant, summarized with
kvtool.reports.metrics.summarize), or a run or scenario directory (its summary, and a variant cut short
for each per-request file its summary has no row for). A summary row's per-request file
(``requests_csv``, beside the summary) is read when present, for the plot.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.reports.differences import variant_names
from kvtool.reports.metrics import MISS_COLUMNS, RequestMetrics, summarize
from kvtool.reports.repeats import as_number, group_by_label, median_row
from kvtool.reports.csv_report import SUMMARY_FILE, read_report, request_metrics_from_row, rows_by_label
from kvtool.errors import KvtoolError


@dataclass
class CompareVariant:
    """One column of the comparison: a name, its summary values (medians when it ran several times),
    its runs' rows and (when known) its requests, every run's pooled. ``cut_short``: a run without a
    summary row (killed before writing it), its figures summarized from its per-request rows."""

    name: str
    row: dict[str, str]
    requests: list[RequestMetrics] | None
    source: Path
    runs: list[dict] = field(default_factory=list)
    cut_short: bool = False
    notes: list[str] = field(default_factory=list)  # what the screen must say about its files
    name_from_config: bool = False  # the name is what sets it apart ('reuse off'), its default label replaced

    @property
    def num_runs(self) -> int:
        return len(self.runs) or 1

    def status(self) -> str:
        """'' for a complete run without errors, else e.g. 'interrupted, 3 errors' or 'cut short'."""
        if self.cut_short:
            return "cut short, no summary"
        runs = self.runs or [self.row]
        interrupted = sum(str(run.get("interrupted")) == "True" for run in runs)
        errors = sum(int(as_number(run.get("num_errors")) or 0) for run in runs)
        parts = []
        if interrupted:
            by = {str(run.get("interrupted_by")) for run in runs if run.get("interrupted_by")}
            signal = f" by {'/'.join(sorted(by))}" if by else ""
            parts.append(f"interrupted{signal}" if len(runs) == 1 else f"{interrupted} of {len(runs)} runs interrupted")
        if errors:
            parts.append(f"{errors} error{'s' if errors > 1 else ''}")
        return ", ".join(parts)


def _is_per_request(columns: Sequence[str]) -> bool:
    return "request_id" in columns and "ttft_ms" in columns


def summary_from_requests(label: str, requests: list[RequestMetrics]) -> dict:
    """A summary row from per-request rows: the metrics, and the missed blocks by reason summed (the
    reused blocks and the configuration are only in a summary)."""
    row = {"label": label, "engine": "/".join(sorted({r.engine for r in requests}))}
    row.update({k: "" if v is None else v for k, v in summarize(requests).as_row().items()})
    for column in MISS_COLUMNS:
        counts = [getattr(r, column) for r in requests if r.ok and getattr(r, column) is not None]
        row[column] = sum(counts) if counts else ""
    return row


def _request_variants(path: Path, *, cut_short: bool) -> list[CompareVariant]:
    """A variant per label of a per-request CSV (a cut-short last row left out, with a note)."""
    report = read_report(path, allow_cut=True)
    if not report.rows:
        raise KvtoolError(f"report {path} has a header but no rows" + (f" ({report.cut_note(path)})"
                                                                        if report.cut_line else ""))
    if not _is_per_request(list(report.rows[0])):
        raise KvtoolError(f"{path} is not a kvtool per-request CSV (request_id and ttft_ms columns)")
    variants = []
    for label, group in rows_by_label(report.rows).items():
        try:
            requests = [request_metrics_from_row(row) for row in group]
        except (KeyError, ValueError) as error:
            raise KvtoolError(f"{path}: a row is not a kvtool per-request row ({error})") from None
        notes = [report.cut_note(path)] if report.cut_line else []
        if cut_short:
            notes.insert(0, f"no summary row: the run was cut short (killed, or its disk filled) before writing "
                            f"one; its figures come from the {len(requests):,} complete rows of {path} (cache "
                            "counters and configuration unknown)")
        variants.append(CompareVariant(label or path.stem, summary_from_requests(label, requests), requests, path,
                                       cut_short=cut_short, notes=notes))
    return variants


def _summary_variants(path: Path, rows: list[dict[str, str]], with_requests: bool) -> list[CompareVariant]:
    """A variant per label of a summary CSV (the runs of a repeated one as one), with its requests."""
    variants = []
    columns = list(rows[0])
    groups = group_by_label(rows) if "repeat" in columns else [[row] for row in rows]
    for runs in groups:
        notes: list[str] = []
        requests = [r for run in runs for r in (_requests_beside(path, run, notes) or [])] if with_requests else []
        row = median_row(runs) if "repeat" in columns else dict(runs[0])
        variants.append(CompareVariant(runs[0].get("label") or path.stem, row, requests or None, path,
                                       [dict(run) for run in runs], notes=notes))
    return variants


def _report_variants(path: Path, with_requests: bool) -> list[CompareVariant]:
    if path.is_dir():
        return _directory_variants(path, with_requests)
    report = read_report(path, allow_cut=True)
    if report.rows and _is_per_request(list(report.rows[0])):
        return _request_variants(path, cut_short=False)
    if report.cut_line is not None:  # summaries are written whole: a cut one was damaged after
        read_report(path)  # the error naming the line
    if not report.rows:
        raise KvtoolError(f"report {path} has a header but no rows")
    if "ttft_ms_mean" not in report.rows[0]:
        raise KvtoolError(f"{path} is neither a kvtool summary CSV (ttft_ms_mean column) nor a per-request CSV "
                          "(request_id and ttft_ms columns)")
    return _summary_variants(path, report.rows, with_requests)


def _directory_variants(directory: Path, with_requests: bool) -> list[CompareVariant]:
    """A run or scenario directory (kvtool bench --output DIR): its summary's variants, and a cut-short
    variant for each per-request file no summary row names (a run killed before its summary)."""
    summary = directory / SUMMARY_FILE
    variants = _report_variants(summary, with_requests) if summary.is_file() else []
    named = {run.get("requests_csv") for variant in variants for run in variant.runs}
    for requests_csv in sorted(directory.glob("requests*.csv")):
        if requests_csv.name not in named:
            variants += _request_variants(requests_csv, cut_short=True)
    if not variants:
        raise KvtoolError(f"{directory} holds no {SUMMARY_FILE} and no requests*.csv: give a directory kvtool bench "
                          "or simulate wrote (its --output), or the CSV files themselves")
    return variants


def load_variants(paths: Sequence[str | os.PathLike], *, with_requests: bool = True) -> list[CompareVariant]:
    """Every variant of the given reports (summary CSVs, per-request CSVs, run or scenario directories),
    in order, named so that each name is distinct and says what sets it apart
    (kvtool.reports.differences.variant_names). ``with_requests=False``: a summary's per-request files
    are not read (a variant cut short before its summary is still read from its own)."""
    variants = [variant for path in map(Path, paths) for variant in _report_variants(path, with_requests)]
    names = variant_names([v.row for v in variants], [v.source for v in variants])
    for variant, name, derived in zip(variants, *names):
        variant.name, variant.name_from_config = name, derived
    return variants


def _requests_beside(summary_path: Path, row: dict[str, str], notes: list[str]) -> list[RequestMetrics] | None:
    name = row.get("requests_csv")
    if not name:
        return None
    path = summary_path.parent / name
    if not path.is_file():
        return None
    report = read_report(path, allow_cut=True)
    if report.cut_line is not None:
        notes.append(report.cut_note(path))
    label = row.get("label", "")
    return [request_metrics_from_row(r) for r in report.rows if r.get("label", "") == label] or None
