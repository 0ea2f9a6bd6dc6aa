"""Every path a user gives is checked before work starts; an OS error on it is one line naming the
path and the fix, exit code 2, never a traceback (build, bench, dataset, compare)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from bench_fakes import FakeLLM
from typer.testing import CliRunner

from kvtool.bench import runner as bench_runner
from kvtool.workloads.datasets import write_jsonl
from kvtool.reports.csv_report import write_summary_csv
from kvtool.cli import app

cli = CliRunner()


def invoke(*args):
    result = cli.invoke(app, [str(a) for a in args])
    result.text = " ".join(result.output.split())  # rich wraps long lines
    return result


def one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert [line for line in result.output.splitlines() if line.startswith("Error:")]
    for fragment in fragments:
        assert fragment in result.text, result.text


@pytest.fixture
def unwritable_dir(tmp_path) -> Path:
    """A directory no file can be created in: read-only permissions, or for root (which ignores
    them) a sysfs directory."""
    if os.geteuid() != 0:
        path = tmp_path / "read-only"
        path.mkdir()
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    sysfs = Path("/sys/kernel")
    try:
        (sysfs / "kvtool-probe").touch()
    except OSError:
        yield sysfs
        return
    pytest.skip("running as root without a read-only directory to try")


@pytest.fixture
def a_file(tmp_path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a directory\n")
    return path


@pytest.fixture
def dataset(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [5, 6, 7], "output_tokens": 2}])


@pytest.fixture
def no_llm(monkeypatch):
    """Fails the test if a bench gets as far as creating a model: paths are checked before."""
    def refuse(*args, **kwargs):
        raise AssertionError("the bench started before its output path was checked")

    monkeypatch.setattr(bench_runner, "create_llm", refuse)


def test_build_into_an_unwritable_directory(unwritable_dir, a_file):
    one_line_error(invoke("build", "--model", "preset:tiny-llama", "--output", unwritable_dir / "plan"),
                   f"--output {unwritable_dir / 'plan'}: cannot write in {unwritable_dir}",
                   "choose a directory you can write to")
    one_line_error(invoke("build", "--model", "preset:tiny-llama", "--output", a_file),
                   f"--output {a_file} is a file, not a directory")
    one_line_error(invoke("build", "--model", "preset:tiny-llama", "--output", a_file / "plan"),
                   f"{a_file} is a file, so no directory can be made under it")


@pytest.mark.parametrize("name", ["run", "summary.csv"])
def test_bench_output_is_checked_before_the_model_loads(unwritable_dir, a_file, dataset, no_llm, name):
    one_line_error(invoke("bench", "--model", "preset:tiny-llama", "--dataset", dataset, "--output",
                          unwritable_dir / name), f"--output {unwritable_dir / name}: cannot write in {unwritable_dir}")
    one_line_error(invoke("bench", "--model", "preset:tiny-llama", "--dataset", dataset, "--output", a_file / name),
                   f"{a_file} is a file, so no directory can be made under it")


def test_bench_scenario_output_is_checked_before_anything_runs(tmp_path, a_file, no_llm):
    config = tmp_path / "s.yaml"
    config.write_text("dataset: {generator: random, num_requests: 2, input_len: 8, output_len: 1}\n")
    one_line_error(invoke("bench", "--config", config, "--output", a_file), f"--output {a_file} is a file")


def test_dataset_output(unwritable_dir, a_file, tmp_path):
    one_line_error(invoke("dataset", "abab", "--output", unwritable_dir / "d.jsonl"),
                   f"--output {unwritable_dir / 'd.jsonl'}: cannot write in {unwritable_dir}")
    one_line_error(invoke("dataset", "random", "--output", a_file / "d.jsonl"), f"{a_file} is a file")
    one_line_error(invoke("dataset", "abab", "--output", tmp_path), f"--output {tmp_path} is a directory",
                   "dataset.jsonl")


def test_compare_plot_and_output(unwritable_dir, a_file, tmp_path):
    summary = write_summary_csv(tmp_path / "s.csv", [{"label": "a", "ttft_ms_mean": 1.0}])
    one_line_error(invoke("compare", summary, "--plot", unwritable_dir / "ttft.png"),
                   f"--plot {unwritable_dir / 'ttft.png'}: cannot write in {unwritable_dir}")
    one_line_error(invoke("compare", summary, "--output", a_file / "c.csv"), f"{a_file} is a file")


def test_binary_inputs_name_the_file(tmp_path):
    binary = tmp_path / "image.csv"
    binary.write_bytes(bytes(range(256)) * 4)
    one_line_error(invoke("compare", binary), f"report {binary} is not a UTF-8 text file")
    one_line_error(invoke("bench", "--model", "preset:tiny-llama", "--dataset", binary, "--output", tmp_path / "o"),
                   f"dataset {binary} is not a UTF-8 text file")
    one_line_error(invoke("bench", "--config", binary, "--output", tmp_path / "o"),
                   f"scenario {binary} is not a UTF-8 text file")


def test_an_os_error_during_the_work_is_one_line_naming_the_path(tmp_path, dataset, monkeypatch):
    """A read-only file system or a full disk found only when writing (after the checks)."""
    monkeypatch.setattr(bench_runner, "create_llm", lambda model, engine, replay, dataset, cache_dir=None: FakeLLM())

    def read_only(path, rows):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr("kvtool.cli.bench.write_summary_csv", read_only)
    result = invoke("bench", "--model", "preset:x", "--dataset", dataset, "--output", tmp_path / "o")
    one_line_error(result, f"{tmp_path / 'o' / 'summary.csv'}: read-only file system")
