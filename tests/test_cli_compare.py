"""`kvtool compare`: side-by-side table with ratios, CSV export, the TTFT plot, and errors."""

from __future__ import annotations

import csv

import test_cli_bench
from test_cli_bench import read_rows
from typer.testing import CliRunner

from kvtool.reports.metrics import request_metrics
from kvtool.reports.csv_report import RequestCsvWriter, write_summary_csv
from kvtool.cli import app
from kvtool.runtime.request import Request

cli = CliRunner()
dataset, fake_llms = test_cli_bench.dataset, test_cli_bench.fake_llms  # fixtures: a dataset, kvtool.LLM faked


def invoke(*args):
    return cli.invoke(app, [str(a) for a in args], terminal_width=200)


def write_requests(path, label, ttfts_ms):
    with RequestCsvWriter(path) as writer:
        for i, ttft in enumerate(ttfts_ms):
            rec = Request([1] * 64, arrival_time=0.0, name=str(i))
            rec.token_times = [ttft / 1000, ttft / 1000 + 0.005]
            rec.output_token_ids = [1, 2]
            rec.first_token_time, rec.finish_time = rec.token_times[0], rec.token_times[-1]
            writer.write(request_metrics(rec, label=label, bench_start=0.0))
    return path


def test_compare_prints_variants_side_by_side_with_ratios(tmp_path):
    summary = write_summary_csv(tmp_path / "summary.csv", [
        {"label": "reuse-off", "ttft_ms_mean": 80.0, "num_requests": 4, "enable_kv_cache_reuse": False},
        {"label": "reuse-on", "ttft_ms_mean": 20.0, "num_requests": 4, "enable_kv_cache_reuse": True},
    ])
    result = invoke("compare", summary)
    assert result.exit_code == 0, result.output
    ttft_line = next(line for line in result.output.splitlines() if "TTFT mean" in line)
    assert "80" in ttft_line and "20" in ttft_line and "0.25x" in ttft_line
    assert "enable_kv_cache_reuse" in result.output


def test_compare_writes_the_table_as_csv_and_a_plot(tmp_path):
    off = write_requests(tmp_path / "off.csv", "off", [40.0, 50.0, 90.0])
    on = write_requests(tmp_path / "on.csv", "on", [10.0, 10.0, 25.0])
    table, plot = tmp_path / "cmp.csv", tmp_path / "ttft.png"
    result = invoke("compare", off, on, "--output", table, "--plot", plot)
    assert result.exit_code == 0, result.output
    with table.open() as f:
        rows = {row["metric"]: row for row in csv.DictReader(f)}
    assert float(rows["ttft_ms_mean"]["off"]) == 60.0 and float(rows["ttft_ms_mean"]["on"]) == 15.0
    assert float(rows["ttft_ms_mean"]["on / off"]) == 0.25
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert f"wrote {plot}" in result.output


def test_compare_errors_exit_2_without_traceback(tmp_path):
    result = invoke("compare", tmp_path / "none.csv")
    assert result.exit_code == 2 and "does not exist" in result.output and "Traceback" not in result.output
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    result = invoke("compare", tmp_path / "x.csv")
    assert result.exit_code == 2 and "neither a kvtool summary CSV" in result.output
    summary = write_summary_csv(tmp_path / "s.csv", [{"label": "a", "ttft_ms_mean": 1.0}])
    result = invoke("compare", summary, "--plot", tmp_path / "p.png")
    assert result.exit_code == 2 and "needs per-request data" in " ".join(result.output.split())
    assert invoke("compare").exit_code == 2  # no report given


def test_compare_says_what_differs_marks_cut_runs_and_judges_repeats(tmp_path):
    def row(label, repeat, ttft, **extra):
        return {"label": label, "repeat": repeat, "ttft_ms_mean": ttft, "ttft_ms_p50": ttft, "num_requests": 8,
                "num_errors": 0, "interrupted": False, "cache_hit_rate": 0.824, "dataset": "abab.jsonl",
                "dataset_sha256": "0123456789ab" * 4, "tokens_per_block": 32, "kv_primary_tokens": 576,
                "device": "cpu: test", **extra}

    rows = [row(label, r, base + r, kv_host_bytes=host)
            for r in range(1, 6) for label, base, host in (("no-host", 200.0, 0), ("host", 40.0, 1 << 26))]
    rows[-1]["interrupted"] = True
    summary = write_summary_csv(tmp_path / "summary.csv", rows)
    text = " ".join(invoke("compare", summary).output.split())
    assert ("same for all: dataset abab.jsonl (sha256 0123456789ab); block size 32 tokens; primary pool 576 "
            "tokens") in text
    assert "differs: host pool (no-host: off, host: 64.0 MiB)" in text
    assert "host (median of 5 runs) (1 of 5 runs interrupted)" in text
    hit_rate = next(line for line in invoke("compare", summary).output.splitlines() if "cache hit rate" in line)
    assert "82.4%" in hit_rate  # as the bench table shows it
    assert "TTFT p50: host is faster: 0.21x no-host (medians of 5 and 5 runs" in text and "p = 0.008" in text


