"""`kvtool simulate` and `kvtool calibrate`: the step cost model, the simulated clock, the commands.

Simulated times are checked against hand-computed ones (a cost model with one or two terms gives
times a reader can add up); the counters of a simulated run against a real one are in
tests/test_simulate_counters.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_cli_bench import invoke, read_rows

from kvtool.workloads.datasets import load_dataset, write_jsonl
from kvtool.bench.runner import run_bench
from kvtool.flags import configs
from kvtool.plan import load_plan
from kvtool.simulate.cost_model import (TERMS, CostModel, StepShape, fit_coefficients, load_profile,
                                        profile_path, save_profile, step_shape)
from kvtool.simulate.simulated_llm import SimulatedLLM
from kvtool.simulate.profiles import this_device
from kvtool.simulate.published import estimate


class Row:
    def __init__(self, num_tokens, num_cached_tokens):
        self.num_tokens, self.num_cached_tokens = num_tokens, num_cached_tokens


# -- the cost model -------------------------------------------------------------------------------

def test_step_shape_counts_one_token_rows_as_decode_rows_and_copies_as_bytes():
    shape = step_shape([Row(100, 28), Row(1, 50), Row(1, 99)], np.array([16, 16, 4]), bytes_per_token=1024)
    assert shape == StepShape(num_context_rows=1, num_context_tokens=100, num_context_cached_tokens=28,
                              num_context_pairs=100 * (28 + 101 / 2),
                              num_decode_rows=2, num_decode_kv_tokens=51 + 100, num_copied_bytes=36 * 1024)


def test_fit_recovers_the_coefficients_that_generated_the_steps():
    rng = np.random.default_rng(0)
    truth = {"step": 2e-3, "context_row": 5e-4, "context_token": 3e-6, "context_cached_token": 5e-7,
             "context_pair": 2e-9, "decode_row": 1e-4,
             "decode_kv_token": 4e-8, "copied_byte": 0.0}
    model = CostModel(device="cpu: test", coefficients=truth)
    shapes = [StepShape(int(c), int(c * n), int(c * k), float(c * n * (k + n / 2)), int(d), int(d * k), 0)
              for c, n, d, k in zip(rng.integers(0, 4, 60), rng.integers(16, 2048, 60), rng.integers(0, 16, 60),
                                    rng.integers(1, 2048, 60))]
    seconds = [model.predict(s) for s in shapes]
    fitted, dropped = fit_coefficients(shapes, seconds)
    assert dropped == ()
    for term in TERMS:
        assert fitted[term] == pytest.approx(truth[term], rel=1e-6, abs=1e-15)


def test_a_term_fitted_negative_is_left_out_and_the_rest_refitted():
    # Steps whose time does not grow with the KV read, plus noise that pulls that term below 0.
    shapes = [StepShape(0, 0, 0, 0.0, d, k, 0) for d in (1, 2, 4, 8) for k in (100, 1000, 4000)]
    seconds = [1e-3 + 2e-4 * s.num_decode_rows - 1e-9 * s.num_decode_kv_tokens for s in shapes]
    fitted, dropped = fit_coefficients(shapes, seconds)
    assert dropped == ("decode_kv_token",)
    assert fitted["decode_kv_token"] == 0.0
    assert all(value >= 0 for value in fitted.values())


def test_cost_model_file_round_trips_and_a_bad_one_is_a_clear_error(tmp_path, tiny_llama_plan):
    model = CostModel(device="cpu: Test CPU (2 cores)", coefficients={"step": 1e-3, "context_token": 2e-6})
    path = save_profile(model, tiny_llama_plan)
    try:
        assert path == profile_path(tiny_llama_plan, "cpu: Test CPU (2 cores)")
        assert path.name == "cpu-test-cpu-2-cores.json"
        assert load_profile(path) == model
        load_plan(tiny_llama_plan)  # the plan is still valid with its cost models beside it
    finally:
        path.unlink()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"device": "cpu", "coefficients": {"warp_speed": 1.0}}))
    with pytest.raises(Exception, match=r"bad.json is not a kvtool cost model .*warp_speed.*kvtool calibrate"):
        load_profile(bad)


def test_published_estimate_of_an_8b_model_on_h100_is_memory_bound_and_labelled_estimated():
    from types import SimpleNamespace

    from kvtool.models.presets import preset_config
    from kvtool.plan import BuildOptions

    # The shapes of preset:qwen3-8b in bfloat16, without building 16 GB of weights.
    plan = SimpleNamespace(model_config=preset_config("qwen3-8b"), build_options=BuildOptions(dtype="bfloat16"),
                           manifest={})
    model = estimate(plan, "h100")
    assert model.estimated and model.name.endswith("(estimated)")
    decode_step = model.predict(StepShape(num_decode_rows=1, num_decode_kv_tokens=1000))
    # 16.4 GB of bf16 weights read at 80% of 3.35 TB/s: about 6 ms, plus launches.
    assert 6e-3 < decode_step < 9e-3
    # A 4k-token prompt is compute bound: 2 x 7.6e9 FLOPs per token at 60% of 989 TFLOP/s, about 0.1 s.
    context = model.predict(StepShape(1, 4096, 0, 4096 * 4096 / 2, 0, 0, 0))
    assert 0.08 < context < 0.2
    assert model.details["free_memory_bytes"] > 50 * 10**9


# -- the simulated clock --------------------------------------------------------------------------

def _simulate(plan_dir, lines, tmp_path, coefficients, on_request_done=None, **flags):
    dataset = load_dataset(write_jsonl(tmp_path / "data.jsonl", lines))
    engine, replay = configs(flags)
    llm = SimulatedLLM(load_plan(plan_dir), CostModel(device="cpu: test", coefficients=coefficients), engine)
    result = run_bench(llm, dataset, replay, label="sim", requests_csv=tmp_path / "requests.csv",
                       on_request_done=on_request_done and (lambda metrics: on_request_done(llm, metrics)))
    return result, {r.request_id: r for r in result.requests}


def test_a_hook_after_each_request_runs_before_the_next_is_sent_and_outside_its_timings(tiny_llama_plan, tmp_path):
    lines = [{"input_ids": list(range(1, 65)), "output_tokens": 3, "request_id": "a"},
             {"input_ids": list(range(101, 201)), "output_tokens": 2, "request_id": "b"}]
    done = []

    def probe(llm, metrics):  # a second of the simulated clock after each request (a bandwidth probe)
        done.append(metrics.request_id)
        llm.clock.advance(1.0)

    _, by_id = _simulate(tiny_llama_plan, lines, tmp_path, {"step": 0.010, "context_token": 1e-4},
                         on_request_done=probe, mode="sequential", warmup=0)
    assert done == ["a", "b"]
    assert by_id["b"].arrival_s == pytest.approx(1.0364)  # sent after a and its hook
    assert by_id["a"].ttft_ms == pytest.approx(16.4) and by_id["b"].ttft_ms == pytest.approx(20.0)
    assert by_id["a"].e2e_ms == pytest.approx(36.4)


def test_sequential_requests_take_one_predicted_step_per_token(tiny_llama_plan, tmp_path):
    lines = [{"input_ids": list(range(1, 65)), "output_tokens": 3, "request_id": "a"},
             {"input_ids": list(range(101, 201)), "output_tokens": 2, "request_id": "b"}]
    # 10 ms per step, 0.1 ms per context token: a's first step takes 10 + 6.4 ms, b's 10 + 10 ms.
    result, by_id = _simulate(tiny_llama_plan, lines, tmp_path, {"step": 0.010, "context_token": 1e-4},
                              mode="sequential")
    assert by_id["a"].ttft_ms == pytest.approx(16.4)
    assert by_id["a"].tpot_ms == pytest.approx(10.0)
    assert by_id["a"].e2e_ms == pytest.approx(36.4)
    assert by_id["b"].arrival_s == pytest.approx(0.0364)  # sent when a finished
    assert by_id["b"].ttft_ms == pytest.approx(20.0)
    assert result.row["simulated"] is True and result.row["cost_profile"] == "cpu-test (calibrated)"
    assert result.row["engine"] == by_id["a"].engine == "kvtool simulate (cpu-test (calibrated))"


def test_requests_arriving_together_share_steps_and_a_later_arrival_waits_for_its_time(tiny_llama_plan, tmp_path):
    lines = [{"input_ids": [7] * 40, "output_tokens": 2, "request_id": "a", "arrival_time_s": 0.0},
             {"input_ids": [8] * 40, "output_tokens": 2, "request_id": "b", "arrival_time_s": 0.0},
             {"input_ids": [9] * 40, "output_tokens": 1, "request_id": "late", "arrival_time_s": 5.0}]
    _, by_id = _simulate(tiny_llama_plan, lines, tmp_path, {"step": 0.050})
    assert by_id["a"].ttft_ms == pytest.approx(50.0) and by_id["b"].ttft_ms == pytest.approx(50.0)
    assert by_id["a"].e2e_ms == pytest.approx(100.0)
    # Nothing runs between 0.1 s and 5 s: the clock jumps to the arrival.
    assert by_id["late"].arrival_s == pytest.approx(5.0)
    assert by_id["late"].ttft_ms == pytest.approx(50.0)


def test_reused_prefix_shortens_the_predicted_first_step(tiny_llama_plan, tmp_path):
    prefix = list(range(1, 97))  # 6 blocks of 16
    lines = [{"input_ids": prefix + [200 + i] * 8, "output_tokens": 1, "request_id": str(i)} for i in range(2)]
    _, by_id = _simulate(tiny_llama_plan, lines, tmp_path, {"step": 0.001, "context_token": 1e-4}, mode="sequential")
    assert by_id["0"].ttft_ms == pytest.approx(1 + 10.4)
    assert by_id["1"].reused_tokens == 96
    assert by_id["1"].ttft_ms == pytest.approx(1 + 0.8)


# -- the commands ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def calibrated_plan(tiny_llama_plan):
    """tiny-llama with a quick calibration of this machine beside it (removed afterwards)."""
    result = invoke("calibrate", "--plan", tiny_llama_plan, "--quick")
    assert result.exit_code == 0, result.output
    path = profile_path(tiny_llama_plan, this_device())
    yield tiny_llama_plan, result.output
    path.unlink(missing_ok=True)


def test_calibrate_measures_the_plan_and_saves_the_fit_beside_it(calibrated_plan):
    plan_dir, output = calibrated_plan
    model = load_profile(profile_path(plan_dir, this_device()))
    assert not model.estimated and model.device == this_device()
    assert model.fit.num_held_out_points >= 2 and model.fit.median_abs_error < 1.0
    assert all(value >= 0 for value in model.coefficients.values()) and model.coefficients["copied_byte"] > 0
    # On tiny-llama a step is mostly fixed cost: which context term carries the rest varies between runs, and
    # on a loaded machine the quick grid may drop every context term (a negative fit): never cheaper, though.
    assert model.predict(StepShape(1, 256, 0, 256 * 128.5)) >= model.predict(StepShape(1, 16, 0, 16 * 8.5)) > 0
    assert "held-out error on" in output and "ms per 1k context tokens" in output


@pytest.fixture
def shared_prefix_dataset(tmp_path):
    prefix = list(range(100, 164))
    return write_jsonl(tmp_path / "shared.jsonl", [{"input_ids": prefix + [10 + i] * 8, "output_tokens": 3}
                                                   for i in range(6)])


def test_simulate_writes_bench_reports_marked_simulated(calibrated_plan, shared_prefix_dataset, tmp_path):
    plan_dir, _ = calibrated_plan
    result = invoke("simulate", "--plan", plan_dir, "--dataset", shared_prefix_dataset, "--concurrency", 2,
                    "--output", tmp_path / "out")
    assert result.exit_code == 0, result.output
    summary = read_rows(tmp_path / "out" / "summary.csv")[0]
    assert summary["simulated"] == "True" and summary["cost_profile_estimated"] == "False"
    assert summary["cost_profile"] == f"{summary['cost_profile'].split(' ')[0]} (calibrated)"
    assert "simulated" in summary["device"]
    assert int(summary["reused_blocks"]) == 5 * 4 and float(summary["ttft_ms_p50"]) > 0
    requests = read_rows(tmp_path / "out" / "requests.csv")
    assert len(requests) == 6 and all(r["engine"].startswith("kvtool simulate (") for r in requests)


def test_simulate_sweeps_a_flag_and_plots_hit_rate_and_ttft(tiny_llama_plan, shared_prefix_dataset, tmp_path):
    # Costs that make reused tokens count (tiny-llama's own calibration is mostly per-step overhead).
    profile = tmp_path / "cost.json"
    profile.write_text(CostModel(device="cpu: test", coefficients={"step": 1e-3, "context_token": 1e-4}).to_json())
    result = invoke("simulate", "--plan", tiny_llama_plan, "--dataset", shared_prefix_dataset, "--mode", "sequential",
                    "--sweep", "enable_kv_cache_reuse=false,true", "--profile", profile, "--output", tmp_path / "sweep")
    assert result.exit_code == 0, result.output
    rows = read_rows(tmp_path / "sweep" / "summary.csv")
    assert [r["label"] for r in rows] == ["enable_kv_cache_reuse=false", "enable_kv_cache_reuse=true"]
    assert float(rows[0]["cache_hit_rate"]) == 0 and float(rows[1]["cache_hit_rate"]) > 0.5
    assert float(rows[1]["ttft_ms_p50"]) < float(rows[0]["ttft_ms_p50"])
    assert (tmp_path / "sweep" / "sweep.png").stat().st_size > 0
    assert "predicted TTFT" in result.output


def test_simulated_and_measured_variants_compare_side_by_side(calibrated_plan, shared_prefix_dataset, tmp_path):
    plan_dir, _ = calibrated_plan
    for command in ("bench", "simulate"):
        result = invoke(command, "--plan", plan_dir, "--dataset", shared_prefix_dataset, "--mode", "sequential",
                        "--label", command, "--output", tmp_path / command)
        assert result.exit_code == 0, result.output
    result = invoke("compare", tmp_path / "bench" / "summary.csv", tmp_path / "simulate" / "summary.csv")
    assert result.exit_code == 0, result.output
    assert "bench" in result.output and "simulate" in result.output


def test_estimated_profile_is_named_estimated_in_every_report(tiny_llama_plan, shared_prefix_dataset, tmp_path):
    result = invoke("simulate", "--plan", tiny_llama_plan, "--dataset", shared_prefix_dataset, "--profile", "h100",
                    "--output", tmp_path / "est")
    assert result.exit_code == 0, result.output
    summary = read_rows(tmp_path / "est" / "summary.csv")[0]
    assert summary["cost_profile"].endswith("(estimated)") and summary["cost_profile_estimated"] == "True"
    assert all(r["engine"].endswith("(estimated))") for r in read_rows(tmp_path / "est" / "requests.csv"))


@pytest.mark.parametrize("args, message", [
    (["--profile", "tpu9"], "--profile tpu9: neither a device"),
    (["--sweep", "warp=1,2"], "'warp' is not a bench flag"),
    (["--sweep", "max_batch_size"], "is not NAME=V1,V2"),
    (["--max_batch_size", "2", "--sweep", "max_batch_size=1,2"], "--max_batch_size is given and swept"),
])
def test_simulate_bad_input_is_one_clear_line(tiny_llama_plan, shared_prefix_dataset, args, message):
    result = invoke("simulate", "--plan", tiny_llama_plan, "--dataset", shared_prefix_dataset, *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_simulate_without_a_calibration_says_how_to_get_one(tmp_path, shared_prefix_dataset):
    from kvtool.plan import BuildOptions, build_plan

    plan_dir = build_plan("preset:tiny-llama", tmp_path / "plan", BuildOptions(tokens_per_block=16, max_seq_len=512))
    result = invoke("simulate", "--plan", plan_dir, "--dataset", shared_prefix_dataset)
    assert result.exit_code == 2, result.output
    assert f"kvtool calibrate --plan {plan_dir}" in result.output and "--profile h100" in result.output


def test_a_preset_not_built_is_simulated_from_its_shapes(shared_prefix_dataset, tmp_path):
    plans = tmp_path / "plans"
    result = invoke("simulate", "--model", "preset:qwen3-8b", "--profile", "h100", "--dataset", shared_prefix_dataset,
                    "--plan_cache_dir", plans, "--output", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert not plans.exists() or not any(plans.iterdir())  # no 16 GB of weights were built
    summary = read_rows(tmp_path / "out" / "summary.csv")[0]
    assert summary["plan_path"] == "preset:qwen3-8b" and summary["model_hidden_size"] == "4096"
    assert summary["cost_profile_estimated"] == "True" and int(summary["reused_blocks"]) == 5 * 2  # 32-token blocks
    without = invoke("simulate", "--model", "preset:qwen3-8b", "--dataset", shared_prefix_dataset,
                     "--plan_cache_dir", plans)
    assert without.exit_code == 2 and "simulated from its shapes" in without.output


def test_calibrate_with_a_device_writes_an_estimate(tiny_llama_plan, tmp_path):
    result = invoke("calibrate", "--plan", tiny_llama_plan, "--device", "l40s", "--output", tmp_path / "l40s.json")
    assert result.exit_code == 0, result.output
    model = load_profile(tmp_path / "l40s.json")
    assert model.estimated and "L40S" in model.device and "published figures" in model.source
    assert "(estimated)" in result.output
    bad = invoke("calibrate", "--plan", tiny_llama_plan, "--device", "tpu9")
    assert bad.exit_code == 2 and "published figures are known for h100" in bad.output


def test_a_gpu_cost_model_without_its_free_memory_needs_a_pool_size(tiny_llama_plan, shared_prefix_dataset, tmp_path):
    profile = tmp_path / "gpu.json"
    profile.write_text(CostModel(device="cuda: Some GPU", coefficients={"step": 1e-3}).to_json())
    refused = invoke("simulate", "--plan", tiny_llama_plan, "--dataset", shared_prefix_dataset, "--profile", profile)
    assert refused.exit_code == 2 and "--max_tokens_in_paged_kv_cache" in refused.output
    sized = invoke("simulate", "--plan", tiny_llama_plan, "--dataset", shared_prefix_dataset, "--profile", profile,
                   "--max_tokens_in_paged_kv_cache", 4096, "--output", tmp_path / "out")
    assert sized.exit_code == 0, sized.output
    assert read_rows(tmp_path / "out" / "summary.csv")[0]["kv_primary_tokens"] == "4096"


# -- what is simulated: dtype, build options, no weights ------------------------------------------

QWEN3_8B_KV_BYTES_PER_TOKEN = 2 * 36 * 8 * 128  # K and V x layers x KV heads x head_dim, per byte of the dtype


def flat(output: str) -> str:
    return " ".join(output.split())


def test_a_gpu_profile_simulates_bfloat16_unless_dtype_says_otherwise(shared_prefix_dataset, tmp_path):
    plans = tmp_path / "plans"
    rows = {}
    for name, extra in (("implied", []), ("float32", ["--dtype", "float32"])):
        result = invoke("simulate", "--model", "preset:qwen3-8b", "--profile", "h100", "--dataset",
                        shared_prefix_dataset, "--plan_cache_dir", plans, "--output", tmp_path / name, *extra)
        assert result.exit_code == 0, result.output
        rows[name] = read_rows(tmp_path / name / "summary.csv")[0]
        assert "kvtool simulate summary: simulated, cost profile cuda-nvidia-h100-sxm5-80gb (estimated)" in \
            flat(result.output)
    implied, float32 = rows["implied"], rows["float32"]
    assert (implied["plan_dtype"], implied["plan_kv_cache_dtype"]) == ("bfloat16", "bfloat16")
    assert (float32["plan_dtype"], float32["plan_kv_cache_dtype"]) == ("float32", "float32")
    for row, dtype_bytes in ((implied, 2), (float32, 4)):
        assert int(row["kv_primary_bytes"]) == int(row["kv_primary_tokens"]) * QWEN3_8B_KV_BYTES_PER_TOKEN * dtype_bytes
    # Half the bytes per token, and more memory left by 16 GB of weights instead of 33: over twice the tokens.
    assert int(implied["kv_primary_tokens"]) > 2 * int(float32["kv_primary_tokens"])
    assert float(implied["ttft_ms_p50"]) < float(float32["ttft_ms_p50"])
    assert not plans.exists() or not any(plans.iterdir())


@pytest.mark.parametrize("device, dtype", [("cuda: Some GPU", "bfloat16"), ("cpu: Some CPU", "float32")])
def test_a_calibrated_profile_implies_the_dtype_of_its_device(shared_prefix_dataset, tmp_path, device, dtype):
    profile = tmp_path / "profile.json"
    profile.write_text(CostModel(device=device, coefficients={"step": 1e-3},
                                 details={"free_memory_bytes": 1 << 30}).to_json())
    result = invoke("simulate", "--model", "preset:tiny-llama", "--profile", profile, "--dataset",
                    shared_prefix_dataset, "--plan_cache_dir", tmp_path / "plans", "--output", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert read_rows(tmp_path / "out" / "summary.csv")[0]["plan_dtype"] == dtype
    assert f"{dtype} weights, {dtype} KV cache" in flat(result.output)
    assert "(calibrated)" in flat(result.output)


def test_build_options_of_a_model_are_simulated_without_writing_weights(shared_prefix_dataset, tmp_path):
    plans = tmp_path / "plans"
    result = invoke("simulate", "--model", "preset:qwen3-8b", "--profile", "h200", "--dataset", shared_prefix_dataset,
                    "--plan_cache_dir", plans, "--output", tmp_path / "out", "--dtype", "float16",
                    "--max_seq_len", 8192, "--max_batch_size", 64, "--max_num_tokens", 16384, "--tokens_per_block", 64)
    assert result.exit_code == 0, result.output
    row = read_rows(tmp_path / "out" / "summary.csv")[0]
    assert {k: row[f"plan_{k}"] for k in ("dtype", "max_seq_len", "max_batch_size", "max_num_tokens",
                                          "tokens_per_block")} == {
        "dtype": "float16", "max_seq_len": "8192", "max_batch_size": "64", "max_num_tokens": "16384",
        "tokens_per_block": "64"}
    assert "preset:qwen3-8b from its shapes (no weights written or read)" in flat(result.output)
    assert not plans.exists() or not any(plans.iterdir())


def _scramble_weights(plan_dir):
    """Overwrites the tensor data (not the header) and forgets the verified checksum: any read or hash of
    the weights would now fail, and a use of them would give garbage."""
    from kvtool.plan.format import WEIGHTS_FILE

    weights = plan_dir / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    data[header_end:] = bytes(len(data) - header_end)
    weights.write_bytes(bytes(data))
    for record in plan_dir.glob("weights.verified*"):
        record.unlink()
    return weights


def test_a_built_plan_is_simulated_without_reading_its_weights(shared_prefix_dataset, tmp_path):
    from kvtool.errors import PlanError
    from kvtool.plan import BuildOptions, build_plan

    plan_dir = build_plan("preset:tiny-llama", tmp_path / "plan", BuildOptions(tokens_per_block=16, max_seq_len=512))
    weights = _scramble_weights(plan_dir)
    with pytest.raises(PlanError, match="does not match its recorded checksum"):
        load_plan(plan_dir)  # what a real run would say
    result = invoke("simulate", "--plan", plan_dir, "--profile", "h100", "--dataset", shared_prefix_dataset,
                    "--output", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert f"the plan {plan_dir} (its weights are not read): float32 weights" in flat(result.output)
    refused = invoke("simulate", "--plan", plan_dir, "--profile", "h100", "--dtype", "bfloat16", "--dataset",
                     shared_prefix_dataset)
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert f"--dtype bfloat16: the plan {plan_dir} was built with --dtype float32" in flat(refused.output)
    assert not list(plan_dir.glob("weights.verified*")) and weights.read_bytes().endswith(bytes(64))


def test_a_model_built_in_the_cache_is_simulated_as_built_and_other_options_from_shapes(shared_prefix_dataset,
                                                                                       tmp_path):
    from kvtool.plan import BuildOptions, resolve_model

    plans = tmp_path / "plans"
    # What `bench --model preset:tiny-llama` builds on a GPU (and `calibrate --model` there): the h100's dtype.
    cached = resolve_model("preset:tiny-llama", options=BuildOptions(dtype="bfloat16"), cache_dir=plans).path
    weights = _scramble_weights(cached)
    same = invoke("simulate", "--model", "preset:tiny-llama", "--profile", "h100", "--dataset", shared_prefix_dataset,
                  "--plan_cache_dir", plans, "--output", tmp_path / "same")
    assert same.exit_code == 0, same.output
    assert f"the plan {cached} (its weights are not read)" in flat(same.output)
    other = invoke("simulate", "--model", "preset:tiny-llama", "--profile", "h100", "--dataset", shared_prefix_dataset,
                   "--plan_cache_dir", plans, "--output", tmp_path / "other", "--tokens_per_block", 64)
    assert other.exit_code == 0, other.output
    assert "preset:tiny-llama from its shapes" in flat(other.output)
    assert [p.name for p in plans.iterdir()] == [cached.name]  # nothing built, nothing rebuilt
    assert weights.read_bytes().endswith(bytes(64))


def test_a_checkpoint_is_simulated_from_its_config_alone(hf_checkpoint, shared_prefix_dataset, tmp_path):
    checkpoint = tmp_path / "qwen3"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_bytes((hf_checkpoint("qwen3_qk_norm").path / "config.json").read_bytes())
    plans = tmp_path / "plans"
    result = invoke("simulate", "--model", checkpoint, "--profile", "a100", "--dataset", shared_prefix_dataset,
                    "--plan_cache_dir", plans, "--output", tmp_path / "out", "--tokens_per_block", 16)
    assert result.exit_code == 0, result.output
    row = read_rows(tmp_path / "out" / "summary.csv")[0]
    assert (row["plan_path"], row["model_family"], row["model_hidden_size"], row["plan_dtype"]) == \
        (str(checkpoint), "qwen3", "64", "bfloat16")
    assert int(row["reused_blocks"]) == 5 * 4
    assert not plans.exists() or not any(plans.iterdir())


def test_a_gguf_file_not_built_is_refused_with_the_build_command(shared_prefix_dataset, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    result = invoke("simulate", "--model", gguf, "--profile", "h100", "--dataset", shared_prefix_dataset,
                    "--plan_cache_dir", tmp_path / "plans")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"kvtool build --model {gguf} --dtype bfloat16 --tokens_per_block 32 --output PLAN" in flat(result.output)


def test_a_sweep_of_a_model_simulates_every_variant_in_the_profiles_dtype(shared_prefix_dataset, tmp_path):
    plans = tmp_path / "plans"
    for extra, dtype in (([], "bfloat16"), (["--dtype", "float32"], "float32")):
        out = tmp_path / dtype
        result = invoke("simulate", "--model", "preset:qwen3-8b", "--profile", "h100", "--dataset",
                        shared_prefix_dataset, "--sweep", "enable_kv_cache_reuse=false,true", "--plan_cache_dir", plans,
                        "--output", out, *extra)
        assert result.exit_code == 0, result.output
        assert [row["plan_dtype"] for row in read_rows(out / "summary.csv")] == [dtype, dtype]
        assert "kvtool simulate summary: simulated" in flat(result.output)
    assert not plans.exists() or not any(plans.iterdir())
