"""A run that stops early keeps what it measured: SIGTERM as Ctrl-C, `kill -9`, a full disk.

The first tests run `kvtool bench` as a user does, in a subprocess on the tiny-llama plan, and signal
it once its first rows are on disk; the others fake the disk filling up or a signal arriving at a
chosen request, in process.
"""

from __future__ import annotations

import errno
import functools
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_explain
from test_cli_bench import FakeLlmFactory, invoke, read_rows
from test_cli_compare import compared_cut_short

from kvtool.bench import runner as bench_runner
from kvtool.workloads.datasets import write_jsonl
from kvtool.reports.metrics import CSV_COLUMNS
from kvtool.reports.csv_report import RequestCsvWriter

KVTOOL = str(Path(sys.executable).parent / "kvtool")
profile = test_explain.profile  # a fixture: a cost model file
# Far more than run before the signal: sequential, the tiny model runs ~2,000 a second on 2 cores, so the
# signal has ~6 s to land even when the test process gets little CPU beside the bench's threads.
NUM_REQUESTS = 12000


@pytest.fixture
def long_dataset(tmp_path):
    prefix = list(range(100, 148))
    return write_jsonl(tmp_path / "long.jsonl", [{"input_ids": prefix + [10 + i % 50] * 8, "output_tokens": 4}
                                                 for i in range(NUM_REQUESTS)])


def start_bench(plan, dataset, out, *extra, **popen):
    command = [KVTOOL, "bench", "--plan", str(plan), "--dataset", str(dataset), "--mode", "sequential",
               "--output", str(out), *map(str, extra)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "200", "PYTHONDONTWRITEBYTECODE": "1"}, **popen)


def wait_for_rows(process, path: Path, num_rows: int, timeout_s: float = 120.0) -> None:
    """Until ``path`` has num_rows rows besides its header (flushed within 0.1 s of finishing)."""
    deadline = time.monotonic() + timeout_s
    while not (path.is_file() and path.read_bytes().count(b"\n") > num_rows):
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, "no rows appeared"
        time.sleep(0.05)


def assert_whole_rows(path: Path) -> int:
    """Every line of the file ends and has every column; the number of rows."""
    data = path.read_bytes()
    assert data.endswith(b"\n"), f"{path} ends in a partial row: {data[-80:]!r}"
    lines = data.decode().splitlines()
    assert lines[0].split(",") == list(CSV_COLUMNS)
    assert all(len(line.split(",")) == len(CSV_COLUMNS) for line in lines[1:])
    return len(lines) - 1


def test_sigterm_mid_run_writes_the_summary_marked_interrupted_and_exits_143(tiny_llama_plan, long_dataset,
                                                                               tmp_path):
    out = tmp_path / "term"
    process = start_bench(tiny_llama_plan, long_dataset, out)
    wait_for_rows(process, out / "requests.csv", 3)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 143, output
    summary, = read_rows(out / "summary.csv")
    assert (summary["interrupted"], summary["interrupted_by"]) == ("True", "SIGTERM")
    num_rows = assert_whole_rows(out / "requests.csv")
    assert 3 <= int(summary["num_requests"]) == num_rows < NUM_REQUESTS
    text = " ".join(output.split())
    assert "interrupted (SIGTERM)" in text and "exit code 143" in text and "Traceback" not in text
    assert f"wrote {out / 'summary.csv'}" in text
    compared = " ".join(invoke("compare", out).output.split())
    assert "(interrupted by SIGTERM)" in compared


def test_kill_9_leaves_whole_rows_and_compare_and_explain_say_the_run_was_cut_short(tiny_llama_plan, long_dataset,
                                                                                   tmp_path):
    out = tmp_path / "killed"
    process = start_bench(tiny_llama_plan, long_dataset, out)
    wait_for_rows(process, out / "requests.csv", 20)
    process.kill()
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert not (out / "summary.csv").exists()
    num_rows = assert_whole_rows(out / "requests.csv")

    compared_cut_short(out, "tiny-llama", num_rows)

    explained = invoke("explain", out)
    assert explained.exit_code == 0, explained.output
    text = "".join(explained.output.split())  # (the screen may fold a long path anywhere)
    assert "therunwascutshort:nosummary.csv" in text
    assert f"Fromthe{num_rows:,}completerowsof{out / 'requests.csv'}" in text
    assert "What-ifsneedtherun'sconfiguration" in text


