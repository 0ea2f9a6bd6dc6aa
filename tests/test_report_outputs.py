"""What bench reports beyond its defaults: --percentiles, token throughputs, --slo goodput, --report_json.

Figures are checked against hand-computed ones and against numpy's percentiles (an independent
reference); the CLI tests check the summary CSV, the end-of-run table and the JSON against each
other and against the per-request CSV.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import yaml
from test_cli_bench import fake_llms, invoke, read_rows  # noqa: F401 - a fixture
from test_metrics import record

from kvtool.workloads.datasets import write_jsonl
from kvtool.reports.metrics import (PERCENTILES, SummaryOptions, parse_percentiles, percentile_name, request_metrics,
                                  summarize)
from kvtool.reports.csv_report import format_cell
from kvtool.reports.slo import Slo, parse_slo


@pytest.fixture
def dataset(tmp_path):
    prefix = list(range(100, 132))
    return write_jsonl(tmp_path / "shared.jsonl", [{"input_ids": prefix + [10 + i] * (4 + i),
                                                    "output_tokens": 2 + i % 3} for i in range(12)])


# -- percentiles ----------------------------------------------------------------------------------

def test_percentiles_flag_adds_to_the_defaults_in_ascending_order():
    assert parse_percentiles("99.9,95") == (50, 90, 95, 99, 99.9)
    assert parse_percentiles("50, 99") == PERCENTILES
    assert parse_percentiles("0,100") == (0, 50, 90, 99, 100)
    assert [percentile_name(q) for q in (50, 99.9, 99.99, 0.5)] == ["p50", "p99.9", "p99.99", "p0.5"]


@pytest.mark.parametrize("text", ["abc", "101", "-1", "95,,99", "", "nan"])
def test_a_bad_percentile_names_the_flag(text):
    with pytest.raises(ValueError, match=r"--percentiles .*numbers from 0 to 100"):
        parse_percentiles(text)


def test_every_asked_percentile_is_numpys_linear_percentile():
    ttfts = [3.0, 1.0, 40.0, 7.5, 12.0, 2.5, 90.0, 5.0, 6.0, 11.0]
    requests = [request_metrics(record(float(i), [i + t / 1000, i + t / 1000 + 0.01]), label="v", bench_start=0.0)
                for i, t in enumerate(ttfts)]
    row = summarize(requests, SummaryOptions(percentiles=parse_percentiles("95,99.9,25"))).as_row()
    for q in (25, 50, 90, 95, 99, 99.9):
        assert row[f"ttft_ms_{percentile_name(q)}"] == pytest.approx(float(np.percentile(ttfts, q)))
    ttft_columns = [column for column in row if column.startswith("ttft_ms_")]
    assert ttft_columns == ["ttft_ms_mean", "ttft_ms_p25", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p95",
                            "ttft_ms_p99", "ttft_ms_p99.9"]


def test_default_summary_columns_are_unchanged_but_for_the_new_throughputs():
    row = summarize([request_metrics(record(0.0, [0.1, 0.2]), label="v", bench_start=0.0)]).as_row()
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert [c for c in row if c.startswith(metric)] == [f"{metric}_{s}" for s in ("mean", "p50", "p90", "p99")]
    assert "slo_attainment" not in row and "goodput_requests_per_s" not in row


# -- throughput -----------------------------------------------------------------------------------

def test_input_and_total_token_throughput_by_hand():
    requests = [request_metrics(record(0.0, [0.1, 0.2, 0.3], prompt=100, name="a"), label="v", bench_start=0.0),
                request_metrics(record(0.5, [0.8, 2.0], prompt=50, name="b"), label="v", bench_start=0.0),
                request_metrics(record(0.2, [], prompt=7, error="refused", finish_reason="error", name="c"),
                                label="v", bench_start=0.0)]
    summary = summarize(requests)
    # 2 s from the first arrival to the last finish; the failed request's 7 tokens do not count.
    assert summary.input_tokens_per_s == pytest.approx(150 / 2.0)
    assert summary.output_tokens_per_s == pytest.approx(5 / 2.0)
    assert summary.total_tokens_per_s == pytest.approx(155 / 2.0)


# -- SLO and goodput ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, slo", [
    ("ttft=500ms,tpot=50ms", Slo(ttft_ms=500, tpot_ms=50)),
    ("e2e=2s", Slo(e2e_ms=2000)),
    ("TTFT=0.25s, e2e=1500", Slo(ttft_ms=250, e2e_ms=1500)),
    ("ttft:500,tpot:50", Slo(ttft_ms=500, tpot_ms=50)),      # vLLM's --goodput spelling (ms)
    ("e2el=3s", Slo(e2e_ms=3000)),
])
def test_slo_strings(text, slo):
    assert parse_slo(text) == slo


@pytest.mark.parametrize("text, message", [
    ("ttft", "'ttft' is not an objective"),
    ("latency=5ms", "'latency=5ms' is not an objective"),
    ("ttft=fast", "'fast' is not a time for ttft"),
    ("ttft=5min", "'5min' is not a time for ttft"),
    ("ttft=-5ms", "'-5ms' is not a time for ttft"),
    ("ttft=0ms", "must be a positive"),
    ("ttft=1ms,ttft=2ms", "ttft is given twice"),
    ("", "'' is not an objective"),
])
def test_a_bad_slo_names_the_flag_and_the_expected_form(text, message):
    with pytest.raises(ValueError, match="--slo") as error:
        parse_slo(text)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_goodput_counts_requests_meeting_every_objective_by_hand():
    # TTFT 100, 300, 500 ms; TPOT 100, 200, - (one token); plus one failed request.
    requests = [request_metrics(record(0.0, [0.1, 0.2, 0.3], name="a"), label="v", bench_start=0.0),
                request_metrics(record(0.5, [0.8, 1.0], name="b"), label="v", bench_start=0.0),
                request_metrics(record(1.0, [1.5], name="c"), label="v", bench_start=0.0),
                request_metrics(record(0.2, [], error="refused", finish_reason="error", name="d"), label="v",
                                bench_start=0.0)]
    duration = 1.5
    cases = {
        "ttft=350ms": 2,              # a, b
        "ttft=350ms,tpot=150ms": 1,   # a (b's TPOT is 200)
        "tpot=150ms": 2,              # a, and c: one token has no TPOT to miss
        "e2e=0.4s": 1,                # a (300 ms); b and c took 500
        "ttft=1ms": 0,
    }
    for text, num_met in cases.items():
        summary = summarize(requests, SummaryOptions(slo=parse_slo(text)))
        assert summary.slo_attainment == pytest.approx(num_met / 4), text   # the failed request counts, unmet
        assert summary.goodput_requests_per_s == pytest.approx(num_met / duration), text


# -- the CLI --------------------------------------------------------------------------------------

def _table_value(output: str, name: str) -> str:
    """The cell after ``name`` in the printed table (one variant)."""
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.split("│")]
        if len(cells) > 2 and cells[1] == name:
            return cells[2]
    raise AssertionError(f"{name!r} is not a row of the table:\n{output}")


def test_bench_reports_percentiles_throughputs_and_goodput_in_csv_table_and_json(tmp_path, dataset, fake_llms):  # noqa: F811 - fake_llms is the fixture
    out = tmp_path / "run"
    # A TTFT bound that some requests meet and some miss: the middle one of a first run's TTFTs (a value
    # the CSV wrote, so the summary's slo_ttft_ms holds it exactly; an even count's median may not).
    assert invoke("bench", "--model", "preset:tiny-llama", "--dataset", dataset, "--output", tmp_path / "probe",
                  "--concurrency", 3).exit_code == 0
    probe_ttfts = sorted(float(r["ttft_ms"]) for r in read_rows(tmp_path / "probe" / "requests.csv"))
    bound = probe_ttfts[len(probe_ttfts) // 2 - 1]
    result = invoke("bench", "--model", "preset:tiny-llama", "--dataset", dataset, "--output", out,
                    "--concurrency", 3, "--percentiles", "95,99.9", "--slo", f"ttft={bound}ms,tpot=1s",
                    "--report_json", out / "report.json")
    assert result.exit_code == 0, result.output
    (summary,) = read_rows(out / "summary.csv")
    requests = read_rows(out / "requests.csv")

    # Percentiles: the CSV's against numpy on the per-request CSV, the table's against the CSV.
    ttfts = [float(r["ttft_ms"]) for r in requests]
    for q, name in ((95, "p95"), (99.9, "p99.9"), (50, "p50")):
        assert float(summary[f"ttft_ms_{name}"]) == pytest.approx(float(np.percentile(ttfts, q)), abs=1e-5)
        assert _table_value(result.output, f"TTFT {name} (ms)") == f"{float(summary[f'ttft_ms_{name}']):,.2f}"
    assert "e2e_ms_p99.9" in summary and "itl_ms_p95" in summary

    # Throughputs over last finish - first arrival (the CSV's times are rounded to the µs).
    duration = float(summary["duration_s"])
    assert duration == pytest.approx(max(float(r["finish_s"]) for r in requests) -
                                     min(float(r["arrival_s"]) for r in requests), abs=2e-6)
    num_input = sum(int(r["input_tokens"]) for r in requests)
    num_output = sum(int(r["output_tokens"]) for r in requests)
    input_rate, output_rate = float(summary["input_tokens_per_s"]), float(summary["output_tokens_per_s"])
    assert input_rate == pytest.approx(num_input / duration, rel=1e-2)     # a fake run lasts a few ms
    assert input_rate / output_rate == pytest.approx(num_input / num_output, rel=1e-5)
    assert float(summary["total_tokens_per_s"]) == pytest.approx(input_rate + output_rate, rel=1e-5)
    assert _table_value(result.output, "total tokens/s") == f"{float(summary['total_tokens_per_s']):,.2f}"

    # Goodput: recounted from the per-request rows.
    met = [r for r in requests if float(r["ttft_ms"]) <= bound and (r["tpot_ms"] == "" or float(r["tpot_ms"]) <= 1000)]
    assert 0 < len(met) < len(requests)
    assert float(summary["slo_attainment"]) == pytest.approx(len(met) / len(requests))
    assert float(summary["goodput_requests_per_s"]) == pytest.approx(
        float(summary["requests_per_s"]) * len(met) / len(requests), rel=1e-5)
    assert float(summary["slo_ttft_ms"]) == pytest.approx(bound) and float(summary["slo_tpot_ms"]) == 1000
    goodput_line = next(line for line in result.output.splitlines() if "met the SLO" in line)
    assert f"TTFT ≤ {bound:g} ms, TPOT ≤ 1000 ms" in goodput_line
    assert f"{float(summary['slo_attainment']):.1%}" in goodput_line

    # JSON: every summary column, with the CSV's value; vLLM's keys for the same figures.
    document = json.loads((out / "report.json").read_text())
    assert str(out / 'report.json') in result.output.replace("\n", "")
    assert document["command"] == "kvtool bench"
    assert document["percentiles"] == [50, 90, 95, 99, 99.9]
    assert document["slo"] == {"ttft_ms": pytest.approx(bound), "tpot_ms": 1000.0}
    (variant,) = document["variants"]
    assert list(variant["summary"]) == list(summary)
    for column, text in summary.items():
        assert format_cell(variant["summary"][column]) == text, column
    vllm = variant["vllm"]
    assert vllm["completed"] == len(requests) and vllm["failed"] == 0
    for key, column in (("request_throughput", "requests_per_s"), ("request_goodput", "goodput_requests_per_s"),
                        ("total_token_throughput", "total_tokens_per_s"), ("median_ttft_ms", "ttft_ms_p50"),
                        ("p99.9_e2el_ms", "e2e_ms_p99.9"), ("mean_tpot_ms", "tpot_ms_mean")):
        assert format_cell(vllm[key]) == summary[column], key


def test_a_scenario_json_has_a_variant_per_label_with_its_runs(tmp_path, dataset, fake_llms):  # noqa: F811 - fake_llms is the fixture
    scenario = tmp_path / "reuse.yaml"
    scenario.write_text(yaml.safe_dump({"name": "reuse", "dataset": {"path": str(dataset)}, "repeat": 2,
                                        "model": "preset:tiny-llama",
                                        "sweep": [{"label": "on", "enable_kv_cache_reuse": True},
                                                  {"label": "off", "enable_kv_cache_reuse": False}]}))
    result = invoke("bench", "--config", scenario, "--output", tmp_path / "out", "--report_json",
                    tmp_path / "out.json", "--slo", "e2e=10s")
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "out.json").read_text())
    assert [v["label"] for v in document["variants"]] == ["on", "off"]
    rows = read_rows(tmp_path / "out" / "summary.csv")
    for variant in document["variants"]:
        runs = [row for row in rows if row["label"] == variant["label"]]
        assert variant["num_runs"] == 2 and len(variant["runs"]) == 2
        assert [format_cell(run["ttft_ms_p50"]) for run in variant["runs"]] == [run["ttft_ms_p50"] for run in runs]
        assert variant["summary"]["ttft_ms_p50"] == pytest.approx(float(np.median([float(r["ttft_ms_p50"])
                                                                                   for r in runs])))
        assert variant["summary"]["slo_attainment"] == 1.0


@pytest.mark.parametrize("args, message", [
    (["--slo", "ttft<500ms"], "--slo 'ttft<500ms': 'ttft<500ms' is not an objective: expected NAME=VALUE[ms|s]"),
    (["--slo", "ttft=5 minutes"], "--slo 'ttft=5 minutes': '5 minutes' is not a time for ttft"),
    (["--percentiles", "99,999"], "--percentiles '99,999': '999' is not a percentile"),
    (["--report_json", "."], "--report_json . is a directory: give a file path"),
])
def test_bad_reporting_flags_exit_2_with_one_line_before_anything_runs(tmp_path, dataset, fake_llms, args, message):  # noqa: F811 - fake_llms is the fixture
    result = invoke("bench", "--model", "preset:tiny-llama", "--dataset", dataset, "--output", tmp_path / "out",
                    *args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() and not fake_llms


def test_compare_shows_the_extra_percentiles_of_one_report_beside_a_default_one(tmp_path, dataset, fake_llms):  # noqa: F811 - fake_llms is the fixture
    assert invoke("bench", "--model", "preset:tiny-llama", "--dataset", dataset, "--output", tmp_path / "a",
                  "--label", "default").exit_code == 0
    assert invoke("bench", "--model", "preset:tiny-llama", "--dataset", dataset, "--output", tmp_path / "b",
                  "--label", "more", "--percentiles", "99.9,95", "--slo", "ttft=1s").exit_code == 0
    result = invoke("compare", tmp_path / "a" / "summary.csv", tmp_path / "b" / "summary.csv", "--output",
                    tmp_path / "compare.csv")
    assert result.exit_code == 0, result.output
    names = [line.split("│")[1].strip() for line in result.output.splitlines() if line.count("│") > 2]
    assert names.index("TTFT p90 (ms)") < names.index("TTFT p95 (ms)") < names.index("TTFT p99 (ms)") \
        < names.index("TTFT p99.9 (ms)") < names.index("TPOT mean (ms)")
    assert {"input tokens/s", "total tokens/s", "met the SLO", "goodput (requests/s)"} <= set(names)
    p999 = next(line for line in result.output.splitlines() if "TTFT p99.9 (ms)" in line)
    assert p999.split("│")[2].strip() == "-"     # the default report has no p99.9
    with open(tmp_path / "compare.csv", newline="") as f:
        metrics = {row["metric"]: row for row in csv.DictReader(f)}
    (more,) = read_rows(tmp_path / "b" / "summary.csv")
    assert float(metrics["ttft_ms_p99.9"]["more"]) == pytest.approx(float(more["ttft_ms_p99.9"]))
    assert metrics["ttft_ms_p99.9"]["default"] == ""


def test_simulate_shares_the_reporting_flags(tmp_path, tiny_llama_plan, dataset):
    out = tmp_path / "sim"
    result = invoke("simulate", "--plan", tiny_llama_plan, "--dataset", dataset, "--profile", "h100", "--output", out,
                    "--percentiles", "99.9", "--slo", "ttft=1s", "--report_json", tmp_path / "sim.json")
    assert result.exit_code == 0, result.output
    (summary,) = read_rows(out / "summary.csv")
    assert summary["simulated"] == "True" and "ttft_ms_p99.9" in summary
    document = json.loads((tmp_path / "sim.json").read_text())
    assert document["command"] == "kvtool simulate"
    assert document["variants"][0]["summary"]["slo_attainment"] == float(summary["slo_attainment"])
    assert format_cell(document["variants"][0]["vllm"]["p99.9_ttft_ms"]) == summary["ttft_ms_p99.9"]


def test_a_report_that_cannot_be_written_is_one_error_after_the_csvs(tmp_path, dataset, fake_llms, monkeypatch):  # noqa: F811 - fake_llms is the fixture
    from kvtool.reports import json_report

    def full_disk(path, document):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(json_report, "write_report_json", full_disk)
    out = tmp_path / "run"
    result = invoke("bench", "--model", "preset:tiny-llama", "--dataset", dataset, "--output", out,
                    "--report_json", tmp_path / "run.json")
    assert result.exit_code == 2
    output = result.output.replace("\n", "")
    assert f"wrote {out / 'summary.csv'}" in output
    assert f"Error: {tmp_path / 'run.json'}: no space left on device" in output
    assert read_rows(out / "summary.csv")[0]["num_requests"] == "12"
