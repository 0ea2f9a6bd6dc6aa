"""CSV reports: rows on disk as soon as written, atomic summaries, round trips."""

from __future__ import annotations

import csv
import errno
import os

import pytest

from kvtool.workloads.datasets import DatasetRecord
from kvtool.reports.metrics import CSV_COLUMNS, MISS_COLUMNS, request_metrics
from kvtool.reports.csv_report import (
    RequestCsvWriter,
    format_cell,
    output_paths,
    read_csv,
    read_report,
    request_metrics_from_row,
    write_summary_csv,
)
from kvtool.errors import KvtoolError
from kvtool.files import FileWriteError
from kvtool.runtime.request import Request

EXPECTED_COLUMNS = ["label", "engine", "request_id", "session_id", "turn", "input_tokens", "output_tokens", "reused_tokens",
                    "onboarded_blocks", "arrival_s", "first_token_s", "finish_s", "ttft_ms", "tpot_ms", "itl_ms",
                    "e2e_ms", "error", "endpoint", "missed_blocks", "missed_never_seen_blocks",
                    "missed_evicted_primary_blocks", "missed_evicted_host_blocks", "missed_identity_blocks",
                    "missed_partial_blocks", "missed_last_token_blocks", "missed_reuse_off_blocks", "replica"]


def metrics(request_id="r", times=(1.1, 1.2), arrival=1.0):
    line = DatasetRecord(line_number=2, output_tokens=len(times), input_ids=(1,) * 12, session_id="s", turn=1)
    rec = Request([1] * 12, arrival_time=arrival, line=line, name=request_id)
    rec.token_times = list(times)
    rec.output_token_ids = [1] * len(times)
    rec.first_token_time, rec.finish_time = times[0], times[-1]
    rec.num_reused_tokens, rec.num_onboarded_blocks = 8, 2
    return request_metrics(rec, label="v1", bench_start=0.5)


def test_per_request_columns_are_the_documented_ones():
    assert list(CSV_COLUMNS) == EXPECTED_COLUMNS


def _ids_on_disk(path) -> list[str]:
    # Read through a separate handle while the writer is still open (as after a crash).
    return [row["request_id"] for row in csv.DictReader(path.open())]


def test_each_row_is_on_disk_within_the_flush_interval(tmp_path):
    path = tmp_path / "requests.csv"
    writer = RequestCsvWriter(path, flush_seconds=0.0)
    writer.write(metrics("a"))
    assert _ids_on_disk(path) == ["a"]
    writer.write(metrics("b"))
    assert _ids_on_disk(path) == ["a", "b"]
    writer.close()


def test_rows_written_since_the_last_flush_reach_the_disk_on_close(tmp_path):
    path = tmp_path / "requests.csv"
    writer = RequestCsvWriter(path, flush_seconds=3600.0)
    writer.write(metrics("a"))
    writer.write(metrics("b"))
    assert _ids_on_disk(path) == []  # buffered: one flush an hour
    writer.close()
    assert _ids_on_disk(path) == ["a", "b"]


def test_request_rows_round_trip(tmp_path):
    original = metrics("x")
    with RequestCsvWriter(tmp_path / "r.csv") as writer:
        writer.write(original)
    (row,) = read_csv(tmp_path / "r.csv")
    assert row["tpot_ms"] == format_cell(original.tpot_ms)
    back = request_metrics_from_row(row)
    for name in EXPECTED_COLUMNS:
        expected, got = getattr(original, name), getattr(back, name)
        if isinstance(expected, float):
            assert got == pytest.approx(expected, abs=1e-6)
        else:
            assert got == expected


def test_empty_cells_for_missing_values():
    assert format_cell(None) == ""
    assert format_cell(True) == "True"
    assert format_cell(2.5) == "2.5"
    assert format_cell(100.0) == "100"


def test_summary_is_written_atomically_with_union_of_columns(tmp_path):
    path = tmp_path / "summary.csv"
    write_summary_csv(path, [{"label": "a", "ttft_ms_mean": 1.5}, {"label": "b", "extra": 3}])
    rows = read_csv(path)
    assert rows == [{"label": "a", "ttft_ms_mean": "1.5", "extra": ""}, {"label": "b", "ttft_ms_mean": "", "extra": "3"}]
    assert os.listdir(tmp_path) == ["summary.csv"]  # the temporary file was renamed, not left behind


def test_failed_summary_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "summary.csv"
    write_summary_csv(path, [{"label": "old"}])

    class Unprintable:
        def __str__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_summary_csv(path, [{"label": Unprintable()}])
    assert read_csv(path) == [{"label": "old"}]
    assert os.listdir(tmp_path) == ["summary.csv"]


def test_output_paths_for_a_directory_or_a_csv_prefix(tmp_path):
    assert output_paths(tmp_path / "run") == (tmp_path / "run" / "summary.csv", tmp_path / "run" / "requests.csv")
    assert output_paths(tmp_path / "a.csv") == (tmp_path / "a.csv", tmp_path / "a-requests.csv")


