"""`kvtool simulate` runs many engine steps per call in C++ (kvtool._core.StepSimulator) when every
request runs to its length. It must change nothing but the speed: on slices of the Mooncake
conversation trace, with eviction, host offload, chunked context and pauses, each request's row
(reuse, TTFT, token times, misses) and every counter of the summary equal what the same simulation
gives one step at a time from Python (CostModelExecutor.execute_step)."""

from __future__ import annotations

import csv

import pytest
from trace_data import mooncake_slice
from typer.testing import CliRunner

from kvtool import _core
from kvtool.cli import app
from kvtool.runtime.engine import Engine
from kvtool.simulate.cost_model import CostModel, step_shape
from kvtool.simulate.executor import CostModelExecutor

# Differ between any two runs: when the run started, and where its files went.
RUN_COLUMNS = {"started_at", "output_dir"}


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def read_rows(path):
    with open(path, newline="") as source:
        return list(csv.DictReader(source))


def simulate(dataset, output, *flags):
    result = invoke("simulate", "--model", "preset:qwen3-8b-128k", "--profile", "h100", "--dataset", dataset,
                    "--max_seq_len", 131072, "--enable_chunked_context", "--max_num_tokens", 4096,
                    "--output", output, *flags)
    assert result.exit_code == 0, result.output
    requests = read_rows(output / "requests.csv")
    [summary] = read_rows(output / "summary.csv")
    return requests, {key: value for key, value in summary.items() if key not in RUN_COLUMNS}


CASES = {
    # Timed arrivals 4 times faster than the trace's: a queue builds, steps mix chunks and decodes, the
    # pool evicts to the host cache and a session's next turn onboards its blocks from there.
    "trace": ("--mode", "trace", "--time_scale", 0.25, "--max_tokens_in_paged_kv_cache", 12_000,
              "--kv_host_cache_bytes", "32GiB"),
    # One at a time, in a pool that evicts.
    "sequential": ("--mode", "sequential", "--max_tokens_in_paged_kv_cache", 8_000),
    # Everything queued at once under max_utilization: requests are paused and resumed.
    "paused": ("--mode", "offline", "--scheduler_policy", "max_utilization", "--max_batch_size", 64,
               "--max_tokens_in_paged_kv_cache", 10_000),
}


@pytest.fixture(scope="module")
def trace_dataset(tmp_path_factory):
    """The trace's first 300 requests (100 s), prompts shrunk 16 times (a hash id: one block of 32 tokens)."""
    directory = tmp_path_factory.mktemp("trace")
    dataset = directory / "trace.jsonl"
    result = invoke("dataset", "import", mooncake_slice(directory, 300), "--format", "mooncake", "--output", dataset,
                    "--shrink", 16, "--max_output_tokens", 40)
    assert result.exit_code == 0, result.output
    return dataset


@pytest.mark.parametrize("name", list(CASES))
def test_steps_run_in_cpp_give_the_reports_of_steps_run_one_at_a_time(trace_dataset, tmp_path, monkeypatch, name):
    pauses = []  # (request id, times paused) of each finished request: no report shows them
    finish = Engine._finish
    monkeypatch.setattr(Engine, "_finish", lambda self, request, *args: (
        pauses.append((request.request_id, request.num_pauses)), finish(self, request, *args))[1])

    fast_rows, fast_summary = simulate(trace_dataset, tmp_path / "fast", *CASES[name])
    fast_pauses = pauses[:]
    pauses.clear()
    monkeypatch.delattr(CostModelExecutor, "run_steps")  # the engine then calls step() once per step
    slow_rows, slow_summary = simulate(trace_dataset, tmp_path / "slow", *CASES[name])

    assert fast_rows == slow_rows
    assert fast_summary == slow_summary
    assert fast_pauses == pauses
    # Each case does what it is there for.
    assert int(fast_summary["num_requests"]) == 300 and int(fast_summary["reused_blocks"]) > 0
    if name == "trace":
        assert int(fast_summary["onboarded_blocks"]) > 0
    if name == "sequential":
        assert int(fast_summary["evicted_blocks"]) > 0
    if name == "paused":
        assert sum(count for _, count in pauses) > 0


def two_requests() -> _core.Scheduler:
    scheduler = _core.Scheduler(_core.CacheConfig(tokens_per_block=4, num_primary_blocks=64),
                                _core.SchedulerConfig(max_batch_size=4, max_num_tokens=64))
    for request_id, prompt in enumerate(([10 + i for i in range(13)], [50 + i for i in range(7)])):
        scheduler.add_request(request_id, prompt, 3)
    return scheduler


def test_a_step_costs_what_the_cost_model_predicts_for_its_shape():
    coefficients = {"step": 1e-3, "context_row": 3e-5, "context_token": 7e-7, "context_cached_token": 1.1e-7,
                    "context_pair": 3e-12, "decode_row": 2e-5, "decode_kv_token": 9e-10, "copied_byte": 1e-11}
    cost_model = CostModel(device="cpu: test", coefficients=coefficients)
    expected = cost_model.predict(step_shape(two_requests().schedule().requests, [], 100))
    simulator = _core.StepSimulator(cost_model.step_costs(bytes_per_token=100), vocab_size=1000)
    steps = simulator.run(two_requests(), 0.0, 0.0)  # stops after the first step: the clock has reached 0
    assert steps.num_steps == 1 and steps.end_time == expected > 0
    assert [len(simulator.take_token_times(i)) for i in (0, 1)] == [1, 1]  # both prompts fit one step


def test_a_bad_step_simulator_is_a_value_error():
    with pytest.raises(ValueError, match="vocab_size"):
        _core.StepSimulator(_core.StepCosts(step=1.0), vocab_size=0)
    with pytest.raises(ValueError, match="finite"):
        _core.StepSimulator(_core.StepCosts(step=float("nan")), vocab_size=10)