# -- runs compared as a user makes them: kvtool bench without --label, then kvtool compare DIR DIR ----------

def bench_run(out, dataset, *flags):
    result = invoke("bench", "--model", "preset:tiny-llama", "--dataset", dataset, "--mode", "sequential",
                    "--output", out, *flags)
    assert result.exit_code == 0, result.output
    return out


def header_cells(output):
    """The table's column titles (the line under its top border)."""
    lines = output.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("┏"))
    return [cell.strip() for cell in lines[top + 1].strip("┃").split("┃")]


def test_two_runs_of_one_plan_differing_only_in_reuse_are_named_by_it(tmp_path, dataset, fake_llms):
    on = bench_run(tmp_path / "on", dataset, "--enable_kv_cache_reuse")
    off = bench_run(tmp_path / "off", dataset, "--disable_kv_cache_reuse")
    result = invoke("compare", on, off)
    assert result.exit_code == 0, result.output
    assert header_cells(result.output) == ["metric", "reuse on", "reuse off", "ratio"]
    assert "differs: --enable_kv_cache_reuse (on, off)" in result.output
    assert "ratios against reuse on" in result.output
    first_row = next(line for line in result.output.splitlines() if line.startswith("│"))
    assert first_row.split("│")[1].strip() == "--enable_kv_cache_reuse"  # heads the table
    # A label given with --label stays (the summary says where a label came from).
    named = bench_run(tmp_path / "named", dataset, "--disable_kv_cache_reuse", "--label", "tiny-llama")
    assert [read_rows(run / "summary.csv")[0]["label_source"] for run in (on, named)] == ["default", "--label"]
    assert header_cells(invoke("compare", on, named).output)[1:3] == ["reuse on", "tiny-llama (reuse off)"]
    named = bench_run(tmp_path / "named", dataset, "--disable_kv_cache_reuse", "--label", "baseline")
    assert header_cells(invoke("compare", on, off, named).output)[1:] == ["reuse on", "reuse off", "ratio", "baseline",
                                                                          "ratio"]


def test_four_runs_list_every_field_that_differs_and_are_named_by_the_fewest(tmp_path, dataset, fake_llms):
    runs = [bench_run(tmp_path / f"{reuse}-{host}", dataset, f"--{reuse}_kv_cache_reuse", "--kv_host_cache_bytes",
                      host, "--max_batch_size", 2 if host == "0" else 4)
            for reuse in ("enable", "disable") for host in ("0", "1GiB")]
    result = invoke("compare", *runs)
    assert result.exit_code == 0, result.output
    # The batch size follows the host cache here: it is named in `differs:`, but not needed in the names.
    assert header_cells(result.output)[1:] == ["reuse on, host off", "reuse on, host 1.0 GiB", "ratio",
                                               "reuse off, host off", "ratio", "reuse off, host 1.0 GiB", "ratio"]
    differs = [line for line in result.output.splitlines() if line.startswith("differs:")]
    assert differs == ["differs: --enable_kv_cache_reuse (on, on, off, off)",
                       "differs: --kv_host_cache_bytes (off, 1.0 GiB, off, 1.0 GiB)",
                       "differs: --max_batch_size (2, 4, 2, 4)"]


def compared_cut_short(run, name, num_rows):
    """`kvtool compare RUN` on a run without a summary: marked cut short, its figures from its rows."""
    result = invoke("compare", run)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"{name} (cut short, no summary)" in text
    assert (f"no summary row: the run was cut short (killed, or its disk filled) before writing one; its figures come "
            f"from the {num_rows:,} complete rows of {run / 'requests.csv'}") in text
    requests_line = next(line for line in result.output.splitlines() if line.startswith("│ requests "))
    assert f" {num_rows:,} " in requests_line
    return text


def test_a_run_directory_without_a_summary_is_shown_cut_short_and_a_cut_row_is_named(tmp_path, dataset, fake_llms):
    run = bench_run(tmp_path / "run", dataset)
    (run / "summary.csv").unlink()  # as `kill -9` leaves it, or a disk that filled up
    requests = run / "requests.csv"
    requests.write_bytes(requests.read_bytes()[:-20])  # and its last row only partly written
    text = compared_cut_short(run, "tiny-llama", 5)
    assert f"{requests} line 7 is cut short (the run was killed or its disk filled while writing it): that row is " \
           "left out" in text


def test_a_damaged_summary_is_refused_naming_its_line(tmp_path):
    summary = tmp_path / "summary.csv"
    summary.write_text("label,ttft_ms_mean\na,1\nb,2,7\n")
    result = invoke("compare", summary)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"report {summary} line 3 is cut short or damaged (3 cells where the header has 2)" in " ".join(
        result.output.split())
