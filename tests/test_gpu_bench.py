"""The GPU benchmark scripts' arithmetic and bookkeeping, checked on any machine: the floors of issue 21
(what qwen3-8b reads and computes per step), the launch count a profile gives, the transformers peer
running the very weights kvtool runs, the simulation check's comparison, and the one-screen summary
`make gpu-check` prints from the files it wrote. The measurements themselves need a GPU
(scripts/gpu_check.sh).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_e2e  # noqa: E402 - bench/ scripts import each other as top-level modules
import gpu_sampler  # noqa: E402
import gpu_simulate_check  # noqa: E402
import gpu_steps  # noqa: E402
import gpu_summary  # noqa: E402
from gpu_reports import write_rows_csv  # noqa: E402

from kvtool.layers.attention import TorchPagedAttention  # noqa: E402
from kvtool.models.llama import LlamaModel  # noqa: E402
from kvtool.models.presets import preset_config  # noqa: E402
from kvtool.runtime.kv_pool import BlockShape  # noqa: E402


def qwen3_8b_llm():
    """An LLM-shaped object holding qwen3-8b's model on the meta device (shapes and dtypes, no memory)."""
    config = preset_config("qwen3-8b")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = LlamaModel(config, TorchPagedAttention())
    finally:
        torch.set_default_dtype(default)
    shape = BlockShape(config.num_layers, 32, config.num_kv_heads, config.head_dim, torch.bfloat16)
    return SimpleNamespace(engine=SimpleNamespace(executor=SimpleNamespace(model=model,
                                                                           pools=SimpleNamespace(shape=shape))))


def test_qwen3_8b_reads_15_gb_of_weights_and_computes_1_9_tflop_for_the_128_token_hit():
    costs = gpu_e2e.model_costs(qwen3_8b_llm())
    # Every weight but the (untied) embedding table: 8.19 B parameters - 0.62 B, in bf16.
    assert costs.weight_bytes == 2 * (8_190_735_360 - 151_936 * 4096)
    # Per layer: qkv 4096 x 6144, o 4096 x 4096, gate_up 4096 x 24576, down 12288 x 4096.
    assert costs.linear_params == 36 * 4096 * (6144 + 4096 + 24576 + 12288)
    assert costs.kv_bytes_per_token == 36 * 2 * 8 * 128 * 2
    flops = costs.step_flops(128, 2048)
    projections = 2 * 128 * costs.linear_params + 2 * 151_936 * 4096
    attention = 4 * 36 * 32 * 128 * 128 * (2048 + 129 / 2)
    assert flops == pytest.approx(projections + attention)
    assert 1.8e12 < flops < 2.0e12


def test_floors_divide_bytes_by_bandwidth_and_flops_by_the_matmul_rate():
    costs = gpu_e2e.ModelCosts(weight_bytes=16_000_000_000, linear_params=7_000_000_000, lm_head_params=0,
                               num_layers=1, num_heads=1, head_dim=1, kv_bytes_per_token=100_000)
    rates = gpu_e2e.HardwareRates(d2d_gbps=4000.0, matmul_tflops=800.0)
    rows = gpu_e2e.floor_rows(costs, rates, prefix_len=2048, question_len=128, hit_ms=10.0, decode_context=4000,
                              tpot=5.0)
    ttft_floor = 16e9 / 4e12 * 1e3 + costs.step_flops(128, 2048) / 800e12 * 1e3  # 4 ms + 2.24 ms
    assert rows[0].case.startswith("floor: ") and rows[0].value == pytest.approx(ttft_floor)
    assert rows[1].ratio == pytest.approx(ttft_floor / 10.0) and rows[1].target == pytest.approx(1 / 1.5)
    assert rows[2].value == pytest.approx((16e9 + 4000 * 100_000) / 4e12 * 1e3)  # 4.1 ms
    assert rows[3].ratio == pytest.approx(rows[2].value / 5.0) and rows[3].target == pytest.approx(1 / 1.2)


def test_launches_count_the_hosts_enqueue_calls_and_the_gpus_kernels():
    cpu, cuda = "DeviceType.CPU", "DeviceType.CUDA"
    events = [SimpleNamespace(name=n, device_type=d) for n, d in [
        ("aten::mm", cpu), ("cudaLaunchKernel", cpu), ("cuLaunchKernel", cpu), ("cudaGraphLaunch", cpu),
        ("cudaMemcpyAsync", cpu), ("cudaStreamSynchronize", cpu), ("sm90_gemm", cuda), ("kvt_rope_append", cuda),
        ("Memcpy HtoD (Pinned -> Device)", cuda), ("Memset (Device)", cuda)]]
    assert gpu_steps.count_launches(events) == gpu_steps.LaunchCounts(host_calls=4, graph_launches=1, gpu_kernels=2,
                                                                        gpu_copies=2)


