"""--mode trace replays each request at its recorded arrival time (offsets from the first, times
--time_scale), in-process, simulated and against an endpoint; a dataset without arrival times, or
a contradicting flag, is a one-line error before anything runs."""

from __future__ import annotations

import csv
import json

import pytest
from serve_helpers import running_server, tiny_llm
from test_replay import Harness, dataset_of, index, req
from trace_data import mooncake_slice
from typer.testing import CliRunner

from kvtool import KvCacheConfig
from kvtool.bench.replay import check_arrival_times
from kvtool.config import ReplayOptions
from kvtool.flags import as_row, configs
from kvtool.workloads.requests import dataset_requests
from kvtool.cli import app
from kvtool.errors import DatasetError


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def read_rows(path):
    with open(path, newline="") as source:
        return list(csv.DictReader(source))


def test_trace_mode_issues_each_request_at_its_offset_from_the_first(tmp_path):
    h = Harness(ReplayOptions(mode="trace"))
    start = h.run(dataset_of(tmp_path, [req([11] * 4, arrival_time_s=100.0), req([12] * 4, arrival_time_s=100.5),
                                        req([13] * 40, arrival_time_s=100.001), req([14] * 4, arrival_time_s=101.25)]))
    arrivals = {index(f): f.arrival_time - start for f in h.finished}
    assert arrivals == pytest.approx({0: 0.0, 1: 0.5, 2: 0.001, 3: 1.25})
    for done in h.finished:  # no request reaches the engine before it is due
        assert h.engine.add_times[done.request_id] >= done.arrival_time - 1e-12
    assert h.engine.max_in_engine == 2  # no in-flight limit: the second came while the first (40 tokens) ran


@pytest.mark.parametrize("time_scale", [0.5, 2.0])
def test_time_scale_multiplies_the_offsets(tmp_path, time_scale):
    h = Harness(ReplayOptions(mode="trace", time_scale=time_scale))
    start = h.run(dataset_of(tmp_path, [req([11] * 4, arrival_time_s=3.0), req([12] * 4, arrival_time_s=4.0),
                                        req([13] * 4, arrival_time_s=7.0)]))
    arrivals = sorted(f.arrival_time - start for f in h.finished)
    assert arrivals == pytest.approx([0.0, 1.0 * time_scale, 4.0 * time_scale])


def test_offline_replays_arrival_times_as_offsets_from_the_start_scaled(tmp_path):
    h = Harness(ReplayOptions(time_scale=0.5))
    start = h.run(dataset_of(tmp_path, [req([11] * 4, arrival_time_s=2.0), req([12] * 4)]))
    assert {index(f): f.arrival_time - start for f in h.finished} == pytest.approx({0: 1.0, 1: 0.0})


def test_trace_mode_with_concurrency_keeps_the_due_time_as_arrival(tmp_path):
    h = Harness(ReplayOptions(mode="trace", concurrency=1))
    start = h.run(dataset_of(tmp_path, [req([11] * 40, arrival_time_s=0.0), req([12] * 4, arrival_time_s=0.001)]))
    second = next(f for f in h.finished if index(f) == 1)
    assert second.arrival_time - start == pytest.approx(0.001)  # queueing behind the first counts in its TTFT
    assert h.engine.add_times[second.request_id] > second.arrival_time + 0.04
    assert h.engine.max_in_engine == 1


def test_trace_mode_needs_an_arrival_time_on_every_request_not_waiting_for_a_turn(tmp_path):
    dataset = dataset_of(tmp_path, [
        {"session_id": "a", "turn": 0, "input_ids": [5] * 4, "output_tokens": 1, "arrival_time_s": 0.5},
        {"session_id": "a", "turn": 1, "input_ids": [6] * 4, "output_tokens": 1},  # follows turn 0
        req([7] * 4), req([8] * 4, arrival_time_s=1.0)])
    requests = dataset_requests(dataset, tokenizer=None)
    def check(options: ReplayOptions):
        warmup, measured = options.split(requests)
        check_arrival_times(options, measured)
        return warmup, measured

    with pytest.raises(DatasetError, match=rf"{dataset.path} line 3: no arrival_time_s, but --mode trace replays each "
                                           "request at its arrival time"):
        check(ReplayOptions(mode="trace"))
    # Warm-up runs untimed: only the measured requests need a time.
    warmup, measured = check(ReplayOptions(mode="trace", warmup=3))
    assert len(warmup) == 3 and len(measured) == 1
    # A later turn whose previous turn is measured waits for it; alone in the run, it needs a time.
    with pytest.raises(DatasetError, match="line 2: no arrival_time_s"):
        check(ReplayOptions(mode="trace", warmup=1))
    # A time scale needs times to scale.
    with pytest.raises(DatasetError, match="--time_scale 0.5 scales the dataset's arrival_time_s, but no measured "
                                           "request has one"):
        check(ReplayOptions(time_scale=0.5, warmup=2, num_requests=1))


