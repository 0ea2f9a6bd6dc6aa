"""CSV reports: per-request rows appended as requests finish (handed to the OS whole, within 0.1 s,
and on close); summaries written atomically.

An interrupted bench therefore keeps every finished request's row, a killed one (``kill -9``) every
row flushed before it, whole, and a summary file is either the previous complete one or the new
complete one, never half written.
"""

from __future__ import annotations

import contextlib
import csv
import io
import operator
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from kvtool.reports.metrics import CSV_COLUMNS, ENGINE, MISS_COLUMNS, RequestMetrics
from kvtool.errors import KvtoolError
from kvtool.files import FileWriteError, atomic_write
from kvtool.signals import stop_signals_held

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


class _Lines(list):
    """Where csv.writer puts each row: one whole line (terminator included) per writerow call."""

    write = list.append


class RequestCsvWriter:
    """Appends one row per finished request to a CSV file. Rows reach the OS whole, at most
    ``flush_seconds`` after they were written and on close (which an interrupted or failed bench
    reaches too), so the file holds complete rows only, even after ``kill -9``.

    A write the OS refuses (a full disk, a quota) cuts the file back to its last complete row and
    raises a FileWriteError naming the file; the rows not written stay in memory (``num_rows``
    counts every row given)."""

    def __init__(self, path: str | os.PathLike, *, flush_seconds: float = 0.1) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._pending = _Lines()   # whole lines not yet handed to the OS
        self._writer = csv.writer(self._pending)
        self._fd: int | None = None
        self._size = 0             # bytes of complete rows in the file
        self._num_written = 0      # rows in the file
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # less the umask
        except OSError as error:
            raise FileWriteError(self.path, error, "nothing written") from None
        self._writer.writerow(CSV_COLUMNS)
        self._flush_seconds = flush_seconds
        self._flushed_at = time.monotonic()
        self.flush()
        self.num_rows = 0

    def write(self, metrics: RequestMetrics) -> None:
        if self._fd is None:
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
            self.flush()
            self._flushed_at = now

    def flush(self) -> None:
        """Hands the rows written since the last flush to the OS, whole: one write of complete lines
        (repeated only for what a short write left), with stop signals held back so that Ctrl-C or
        SIGTERM cannot cut it; a failure cuts the file back to its last complete row."""
        if not self._pending or self._fd is None:
            return
        data = "".join(self._pending).encode("utf-8")
        with stop_signals_held():
            try:
                view, done = memoryview(data), 0
                while done < len(data):
                    done += os.write(self._fd, view[done:])
            except OSError as error:
                self._cut_back()
                rows = self._num_written - 1  # the header is a line of the file, not a row
                kept = (f"it ends at its last complete row, {rows:,} row{'s' if rows != 1 else ''}; "
                        f"{len(self._pending):,} more not written" if self._num_written else "nothing written")
                self._close_fd()
                raise FileWriteError(self.path, error, kept) from None
            self._size += len(data)
            self._num_written += len(self._pending)
            self._pending.clear()

    def _cut_back(self) -> None:
        """The file back to its last complete row (a failed write may have left part of one)."""
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._size)
            os.lseek(self._fd, self._size, os.SEEK_SET)

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Flushes what is pending (a FileWriteError when the OS refuses it) and closes the file."""
        try:
            self.flush()
        finally:
            self._close_fd()

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


class CsvReport(NamedTuple):
    """A CSV report's complete rows, and the line of a last row cut short (None: none was)."""

    rows: list[dict[str, str]]
    cut_line: int | None

    def cut_note(self, path: str | os.PathLike) -> str:
        """'requests.csv line 588 is cut short ...' ('' when no row was)."""
        if self.cut_line is None:
            return ""
        return (f"{path} line {self.cut_line} is cut short (the run was killed or its disk filled while writing it): "
                "that row is left out")


def read_report(path: str | os.PathLike, *, allow_cut: bool = False) -> CsvReport:
    """The rows of a CSV report as dicts of strings. A row whose number of cells is not the header's, or
    a last line without its line end, is an error naming the file and line; with ``allow_cut`` such a
    last line (an appended file whose writer was killed, or a full disk) is left out and reported in
    ``cut_line`` instead. A missing or empty file is a clear error."""
    path = Path(path)
    if not path.is_file():
        raise KvtoolError(f"report {path} does not exist or is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise KvtoolError(f"report {path} is not a UTF-8 text file ({error.reason} at byte {error.start}): give a "
                          "summary.csv or requests.csv that kvtool bench wrote") from None
    ended = text.endswith(("\n", "\r"))
    last_line = text.count("\n") + (not ended)
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        if not header:
            raise KvtoolError(f"report {path} is empty (no header row)")
        rows: list[dict[str, str]] = []
        cut_line = None
        for cells in reader:
            if not cells:
                continue  # a blank line
            last = reader.line_num == last_line
            if len(cells) != len(header) or (last and not ended):
                why = ("no line end" if last and not ended and len(cells) == len(header)
                       else f"{len(cells)} cells where the header has {len(header)}")
                if last and not ended and allow_cut:
                    cut_line = reader.line_num
                    break
                raise KvtoolError(f"report {path} line {reader.line_num} is cut short or damaged ({why}): kvtool "
                                  "writes whole rows, so the file was cut or edited after; repair or remove that "
                                  "line, or rerun the bench")
            rows.append(dict(zip(header, cells)))
    except csv.Error as error:
        raise KvtoolError(f"report {path} is not a CSV file ({error}): give a summary.csv or requests.csv that "
                          "kvtool bench wrote") from None
    return CsvReport(rows, cut_line)


def read_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    """The rows of a complete CSV report (read_report without allow_cut)."""
    return read_report(path).rows


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
        endpoint=row.get("endpoint") or None, **{column: _optional_int(row.get(column)) for column in MISS_COLUMNS},
        replica=_optional_int(row.get("replica")))


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