def test_the_three_steps_are_a_decode_a_128_token_hit_and_a_2048_token_prompt():
    (decode_case, (decode,)), (hit_case, (hit,)), (_, (prompt,)) = gpu_steps.step_requests(32, 2048, 128, 2048)
    assert len(decode.token_ids) == 1 and decode.num_cached_tokens == 2176 and not decode.is_context
    assert len(hit.token_ids) == 128 and hit.num_cached_tokens == 2048 and len(hit.block_ids) * 32 >= 2176
    assert len(prompt.token_ids) == 2048 and prompt.num_cached_tokens == 0
    assert len(decode.block_ids) * 32 >= 2177 and "decode" in decode_case and "128" in hit_case


def test_transformers_peer_runs_the_plans_own_weights(tiny_qwen3_plan):
    import gpu_peer_transformers

    from kvtool import LLM
    from kvtool.plan import load_plan
    from kvtool.runtime.model_runner import StepRequest

    plan = load_plan(tiny_qwen3_plan)
    peer = gpu_peer_transformers.load_hf_model(plan, device="cpu", attn_implementation="sdpa")
    prompt = list(range(100, 160))
    llm = LLM(model=str(tiny_qwen3_plan))
    ours = llm.engine.executor.execute([StepRequest(np.array(prompt, np.int32), np.arange(4, dtype=np.int32), 0, True,
                                                  True)])[0]
    llm.shutdown()
    with torch.no_grad():
        theirs = peer(torch.tensor([prompt])).logits[0, -1].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_simulation_check_compares_each_variant_and_names_the_published_profile():
    measured = [{"label": "reuse-on", "ttft_ms_p50": "20", "ttft_ms_p90": "100"}]
    predicted = [{"label": "reuse-on", "ttft_ms_p50": "21", "ttft_ms_p90": "130"}]
    (row,) = gpu_simulate_check.compare("reuse", "calibrated", measured, predicted)
    assert (row.error_p50, row.error_p90) == (pytest.approx(0.05), pytest.approx(0.30))
    assert (row.target_p50, row.target_p90) == (0.10, 0.20)
    assert gpu_simulate_check.compare("reuse", "h100", measured, predicted)[0].target_p50 is None
    assert gpu_simulate_check.published_profile("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_simulate_check.published_profile("NVIDIA H200") == "h200"
    assert gpu_simulate_check.published_profile("NVIDIA A100-SXM4-80GB") is None
    with pytest.raises(RuntimeError, match="no variant"):
        gpu_simulate_check.compare("reuse", "calibrated", measured, [])


def test_summary_states_each_target_met_or_missed_from_the_files_of_a_run(tmp_path):
    header = {"device": "NVIDIA H100 80GB HBM3"}
    E = gpu_e2e.E2ERow
    write_rows_csv(tmp_path / "gpu_e2e" / "gpu_e2e.csv", [
        E("2048-token shared prompt + 128-token question, reuse off", "median TTFT", 60.0, "ms"),
        E("2048-token shared prompt + 128-token question, reuse on", "median TTFT", 5.0, "ms"),
        E("floor: 128 tokens over a cached 2,048-token prefix = ...", "TTFT floor", 4.0, "ms"),
        E("reuse on: TTFT floor / measured TTFT (hit <= 1.5x floor)", "floor / measured", 0.8, "x", 5.0, 0.8, 1 / 1.5),
        E("floor: decode at batch 1 over 4,016 tokens = ...", "TPOT byte floor", 4.0, "ms"),
        E("decode: TPOT byte floor / measured TPOT (TPOT <= 1.2x floor)", "floor / measured", 0.5, "x", 8.0, 0.5,
          1 / 1.2),
        E("4000-token prompt, decode", "median TPOT", 8.0, "ms"),
        E("shared prompt: TTFT reuse off / on", "speed-up", 12.0, "x", 5.0, 12.0, 10.0),
        E("A,B,A,B: TTFT recompute / onboard", "speed-up", 9.0, "x", 3.0, 9.0, 8.0)], header)
    gpu_steps.write_reports([
        gpu_steps.StepRow("128 tokens over a cached 2,048", "on", 3, 1, 400, 2, 350.0, 5000.0, 1000.0),
        gpu_steps.StepRow("128 tokens over a cached 2,048", "off", 420, 0, 400, 8, 9000.0, 9100.0)],
        tmp_path / "gpu_e2e", header)
    text = gpu_summary.summarize(tmp_path)
    lines = {line[2:].split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert text.startswith("# kvtool gpu-check: NVIDIA H100 80GB HBM3")
    assert "12.0x (60.0 / 5.00 ms)" in lines["1. reuse off / on, qwen3-8b 2k prefix + 128, batch 1"]
    assert lines["1. reuse off / on, qwen3-8b 2k prefix + 128, batch 1"].endswith("| met |")
    assert "1.25x (5.00 / 4.00 ms)" in lines["1. hit TTFT / its floor (weights/D2D + GEMM FLOPs/matmul rate)"]
    assert lines["3. TPOT at batch 1 / its byte floor ((weights + KV) / D2D)"].endswith("| missed |")  # 2x
    step = lines["2. step: 128 tokens over a cached 2,048"]
    assert "host 350 us" in step and "eager 420 launches" in step and step.endswith("| met |")
    assert lines["6. transformers (sdpa_paged) on the same GPU"].endswith("not measured (step peer) |")
    assert lines["   A,B,A,B: TTFT recompute / onboard"].endswith("| met |")
    assert lines["GPU tests (pytest -m gpu)"].endswith("not measured (step test) |")


def test_the_summary_shows_the_hits_key_split_speed_up_when_the_suite_timed_it():
    suite = [{"section": "context", "case": "1 x 128 over 2048: unsplit / 9 key splits", "metric": "speed-up",
              "value": "4.2"}]
    (line,) = [line for line in gpu_summary.kernel_lines(suite) if "key splits" in line.target]
    assert line.target == "   context attention, 1 x 128 over 2048: unsplit / 9 key splits" and line.measured == "4.20x"
    assert not [line for line in gpu_summary.kernel_lines([]) if "key splits" in line.target]


def test_the_peer_is_held_to_kvtools_row_of_the_very_same_case():
    # The H100 run's e2e wrote "4000-token prompt, decode without CUDA graphs" before the replayed
    # decode's row; the summary held transformers' TPOT to the eager one.
    E = gpu_e2e.E2ERow
    e2e = [{"case": r.case, "metric": r.metric, "value": str(r.value)} for r in (
        E("2048-token shared prompt + 128-token question, reuse on, without CUDA graphs", "median TTFT", 14.2, "ms"),
        E("2048-token shared prompt + 128-token question, reuse on", "median TTFT", 13.4, "ms"),
        E("4000-token prompt, decode without CUDA graphs", "median TPOT", 7.24, "ms"),
        E("4000-token prompt, decode", "median TPOT", 7.0, "ms"))]
    peer = [{"case": "2048-token shared prompt + 128-token question, reuse on", "metric": "median TTFT",
             "value": "132.4"}, {"case": "4000-token prompt, decode", "metric": "median TPOT", "value": "74.4"}]
    lines = {line.target: line for line in gpu_summary.peer_lines(e2e, peer)}
    assert lines["6. TTFT reuse on: kvtool / transformers"].measured == "13.40 / 132.40 ms"
    assert lines["6. TPOT: kvtool / transformers"].measured == "7.00 / 74.40 ms"
    assert lines["6. TTFT reuse off: kvtool / transformers"].verdict.startswith("not measured")


def test_a_figure_the_summary_cannot_read_costs_one_line_not_the_summary(tmp_path):
    # A variant the simulation check could not measure leaves an empty error: the other targets still show.
    (tmp_path / "simulate").mkdir()
    (tmp_path / "simulate" / "gpu_simulate.csv").write_text("scenario,variant,profile,error_p50,error_p90\n"
                                                            "reuse,reuse-on,calibrated,,0.1\n")
    write_rows_csv(tmp_path / "gpu_e2e" / "gpu_e2e.csv", [
        gpu_e2e.E2ERow("A,B,A,B: TTFT recompute / onboard", "speed-up", 9.0, "x", 3.0, 9.0, 8.0)], {"device": "H100"})
    lines = {line[2:].split(" | ")[0]: line for line in gpu_summary.summarize(tmp_path).splitlines()
             if line.startswith("| ")}
    assert "could not read the files: TypeError" in lines["7. simulate"] and lines["7. simulate"].endswith("| missed |")
    assert lines["   A,B,A,B: TTFT recompute / onboard"].endswith("| met |")


def test_the_sampler_bench_times_both_paths_and_writes_its_table(tmp_path, monkeypatch):
    # On the CPU here (the GPU check runs it on the device): both paths draw, the table has a row a case.
    monkeypatch.setattr(sys, "argv", ["gpu_sampler.py", "--output", str(tmp_path), "--device", "cpu",
                                      "--vocab_size", "500", "--batch_sizes", "1", "3", "--reps", "1", "--warmup", "0"])
    gpu_sampler.main()
    table = (tmp_path / "gpu_sampler.md").read_text()
    assert table.count("\n| ") == 1 + len(gpu_sampler.SAMPLINGS) * 2  # the header and a row a case
    assert "| top_p 0.9 | 3 |" in table and (tmp_path / "gpu_sampler.csv").exists()


def test_gpu_check_packs_its_output_after_each_step_and_starts_none_past_its_deadline(tmp_path):
    # A lent machine hands back a few files from its output folder and nothing of a call cut off at its
    # limit but what is there: OUT goes into one archive after every step, and no step but the summary
    # starts past the deadline, so the summary lands inside the call.
    import subprocess
    import tarfile

    out, archive = tmp_path / "out", tmp_path / "handed-back" / "gpu-check.tgz"
    archive.parent.mkdir()
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(out), "GPU_CHECK_STEPS": "info bench summary",
           "GPU_CHECK_DEADLINE_S": "0", "GPU_CHECK_ARCHIVE": str(archive)}
    result = subprocess.run(["bash", str(BENCH.parent / "scripts" / "gpu_check.sh")], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr  # skipped steps are no pass
    steps = (out / "steps.log").read_text()
    assert "info skipped" in steps and "bench skipped" in steps and "summary took" in steps
    with tarfile.open(archive) as packed:
        names = {Path(name).name for name in packed.getnames()}
    assert {"steps.log", "summary.md"} <= names
    assert not list(archive.parent.glob("*.part"))