def limit_file_size(num_bytes: int):
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (num_bytes, num_bytes))
    return limit


def test_a_file_that_cannot_grow_is_named_ends_at_a_whole_row_and_the_summary_is_written(tiny_llama_plan,
                                                                                        long_dataset, tmp_path):
    # A per-process file size limit fails writes as a full disk does (part of a write, then an error),
    # without root: requests.csv reaches it; the summary (a few KiB) does not.
    out = tmp_path / "limited"
    process = start_bench(tiny_llama_plan, long_dataset, out, "--num_requests", 500,
                          preexec_fn=limit_file_size(24 << 10))
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 2, output
    text = " ".join(output.split())
    assert f"Error: cannot write {out / 'requests.csv'} (it ends at its last complete row, " in text
    assert "more not written): file too large: " in text and "(ulimit -f)" in text and "Traceback" not in text
    num_rows = assert_whole_rows(out / "requests.csv")
    summary, = read_rows(out / "summary.csv")
    assert summary["interrupted"] == "True" and summary["run_error"].startswith(f"cannot write {out / 'requests.csv'}")
    # Every request measured is in the summary, those the file could not take too.
    assert num_rows < int(summary["num_requests"]) < 500


# -- in process -------------------------------------------------------------------------------

def test_sigterm_in_a_simulation_writes_its_summary_and_exits_143(tiny_llama_plan, long_dataset, profile, tmp_path,
                                                                  monkeypatch):
    finished = []

    def terminate_at_the_fifth(*args, **kwargs):
        finished.append(1)
        if len(finished) == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return request_metrics(*args, **kwargs)

    request_metrics = bench_runner.request_metrics
    monkeypatch.setattr(bench_runner, "request_metrics", terminate_at_the_fifth)
    out = tmp_path / "sim"
    result = invoke("simulate", "--plan", tiny_llama_plan, "--dataset", long_dataset, "--profile", profile,
                    "--output", out)
    assert result.exit_code == 143, result.output
    summary, = read_rows(out / "summary.csv")
    assert (summary["interrupted"], summary["interrupted_by"], summary["simulated"]) == ("True", "SIGTERM", "True")
    assert 4 <= int(summary["num_requests"]) < NUM_REQUESTS
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # put back after the command


def test_a_full_disk_mid_run_keeps_whole_rows_names_both_files_and_shows_the_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_runner, "create_llm", FakeLlmFactory())
    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3, 4, 5], "output_tokens": 2}] * 40)
    room = {"bytes": 2000}  # the disk's free space: the header and a few rows

    real_write = os.write

    def write(fd, data):
        if room["bytes"] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        written = real_write(fd, bytes(data[:room["bytes"]]))  # part of a row, as a full disk writes
        room["bytes"] -= written
        return written

    def fsync(fd):  # the summary's flush to the disk: the disk is full by then
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)
    # Every row to the OS as it comes (fake requests finish within the 0.1 s a flush waits for).
    monkeypatch.setattr(bench_runner, "RequestCsvWriter", functools.partial(RequestCsvWriter, flush_seconds=0.0))
    out = tmp_path / "full"
    result = invoke("bench", "--model", "preset:x", "--dataset", data, "--output", out, "--mode", "sequential")
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert (f"Error: cannot write {out / 'requests.csv'} (it ends at its last complete row, ") in text
    assert f"nor {out / 'summary.csv'} (nothing written): no space left on device: free space on that file system, " \
           "or give --output a directory on another one" in text
    num_rows = assert_whole_rows(out / "requests.csv")
    assert 0 < num_rows < 40
    assert not (out / "summary.csv").exists() and os.listdir(out) == ["requests.csv"]  # no temporary file left
    assert "TTFT p50 (ms)" in text  # the figures are still on the screen