def test_reading_a_missing_or_empty_report_is_a_clear_error(tmp_path):
    with pytest.raises(KvtoolError, match="does not exist"):
        read_csv(tmp_path / "none.csv")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(KvtoolError, match="is empty"):
        read_csv(tmp_path / "empty.csv")


def test_the_miss_reasons_round_trip_and_older_reports_without_them_still_read(tmp_path):
    rec = metrics("x")
    reasons = {"never_seen": 1, "evicted_primary": 0, "evicted_host": 2, "identity": 0, "partial": 0,
               "last_token": 1, "reuse_off": 0}
    line = DatasetRecord(line_number=2, output_tokens=2, input_ids=(1,) * 12)
    request = Request([1] * 12, arrival_time=1.0, line=line, name="y", miss_reasons=reasons)
    request.token_times, request.output_token_ids = [1.1, 1.2], [1, 1]
    request.first_token_time, request.finish_time = 1.1, 1.2
    with_reasons = request_metrics(request, label="v1", bench_start=0.5)
    assert (with_reasons.missed_blocks, with_reasons.missed_evicted_host_blocks) == (4, 2)
    assert rec.missed_blocks is None and rec.missed_never_seen_blocks is None  # the engine did not say
    with RequestCsvWriter(tmp_path / "r.csv") as writer:
        writer.write(with_reasons)
        writer.write(rec)
    new, unknown = read_csv(tmp_path / "r.csv")
    back = request_metrics_from_row(new)
    assert [getattr(back, c) for c in MISS_COLUMNS] == [getattr(with_reasons, c) for c in MISS_COLUMNS] == [
        4, 1, 0, 2, 0, 0, 1, 0]
    assert unknown["missed_blocks"] == "" and request_metrics_from_row(unknown).missed_blocks is None
    # A report written before the columns existed.
    old = {column: value for column, value in new.items() if not column.startswith("missed_")}
    back = request_metrics_from_row(old)
    assert back.missed_blocks is None and back.missed_last_token_blocks is None and back.reused_tokens == 0


def test_rows_waiting_for_a_flush_never_reach_the_disk_in_part(tmp_path):
    # Far more than a file buffer (8 KiB) of rows between two flushes: what a crash leaves is whole rows.
    path = tmp_path / "requests.csv"
    writer = RequestCsvWriter(path, flush_seconds=3600.0)
    for i in range(200):
        writer.write(metrics(f"r{i}"))
        assert path.read_bytes().endswith(b"\n")
    assert _ids_on_disk(path) == []
    writer.flush()
    assert _ids_on_disk(path) == [f"r{i}" for i in range(200)] and path.read_bytes().endswith(b"\r\n")
    writer.close()


def test_a_write_the_disk_refuses_cuts_the_file_back_to_its_last_complete_row(tmp_path, monkeypatch):
    path = tmp_path / "requests.csv"
    writer = RequestCsvWriter(path, flush_seconds=0.0)
    writer.write(metrics("a"))
    writer.write(metrics("b"))
    kept = path.read_bytes()
    real_write = os.write

    def full_disk(fd, data):  # takes 10 bytes of the row, then the disk is full
        if full_disk.room:
            full_disk.room = 0
            return real_write(fd, bytes(data[:10]))
        raise OSError(errno.ENOSPC, "No space left on device")

    full_disk.room = 10
    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(FileWriteError) as error:
        writer.write(metrics("c"))
    assert str(error.value) == (f"cannot write {path} (it ends at its last complete row, 2 rows; 1 more not written): "
                                "no space left on device: free space on that file system, or give --output a "
                                "directory on another one")
    assert path.read_bytes() == kept
    writer.close()  # nothing more to write: no second error
    assert _ids_on_disk(path) == ["a", "b"]


def test_a_last_row_cut_short_is_left_out_where_allowed_and_named_by_file_and_line(tmp_path):
    path = tmp_path / "requests.csv"
    with RequestCsvWriter(path) as writer:
        for name in "abc":
            writer.write(metrics(name))
    path.write_bytes(path.read_bytes()[:-30])  # the last row loses its end, as a killed writer's could
    report = read_report(path, allow_cut=True)
    assert [row["request_id"] for row in report.rows] == ["a", "b"] and report.cut_line == 4
    assert report.cut_note(path) == (f"{path} line 4 is cut short (the run was killed or its disk filled while "
                                     "writing it): that row is left out")
    with pytest.raises(KvtoolError, match=rf"report {path} line 4 is cut short or damaged \("):
        read_csv(path)


def test_a_row_with_the_wrong_number_of_cells_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "summary.csv"
    path.write_text("label,ttft_ms_mean\r\na,1\r\nb,2,3\r\nc,4\r\n")
    for allow_cut in (False, True):
        with pytest.raises(KvtoolError, match=rf"report {path} line 3 is cut short or damaged \(3 cells where the "
                                              r"header has 2\)"):
            read_report(path, allow_cut=allow_cut)
    path.write_text("label,ttft_ms_mean\na,1")  # complete, but without its line end: cut or not, nobody can tell
    assert read_report(path, allow_cut=True) == ([], 2)
