"""CSV reports: per-request rows appended as requests finish (flushed within 0.1 s, and on close);
summaries written atomically.

An interrupted bench therefore keeps every finished request's row, and a summary file is
either the previous complete one or the new complete one, never half written.
"""

from __future__ import annotations

import csv
import operator
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO

from kvtool.bench.metrics import CSV_COLUMNS, ENGINE, MISS_COLUMNS, RequestMetrics
from kvtool.errors import KvtoolError
from kvtool.files import atomic_write

SUMMARY_FILE = "summary.csv"
_csv_values = operator.attrgetter(*CSV_COLUMNS)  # a RequestMetrics' CSV cells, in order, in one call
# The cells that may hold a float: only those need format_cell (csv writes None as '' and ints as str).
_FLOAT_CELLS = tuple(i for i, name in enumerate(CSV_COLUMNS)
                     if "float" in str(RequestMetrics.__dataclass_fields__[name].type))


def format_float(value: float) -> str:
    """A float to 6 decimals without trailing zeros ('12.5', '3'); very large ones as repr."""
    return f"{value:.6f}".rstrip("0").rstrip(".") if abs(value) < 1e15 else repr(value)


def format_cell(value) -> str:
    """CSV text of a value: '' for None, floats to 6 decimals (format_float), booleans as True/False."""
    if value is None:
        return ""
    if isinstance(value, float):
        return format_float(value)
    return str(value)


def format_hit_rate(value) -> str:
    """'82.4%' (the bench table and kvtool compare show the cache hit rate alike); '-' when unknown."""
    if value is None or value == "":
        return "-"
    return f"{float(value):.1%}"


def safe_label(label: str) -> str:
    """A label usable in a file name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "run"


def requests_file_name(label: str | None) -> str:
    return "requests.csv" if not label else f"requests-{safe_label(label)}.csv"


class RequestCsvWriter:
    """Appends one row per finished request to a CSV file, flushed to the OS at most ``flush_seconds``
    after it was written, and on close (which an interrupted or failed bench reaches too)."""

    def __init__(self, path: str | os.PathLike, *, flush_seconds: float = 0.1) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("w", newline="", encoding="utf-8")
        self._writer = csv.writer(self._file)
        self._writer.writerow(CSV_COLUMNS)
        self._file.flush()
        self._flush_seconds = flush_seconds
        self._flushed_at = time.monotonic()
        self.num_rows = 0

    def write(self, metrics: RequestMetrics) -> None:
        if self._file is None:
            raise RuntimeError(f"{self.path} is closed")
        cells = list(_csv_values(metrics))
        for i in _FLOAT_CELLS:
            value = cells[i]
            if value is not None:  # (csv writes None as '')
                cells[i] = format_float(value)
        self._writer.writerow(cells)
        self.num_rows += 1
        # To the OS, where the row survives a crash of the process, within flush_seconds: a flush
        # per row cost `kvtool simulate` 3 µs of its ~50 a request. No fsync, which would stall
        # the replay loop between engine steps and show up in the latencies.
        now = time.monotonic()
        if now - self._flushed_at >= self._flush_seconds:
            self._file.flush()
            self._flushed_at = now

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> RequestCsvWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_summary_csv(path: str | os.PathLike, rows: Sequence[Mapping[str, object]]) -> Path:
    """Writes rows (one per variant) atomically; columns are the union of keys in first-seen order."""
    path = Path(path)
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    with atomic_write(path, newline="", fsync=True) as out:
        writer = csv.writer(out)
        writer.writerow(columns)
        for row in rows:
            writer.writerow([format_cell(row.get(column)) for column in columns])
    return path


def read_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    """Rows of a CSV report as dicts of strings; a missing or empty file is a clear error."""
    path = Path(path)
    if not path.is_file():
        raise KvtoolError(f"report {path} does not exist or is not a file")
    try:
        with path.open(newline="", encoding="utf-8") as source:
            reader = csv.DictReader(source)
            if not reader.fieldnames:
                raise KvtoolError(f"report {path} is empty (no header row)")
            return list(reader)
    except UnicodeDecodeError as error:
        raise KvtoolError(f"report {path} is not a UTF-8 text file ({error.reason} at byte {error.start}): give a "
                          "summary.csv or requests.csv that kvtool bench wrote") from None
    except csv.Error as error:
        raise KvtoolError(f"report {path} is not a CSV file ({error}): give a summary.csv or requests.csv that "
                          "kvtool bench wrote") from None


def _optional_float(text: str | None) -> float | None:
    return None if text in (None, "") else float(text)


def _optional_int(text: str | None) -> int | None:
    return None if text in (None, "") else int(float(text))


def request_metrics_from_row(row: Mapping[str, str]) -> RequestMetrics:
    """A per-request CSV row back as RequestMetrics (without the individual token gaps). Columns
    added later (the miss reasons) are None in older reports."""
    return RequestMetrics(
        label=row.get("label", ""), engine=row.get("engine") or ENGINE, request_id=row["request_id"],
        session_id=row.get("session_id") or None,
        turn=_optional_int(row.get("turn")), input_tokens=int(row["input_tokens"]),
        output_tokens=int(row["output_tokens"]), reused_tokens=_optional_int(row.get("reused_tokens")) or 0,
        onboarded_blocks=_optional_int(row.get("onboarded_blocks")) or 0,
        arrival_s=float(row["arrival_s"]), first_token_s=_optional_float(row.get("first_token_s")),
        finish_s=_optional_float(row.get("finish_s")), ttft_ms=_optional_float(row.get("ttft_ms")),
        tpot_ms=_optional_float(row.get("tpot_ms")), itl_ms=_optional_float(row.get("itl_ms")),
        e2e_ms=_optional_float(row.get("e2e_ms")), error=row.get("error") or None,
        endpoint=row.get("endpoint") or None, **{column: _optional_int(row.get(column)) for column in MISS_COLUMNS})


def rows_by_label(rows: Iterable[Mapping[str, str]]) -> dict[str, list[Mapping[str, str]]]:
    groups: dict[str, list[Mapping[str, str]]] = {}
    for row in rows:
        groups.setdefault(row.get("label", ""), []).append(row)
    return groups


def output_paths(output: str | os.PathLike) -> tuple[Path, Path]:
    """(summary CSV, per-request CSV) of a single run: OUTPUT/summary.csv + OUTPUT/requests.csv for a
    directory, or OUTPUT itself + <stem>-requests.csv beside it when OUTPUT ends with .csv."""
    output = Path(output)
    if output.suffix.lower() == ".csv":
        return output, output.with_name(f"{output.stem}-requests.csv")
    return output / SUMMARY_FILE, output / requests_file_name(None)
