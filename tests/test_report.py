"""CSV reports: rows on disk as soon as written, atomic summaries, round trips."""

from __future__ import annotations

import csv
import os

import pytest

from kvtool.bench.datasets import DatasetRecord
from kvtool.bench.metrics import CSV_COLUMNS, MISS_COLUMNS, request_metrics
from kvtool.bench.report import (
    RequestCsvWriter,
    format_cell,
    output_paths,
    read_csv,
    request_metrics_from_row,
    write_summary_csv,
)
from kvtool.errors import KvtoolError
from kvtool.runtime.request import Request

EXPECTED_COLUMNS = ["label", "engine", "request_id", "session_id", "turn", "input_tokens", "output_tokens", "reused_tokens",
                    "onboarded_blocks", "arrival_s", "first_token_s", "finish_s", "ttft_ms", "tpot_ms", "itl_ms",
                    "e2e_ms", "error", "endpoint", "missed_blocks", "missed_never_seen_blocks",
                    "missed_evicted_primary_blocks", "missed_evicted_host_blocks", "missed_identity_blocks",
                    "missed_partial_blocks", "missed_last_token_blocks", "missed_reuse_off_blocks"]


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
