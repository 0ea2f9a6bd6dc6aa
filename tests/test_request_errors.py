"""The failed requests a bench reports when it exits 3: counted, their errors grouped when they differ
only in numbers, most frequent first, a few shown."""

from __future__ import annotations

from kvtool.reports.metrics import CSV_COLUMNS
from kvtool.reports.csv_report import write_summary_csv
from kvtool.reports.request_errors import ErrorGroup, FailedRequests, failed_requests, group_errors


def test_errors_that_differ_only_in_numbers_are_one_group_led_by_the_first():
    groups = group_errors([
        "HTTP 503: overloaded",
        "HTTP 400: the prompt has 300 tokens and max_seq_len is 256",
        "HTTP 503: overloaded",
        "HTTP 400: the prompt has 312 tokens and max_seq_len is 256",
        "cannot connect to 127.0.0.1:8000",
        "HTTP 503: overloaded",
    ])
    assert groups == (ErrorGroup("HTTP 503: overloaded", 3),
                      ErrorGroup("HTTP 400: the prompt has 300 tokens and max_seq_len is 256", 2, varies=True),
                      ErrorGroup("cannot connect to 127.0.0.1:8000", 1))


def test_the_report_shows_the_count_and_a_few_errors_aligned():
    groups = group_errors([f"error kind {letter}" for letter in "abcdefg" for _ in range(ord(letter) - 96)])
    lines = FailedRequests(28, 300, groups).lines(limit=3)
    assert lines == ["28 of 300 requests failed; the most frequent errors:",
                     "  7 × error kind g", "  6 × error kind f", "  5 × error kind e",
                     "  ... and 4 other distinct errors (the error column of the requests CSV)"]


def rows_csv(path, errors):
    cells = {column: "" for column in CSV_COLUMNS}
    write_summary_csv(path, [{**cells, "request_id": str(i), "error": error or "", "finish_s": "" if error else "1.0"}
                             for i, error in enumerate(errors)])
    return path


def test_failed_requests_are_read_from_every_variant_and_none_without_errors(tmp_path):
    rows = [{"num_requests": 2, "num_errors": 1}, {"num_requests": 3, "num_errors": 2}]
    files = [rows_csv(tmp_path / "a.csv", [None, "boom", None]),
             rows_csv(tmp_path / "b.csv", ["boom", None, "HTTP 500: oops", None, None])]
    failed = failed_requests(rows, files)
    assert (failed.num_failed, failed.num_requests) == (3, 8)
    assert failed.groups == (ErrorGroup("boom", 2), ErrorGroup("HTTP 500: oops", 1))
    assert failed_requests([{"num_requests": 5, "num_errors": 0}], files) is None
