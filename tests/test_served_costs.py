"""`kvtool calibrate --served` and `kvtool simulate --served`: what serving over HTTP adds to each step.

The arithmetic is checked against hand-computed times; the fit against latencies a simulation with known
served costs generated (it must find those costs again); the probe once against a real kvtool serve.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
from test_cli_bench import invoke, read_rows

from kvtool.errors import KvtoolError
from kvtool.plan import load_plan
from kvtool.simulate.cost_model import CostModel, ServedCosts, load_profile, save_profile
from kvtool.bench.served_probe import ProbeSimulation, ServedProbe, fit_served
from kvtool.workloads.datasets import load_dataset, write_jsonl

SERVED = ServedCosts(request_s=0.002, token_s=0.0005, ttft_p50_error=0.01, tpot_p50_error=-0.02, probe="a probe")


def test_served_costs_lengthen_context_rows_by_request_and_token_and_decode_rows_by_token():
    model = CostModel(device="cpu: test", coefficients={"step": 0.010, "context_row": 0.001, "context_token": 1e-4},
                      served=SERVED)
    served = model.as_served()
    assert served.coefficients["context_row"] == pytest.approx(0.001 + 0.002 + 0.0005)
    assert served.coefficients["decode_row"] == pytest.approx(0.0005)
    assert served.coefficients["step"] == 0.010 and served.coefficients["context_token"] == 1e-4
    assert served.name == "cpu-test (calibrated, served)" and model.name == "cpu-test (calibrated)"
    assert "+2 ms per request, +0.5 ms per streamed token" in served.source


def test_a_cost_model_without_served_costs_says_how_to_measure_them():
    with pytest.raises(KvtoolError, match=r"no costs of serving over HTTP.*kvtool calibrate --plan DIR --served"):
        CostModel(device="cpu: test", coefficients={"step": 0.01}).as_served()
    with pytest.raises(ValueError, match="request_s must be seconds >= 0"):
        ServedCosts(request_s=-1.0, token_s=0.0, ttft_p50_error=0.0, tpot_p50_error=0.0)


def test_served_costs_round_trip_through_the_profile_file(tiny_llama_plan, tmp_path):
    plan_dir = shutil.copytree(tiny_llama_plan, tmp_path / "plan")
    model = CostModel(device="cpu: Served Test", coefficients={"step": 1e-3}, served=SERVED)
    assert load_profile(save_profile(model, plan_dir)) == model


def _served_simulation(plan_dir, lines, tmp_path, *, served):
    from kvtool.bench.runner import run_bench
    from kvtool.config import ReplayOptions
    from kvtool.simulate.simulated_llm import SimulatedLLM

    model = CostModel(device="cpu: test", coefficients={"step": 0.010, "context_token": 1e-4}, served=SERVED)
    llm = SimulatedLLM(load_plan(plan_dir), model.as_served() if served else model)
    result = run_bench(llm, load_dataset(write_jsonl(tmp_path / "data.jsonl", lines)), ReplayOptions(mode="sequential"),
                       label="sim", requests_csv=tmp_path / "requests.csv")
    return {r.request_id: r for r in result.requests}


def test_a_served_request_waits_for_its_admission_and_each_token_for_its_write(tiny_llama_plan, tmp_path):
    lines = [{"input_ids": list(range(1, 65)), "output_tokens": 3, "request_id": "a"}]
    alone = _served_simulation(tiny_llama_plan, lines, tmp_path, served=False)["a"]
    served = _served_simulation(tiny_llama_plan, lines, tmp_path, served=True)["a"]
    assert alone.ttft_ms == pytest.approx(10 + 6.4)
    assert served.ttft_ms == pytest.approx(10 + 6.4 + 2 + 0.5)  # + admitting it, + writing its first token
    assert alone.tpot_ms == pytest.approx(10.0)
    assert served.tpot_ms == pytest.approx(10.5)  # + writing each token


def test_the_fit_finds_the_served_costs_that_made_the_latencies(tiny_llama_plan, tmp_path):
    plan = load_plan(tiny_llama_plan)
    probe = ServedProbe(burst_sizes=(1, 3), num_bursts=2, gap_s=0.5, prompt_tokens=64, output_tokens=6)
    dataset = load_dataset(write_jsonl(tmp_path / "probe.jsonl", probe.lines(vocab_size=plan.model_config.vocab_size)))
    engine_alone = CostModel(device="cpu: test", coefficients={"step": 0.001, "context_token": 2e-5,
                                                               "decode_row": 1e-4})
    simulation = ProbeSimulation(plan, engine_alone, probe, dataset, tmp_path)
    measured = simulation(0.003, 0.0004)  # what a server adding 3 ms per request, 0.4 ms per token would measure
    fitted = fit_served(simulation, measured, probe)
    assert fitted.request_s == pytest.approx(0.003, rel=0.02)
    assert fitted.token_s == pytest.approx(0.0004, rel=0.02)
    assert abs(fitted.ttft_p50_error) < 0.01 and abs(fitted.tpot_p50_error) < 0.01
    assert "2 bursts each of 1, 3 requests" in fitted.probe


def test_the_probe_fits_the_engine_it_probes():
    probe = ServedProbe().fits(max_batch_size=4, max_seq_len=256)
    assert probe.burst_sizes == (1, 2, 4) and probe.prompt_tokens == 256 // 2 - probe.output_tokens
    lines = probe.lines(vocab_size=1000)
    assert len(lines) == probe.num_bursts * 7
    assert [probe.burst_size_of(line["arrival_time_s"]) for line in lines[:7]] == [1, 2, 2, 4, 4, 4, 4]
    assert len({tuple(line["input_ids"]) for line in lines}) == len(lines)  # fresh prompts: nothing is reused


def test_calibrate_served_probes_a_real_server_and_simulate_served_uses_what_it_measured(tiny_llama_plan, tmp_path):
    profile = tmp_path / "served.json"
    result = invoke("calibrate", "--plan", tiny_llama_plan, "--quick", "--served", "--output", profile)
    assert result.exit_code == 0, result.output
    assert "served by kvtool serve: +" in result.output
    served = load_profile(profile).served
    assert served is not None and 0 <= served.request_s <= 0.05 and 0 <= served.token_s <= 0.005
    dataset = write_jsonl(tmp_path / "data.jsonl", [{"input_ids": list(range(10, 90)), "output_tokens": 4}])
    runs = {}
    for name, flags in (("alone", []), ("served", ["--served"])):
        done = invoke("simulate", "--plan", tiny_llama_plan, "--profile", profile, "--dataset", dataset,
                      "--mode", "sequential", "--output", tmp_path / name, *flags)
        assert done.exit_code == 0, done.output
        runs[name] = read_rows(tmp_path / name / "requests.csv")[0]
    assert float(runs["served"]["ttft_ms"]) == pytest.approx(
        float(runs["alone"]["ttft_ms"]) + (served.request_s + served.token_s) * 1e3)
    assert runs["served"]["engine"].endswith("(calibrated, served))")


def test_simulate_served_without_served_costs_is_one_clear_line(tiny_llama_plan, tmp_path):
    profile = tmp_path / "plain.json"
    profile.write_text(replace(CostModel(device="cpu: test", coefficients={"step": 1e-3})).to_json())
    dataset = write_jsonl(tmp_path / "data.jsonl", [{"input_ids": list(range(10, 40)), "output_tokens": 2}])
    result = invoke("simulate", "--plan", tiny_llama_plan, "--profile", profile, "--dataset", dataset, "--served")
    assert result.exit_code == 2, result.output
    assert "kvtool calibrate --plan DIR --served" in result.output and "Traceback" not in result.output
    assert json.loads(profile.read_text())["served"] is None