@pytest.mark.parametrize("flags, message", [
    ({"mode": "trace", "request_rate": 2.0}, "--mode trace replays the dataset's arrival times; it contradicts "
                                             "request_rate 2.0: drop one of them"),
    ({"time_scale": 0}, "--time_scale must be a number > 0 (0.5 replays twice as fast, 2 half as fast), got 0"),
    ({"time_scale": float("inf")}, "--time_scale must be a number > 0"),
    ({"time_scale": 2, "request_rate": 1.0}, "--time_scale scales the dataset's arrival times, but request_rate 1.0 "
                                             "draws its own"),
    ({"mode": "replay"}, "--mode 'replay' is unknown: use one of ['offline', 'sequential', 'trace']"),
])
def test_contradicting_replay_flags_name_the_flag(flags, message):
    with pytest.raises(ValueError) as error:
        configs(flags)
    assert message in str(error.value)


def test_the_summary_records_the_mode_and_time_scale():
    engine, replay = configs({"mode": "Trace", "time_scale": 0.25, "concurrency": 4})
    row = as_row(engine, replay)
    assert (row["mode"], row["time_scale"], replay.describe()) == ("trace", 0.25, "trace,concurrency=4,"
                                                                                          "time_scale=0.25")


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    """40 requests of the conversation trace, shrunk for tiny models: (dataset, raw rows)."""
    directory = tmp_path_factory.mktemp("trace")
    raw = mooncake_slice(directory, 40, start=2000)
    out = directory / "small.jsonl"
    result = invoke("dataset", "import", raw, "--format", "mooncake", "--output", out, "--shrink", 64,
                    "--vocab_size", 256, "--max_output_tokens", 2)
    assert result.exit_code == 0, result.output
    return out, [json.loads(line) for line in raw.read_text().splitlines()]


def expected_arrivals(rows, time_scale):
    first = min(row["timestamp"] for row in rows)
    return [(row["timestamp"] - first) / 1000 * time_scale for row in rows]


def test_simulate_replays_an_imported_trace_on_its_clock(small_trace, tmp_path):
    dataset, rows = small_trace
    result = invoke("simulate", "--model", "preset:tiny-llama", "--profile", "h100", "--dataset", dataset,
                    "--mode", "trace", "--time_scale", 0.1, "--output", tmp_path / "sim")
    assert result.exit_code == 0, result.output
    requests = sorted(read_rows(tmp_path / "sim" / "requests.csv"), key=lambda r: int(r["request_id"]))
    assert [float(r["arrival_s"]) for r in requests] == pytest.approx(expected_arrivals(rows, 0.1), abs=1e-9)
    [summary] = read_rows(tmp_path / "sim" / "summary.csv")
    assert (summary["mode"], summary["time_scale"], summary["replay"]) == ("trace", "0.1", "trace,time_scale=0.1")


def test_bench_and_an_endpoint_send_each_request_when_due(small_trace, tiny_llama_plan, tmp_path):
    dataset, rows = small_trace
    rows, lines = rows[:8], dataset.read_text().splitlines()[:8]
    (tmp_path / "eight.jsonl").write_text("\n".join(lines) + "\n")
    expected = expected_arrivals(rows, 0.02)
    result = invoke("bench", "--plan", tiny_llama_plan, "--dataset", tmp_path / "eight.jsonl", "--mode", "trace",
                    "--time_scale", 0.02, "--output", tmp_path / "local")
    assert result.exit_code == 0, result.output
    local = sorted(read_rows(tmp_path / "local" / "requests.csv"), key=lambda r: int(r["request_id"]))
    assert [float(r["arrival_s"]) for r in local] == pytest.approx(expected, abs=1e-9)
    with running_server(tiny_llm(tiny_llama_plan, kv_cache_config=KvCacheConfig(max_tokens=4096))) as server:
        result = invoke("bench", "--endpoint", server.url, "--dataset", tmp_path / "eight.jsonl", "--mode", "trace",
                        "--time_scale", 0.02, "--output", tmp_path / "served")
    assert result.exit_code == 0, result.output
    served = sorted(read_rows(tmp_path / "served" / "requests.csv"), key=lambda r: int(r["request_id"]))
    # Sent when due (the client wakes every few ms), and TTFT counts from the due time.
    assert [float(r["arrival_s"]) for r in served] == pytest.approx(expected, abs=1e-3)
    assert all(not r["error"] and float(r["ttft_ms"]) > 0 for r in served)


def test_a_dataset_without_arrival_times_is_a_one_line_error_in_trace_mode(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(req([5] * 8)) + "\n")
    result = invoke("simulate", "--model", "preset:tiny-llama", "--profile", "h100", "--dataset", data, "--mode",
                    "trace", "--output", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert f"{data} line 1: no arrival_time_s, but --mode trace replays" in " ".join(result.output.split())
