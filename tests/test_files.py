"""Files kvtool writes atomically get the permissions the umask gives, like any other new file."""

from __future__ import annotations

import errno
import os
import stat

import pytest
from typer.testing import CliRunner

from kvtool.workloads.datasets import write_jsonl
from kvtool.reports.csv_report import write_summary_csv
from kvtool.cli import app
from kvtool.files import FileWriteError, atomic_write
from kvtool.plan import BuildOptions, build_plan


@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_reports_and_datasets_are_readable_as_the_umask_allows(tmp_path, umask):
    summary = write_summary_csv(tmp_path / "summary.csv", [{"label": "a", "ttft_ms_mean": 1.0}])
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1], "output_tokens": 1}])
    plain = tmp_path / "plain.txt"
    plain.write_text("x")  # what open() gives: the reference
    assert mode(summary) == mode(dataset) == mode(plain) == 0o666 & ~umask


def test_compare_csv_gets_the_umask_permissions(tmp_path, umask):
    summary = write_summary_csv(tmp_path / "summary.csv", [{"label": "a", "ttft_ms_mean": 1.0}])
    result = CliRunner().invoke(app, ["compare", str(summary), "--output", str(tmp_path / "cmp.csv")])
    assert result.exit_code == 0, result.output
    assert mode(tmp_path / "cmp.csv") == 0o666 & ~umask


def test_a_plan_directory_gets_the_umask_permissions(tmp_path, umask):
    plan = build_plan("preset:tiny-llama", tmp_path / "plan", BuildOptions(max_seq_len=64))
    reference = tmp_path / "made-by-mkdir"
    reference.mkdir()
    assert mode(plan) == mode(reference) == 0o777 & ~umask
    assert mode(plan / "plan.json") == 0o666 & ~umask


def test_an_interrupted_atomic_write_leaves_the_previous_file(tmp_path):
    target = tmp_path / "summary.csv"
    target.write_text("old\n")
    with pytest.raises(RuntimeError), atomic_write(target) as out:
        out.write("half")
        raise RuntimeError("killed")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.csv"]  # no temporary file left


def test_a_full_disk_names_the_file_keeps_the_previous_one_and_says_the_fix(tmp_path, monkeypatch):
    target = tmp_path / "summary.csv"
    target.write_text("old\n")

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(FileWriteError) as error:
        write_summary_csv(target, [{"label": "new"}])
    assert str(error.value) == (f"cannot write {target} (the previous file is kept): no space left on device: free "
                                "space on that file system, or give --output a directory on another one")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.csv"]  # no temporary file left
