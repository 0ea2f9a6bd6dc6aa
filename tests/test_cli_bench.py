"""`kvtool bench`: flags reach the engine configuration, reports are written, Ctrl-C keeps what finished.

Most tests swap kvtool.LLM for the fake of tests/bench_fakes.py; the last ones run the real
runtime on the tiny-llama preset.
"""

from __future__ import annotations

import csv
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from bench_fakes import FakeLLM
from typer.testing import CliRunner

from kvtool.bench import runner as bench_runner
from kvtool.bench import sweep
from kvtool.workloads.datasets import write_jsonl
from kvtool.cli import app
from kvtool.config import CapacitySchedulerPolicy, ContextChunkingPolicy, EngineConfig, ReplayOptions

cli = CliRunner()


def invoke(*args):
    return cli.invoke(app, [str(a) for a in args])


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def dataset(tmp_path):
    prefix = list(range(100, 132))
    return write_jsonl(tmp_path / "shared.jsonl", [{"input_ids": prefix + [10 + i] * 8, "output_tokens": 3}
                                                   for i in range(6)])


class FakeLlmFactory(list):
    """Stands in for kvtool.LLM creation: records (model, engine config, replay options, llm); settings go
    to every FakeLLM."""

    def __init__(self):
        super().__init__()
        self.settings = {}

    def __call__(self, model, engine, replay, dataset=None, cache_dir=None):
        llm = FakeLLM(enable_block_reuse=engine.kv_cache_config.enable_block_reuse, config=engine, **self.settings)
        self.append((model, engine, replay, llm))
        return llm


@pytest.fixture
def fake_llms(monkeypatch):
    factory = FakeLlmFactory()
    monkeypatch.setattr(bench_runner, "create_llm", factory)
    monkeypatch.setattr(sweep, "resolve_variant_plan", lambda variant, cache_dir=None: f"plans/{variant.label}")
    return factory


def test_bench_writes_request_and_summary_csvs_with_every_flag(tmp_path, dataset, fake_llms):
    out = tmp_path / "run"
    result = invoke("bench", "--model", "preset:tiny-llama", "--dataset", dataset, "--output", out,
                    "--disable-kv-cache-reuse", "--kv_host_cache_bytes", "512MB", "--max-tokens-in-paged-kv-cache",
                    4096, "--kv_cache_free_gpu_mem_fraction", 0.5, "--max-attention-window-size", 1024,
                    "--scheduler-policy", "MAX_UTILIZATION", "--context_chunking_policy", "Equal_Progress",
                    "--enable-chunked-context", "--max_batch_size", 4, "--max-num-tokens", 256, "--max-seq-len", 512,
                    "--tokens-per-block", 32, "--concurrency", 2, "--warmup", 1, "--num_requests", 4,
                    "--label", "variant-a")
    assert result.exit_code == 0, result.output
    (model, config, replay, llm), = fake_llms
    assert model == "preset:tiny-llama" and llm.shut_down
    kv = config.kv_cache_config
    assert (kv.enable_block_reuse, kv.host_cache_size, kv.max_tokens, kv.free_gpu_memory_fraction,
            kv.max_attention_window, config.tokens_per_block) == (False, 512_000_000, 4096, 0.5, 1024, 32)
    sched = config.scheduler_config
    assert (sched.capacity_scheduler_policy, sched.context_chunking_policy, sched.enable_chunked_context) == (
        CapacitySchedulerPolicy.MAX_UTILIZATION, ContextChunkingPolicy.EQUAL_PROGRESS, True)
    assert (config.max_batch_size, config.max_num_tokens, config.max_seq_len) == (4, 256, 512)
    assert (replay.concurrency, replay.warmup, replay.num_requests) == (2, 1, 4)

    requests = read_rows(out / "requests.csv")
    assert [row["request_id"] for row in requests] == ["1", "2", "3", "4"]  # 1 warm-up, 4 measured
    assert {row["label"] for row in requests} == {"variant-a"}
    summary, = read_rows(out / "summary.csv")
    assert summary["label"] == "variant-a" and summary["interrupted"] == "False"
    assert summary["num_requests"] == "4" and summary["replay"] == "concurrency=2"
    assert summary["kv_host_cache_bytes"] == "512000000" and summary["enable_kv_cache_reuse"] == "False"
    assert summary["model"] == "preset:tiny-llama" and summary["device"].startswith("fake")
    assert float(summary["ttft_ms_p99"]) >= float(summary["ttft_ms_p50"]) > 0
    # Reuse off: every missed block is missed for that reason, per request and in the summary.
    assert all(row["missed_blocks"] == row["missed_reuse_off_blocks"] == "10" for row in requests)
    assert summary["missed_blocks"] == summary["missed_reuse_off_blocks"] == "40"
    # The rich summary table is printed.
    assert "TTFT p99 (ms)" in result.output and "cache hit rate" in result.output
    assert "missed blocks by reason" in result.output and "40 reuse off" in result.output


def test_defaults_and_default_output_directory(tmp_path, dataset, fake_llms, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("bench", "--plan", tmp_path / "myplan", "--dataset", dataset)
    assert result.exit_code == 0, result.output
    (model, config, replay, _), = fake_llms
    assert model == str(tmp_path / "myplan")
    assert (config, replay) == (EngineConfig(), ReplayOptions())  # the API dataclasses' defaults
    run_dir, = (tmp_path / "out").iterdir()
    assert run_dir.name.startswith("shared-")
    summary, = read_rows(run_dir / "summary.csv")
    assert summary["label"] == "myplan" and summary["replay"] == "offline"


def test_the_default_output_directory_is_one_git_ignores_in_this_repository():
    # results/ holds committed results: a run without --output must not land where `git add -A` takes it.
    repo = Path(__file__).resolve().parent.parent
    default = bench_runner.default_output_dir("shared")
    checked = subprocess.run(["git", "-C", repo, "check-ignore", "-q", default / "summary.csv"])
    assert checked.returncode == 0, f"git does not ignore {default}"
    assert default.parts[0] != "results"


def test_summary_csv_prefix_output(tmp_path, dataset, fake_llms):
    result = invoke("bench", "--model", "preset:x", "--dataset", dataset, "--output", tmp_path / "r" / "on.csv")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r" / "on.csv").is_file() and (tmp_path / "r" / "on-requests.csv").is_file()


def test_ctrl_c_keeps_finished_rows_writes_the_summary_and_exits_130(tmp_path, dataset, fake_llms):
    fake_llms.settings["interrupt_at_step"] = 7  # sequential, 3 steps per request: 2 finish first
    out = tmp_path / "int"
    result = invoke("bench", "--model", "preset:x", "--dataset", dataset, "--output", out, "--mode", "sequential")
    assert result.exit_code == 130
    assert [row["request_id"] for row in read_rows(out / "requests.csv")] == ["0", "1"]
    summary, = read_rows(out / "summary.csv")
    assert summary["interrupted"] == "True" and summary["num_requests"] == "2"
    assert "interrupted" in result.output


@pytest.mark.parametrize("args, message", [
    (["--dataset", "{dataset}"], "give --plan DIR (from `kvtool build`) or --model preset:NAME"),
    (["--model", "preset:x"], "give --dataset FILE.jsonl"),
    (["--model", "preset:x", "--plan", "p", "--dataset", "{dataset}"], "not both"),
    (["--model", "preset:x", "--dataset", "{dataset}", "--scheduler_policy", "fast"],
     "--scheduler_policy 'fast' is unknown: use one of guaranteed_no_evict|max_utilization|static_batch"),
    (["--model", "preset:x", "--dataset", "{dataset}", "--context-chunking-policy", "lifo"],
     "--context_chunking_policy 'lifo' is unknown"),
    (["--model", "preset:x", "--dataset", "{dataset}", "--kv_host_cache_bytes", "lots"], "byte size 'lots'"),
    (["--model", "preset:x", "--dataset", "{dataset}", "--kv_host_cache_bytes", "-1"],
     "--kv_host_cache_bytes: must be >= 0 bytes, got -1"),
    (["--model", "preset:x", "--dataset", "{dataset}", "--tokens_per_block", 24], "must be a power of 2"),
    (["--model", "preset:x", "--dataset", "{dataset}", "--mode", "sequential", "--concurrency", 3],
     "contradicts concurrency 3"),
    (["--model", "preset:x", "--dataset", "{dataset}", "--mode", "burst"], "mode 'burst' is unknown"),
    (["--model", "preset:x", "--dataset", "{dataset}", "--request_rate", 0], "request_rate must be > 0"),
    (["--model", "preset:x", "--dataset", "{dataset}", "--warmup", 6], "nothing to measure"),
    (["--model", "preset:x", "--dataset", "missing.jsonl"], "missing.jsonl does not exist"),
    (["--model", "preset:x", "--dataset", "{dataset}", "--set", "bench.warmup=1"], "--set overrides a scenario"),
])
def test_user_mistakes_exit_2_with_a_message_and_no_traceback(tmp_path, dataset, fake_llms, args, message):
    args = [str(a).replace("{dataset}", str(dataset)) for a in args]
    result = invoke("bench", *args, "--output", tmp_path / "o")
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_a_token_id_outside_the_vocabulary_names_the_line(tmp_path, fake_llms):
    data = write_jsonl(tmp_path / "big.jsonl", [{"input_ids": [1], "output_tokens": 1},
                                                {"input_ids": [1, 99999], "output_tokens": 1}])
    result = invoke("bench", "--model", "preset:x", "--dataset", data, "--output", tmp_path / "o")
    assert result.exit_code == 2
    assert "big.jsonl line 2: token id 99999 is outside the model's vocabulary" in " ".join(result.output.split())


def scenario_file(tmp_path):
    path = tmp_path / "mini.yaml"
    path.write_text(yaml.safe_dump({
        "dataset": {"generator": "system-prompt", "num_groups": 2, "prompts_per_group": 2, "system_prompt_len": 16,
                    "question_len": 4, "output_len": 2},
        "bench": {"mode": "sequential"},
        "sweep": [{"label": "on", "enable_kv_cache_reuse": True}, {"label": "off", "enable_kv_cache_reuse": False}],
    }))
    return path


def test_config_runs_every_variant_into_one_summary(tmp_path, fake_llms):
    out = tmp_path / "sweep"
    result = invoke("bench", "--config", scenario_file(tmp_path), "--output", out, "--set", "bench.warmup=1",
                    "--max_batch_size", 2)
    assert result.exit_code == 0, result.output
    assert [(model, config.kv_cache_config.enable_block_reuse, replay.warmup, config.max_batch_size)
            for model, config, replay, _ in fake_llms] == [("plans/on", True, 1, 2), ("plans/off", False, 1, 2)]
    rows = read_rows(out / "summary.csv")
    assert [row["label"] for row in rows] == ["on", "off"]
    assert {row["scenario"] for row in rows} == {"mini"}
    assert len(read_rows(out / "requests-on.csv")) == 3 and len(read_rows(out / "requests-off.csv")) == 3
    # With reuse the shared system prompt is found in the cache; without it never is.
    assert int(rows[0]["reused_blocks"]) > 0 and int(rows[1]["reused_blocks"]) == 0


def test_config_errors_exit_2(tmp_path, fake_llms):
    bad = tmp_path / "bad.yaml"
    bad.write_text("dataset: {path: x.jsonl}\nbench: {concurency: 4}\n")
    result = invoke("bench", "--config", bad)
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "bad.yaml: bench: unknown key 'concurency'" in text and "concurrency" in text
    result = invoke("bench", "--config", scenario_file(tmp_path), "--label", "x")
    assert result.exit_code == 2 and "--label names a single run" in result.output


# -- the real runtime -------------------------------------------------------------------------

def test_bench_end_to_end_on_the_tiny_llama_preset(tmp_path, tiny_llama_plan):
    prefix = list(range(300, 348))  # 3 blocks of 16 shared by every request
    data = write_jsonl(tmp_path / "tiny.jsonl", [{"input_ids": prefix + [20 + i] * 5, "output_tokens": 4}
                                                 for i in range(4)])
    out = tmp_path / "real"
    result = invoke("bench", "--plan", tiny_llama_plan, "--dataset", data, "--output", out, "--mode", "sequential",
                    "--max_tokens_in_paged_kv_cache", 1024, "--tokens_per_block", 16)
    assert result.exit_code == 0, result.output
    requests = read_rows(out / "requests.csv")
    assert len(requests) == 4 and all(row["error"] == "" for row in requests)
    assert all(int(row["output_tokens"]) == 4 and int(row["input_tokens"]) == 53 for row in requests)
    # Sequential: every request after the first finds the shared prefix cached.
    assert [int(row["reused_tokens"]) for row in requests] == [0, 48, 48, 48]
    summary, = read_rows(out / "summary.csv")
    assert int(summary["reused_blocks"]) == 9 and summary["plan_tokens_per_block"] == "16"
    assert summary["device"].startswith(("cpu:", "cuda:"))


def test_multi_turn_text_sessions_end_to_end_reuse_their_history(tmp_path, tiny_llama_plan):
    data = write_jsonl(tmp_path / "chat.jsonl", [
        {"session_id": "a", "turn": 0, "prompt": "Explain what a KV cache is, for an engineer.", "max_tokens": 20},
        {"session_id": "a", "turn": 1, "prompt": "Now explain block reuse.", "max_tokens": 4},
    ])
    out = tmp_path / "chat"
    result = invoke("bench", "--plan", tiny_llama_plan, "--dataset", data, "--output", out)
    assert result.exit_code == 0, result.output
    first, second = read_rows(out / "requests.csv")
    # Byte-level tokenizer: BOS + 44 bytes; turn 1 = that + 20 generated tokens + 24 bytes (no second BOS).
    assert int(first["input_tokens"]) == 45
    assert int(second["input_tokens"]) == 45 + 20 + 24
    # The history's KV exists for every token but the last generated one (64 of 65): 4 full blocks of 16.
    assert int(second["reused_tokens"]) == 64


def test_a_scenario_end_to_end_on_a_built_plan(tmp_path, tiny_llama_plan):
    config = tmp_path / "reuse.yaml"
    config.write_text(yaml.safe_dump({
        "dataset": {"generator": "system-prompt", "num_groups": 1, "prompts_per_group": 3, "system_prompt_len": 64,
                    "question_len": 8, "output_len": 2},
        "bench": {"mode": "sequential"},
        "sweep": [{"label": "on", "enable_kv_cache_reuse": True}, {"label": "off", "enable_kv_cache_reuse": False}]}))
    out = tmp_path / "sweep"
    result = invoke("bench", "--config", config, "--plan", tiny_llama_plan, "--output", out)
    assert result.exit_code == 0, result.output
    on, off = read_rows(out / "summary.csv")
    assert (on["label"], off["label"]) == ("on", "off")
    assert [int(r["reused_tokens"]) for r in read_rows(out / "requests-on.csv")] == [0, 64, 64]
    assert [int(r["reused_tokens"]) for r in read_rows(out / "requests-off.csv")] == [0, 0, 0]
    assert int(on["reused_blocks"]) == 8 and int(off["reused_blocks"]) == 0


def test_bench_refuses_a_block_size_the_plan_was_not_built_with(tmp_path, tiny_llama_plan):
    data = write_jsonl(tmp_path / "t.jsonl", [{"input_ids": [5, 6, 7], "output_tokens": 1}])
    result = invoke("bench", "--plan", tiny_llama_plan, "--dataset", data, "--output", tmp_path / "o",
                    "--tokens_per_block", 64)
    assert result.exit_code == 2
    assert "--tokens_per_block 64 does not match the plan" in " ".join(result.output.split())


@pytest.mark.parametrize("text, size", [("1073741824", 1 << 30), ("1GiB", 1 << 30), ("512MB", 512_000_000),
                                        ("512MiB", 512 << 20), ("2G", 2 << 30), ("1.5KiB", 1536), ("0", 0)])
def test_host_cache_sizes_accept_bytes_and_units(text, size):
    from kvtool.units import parse_bytes

    assert parse_bytes(text) == size


def test_an_error_that_stops_the_run_still_writes_the_summary_and_exits_2(tmp_path, dataset, fake_llms):
    fake_llms.settings["fail_at_step"] = 7  # sequential, 3 steps per request: 2 finish first
    out = tmp_path / "failed"
    result = invoke("bench", "--model", "preset:x", "--dataset", dataset, "--output", out, "--mode", "sequential")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "Error: step 7: the engine failed" in result.output and "stopped by an error" in result.output
    summary, = read_rows(out / "summary.csv")
    assert summary["interrupted"] == "True" and summary["run_error"] == "step 7: the engine failed"
    assert summary["num_requests"] == "2" and len(read_rows(out / "requests.csv")) == 2


def test_a_request_refused_mid_run_is_an_error_row_and_the_bench_exits_3(tmp_path, dataset, fake_llms):
    fake_llms.settings["refuse_when_added"] = lambda prompt: "refused" if prompt[-1] == 12 else None
    out = tmp_path / "errors"
    result = invoke("bench", "--model", "preset:x", "--dataset", dataset, "--output", out)
    assert result.exit_code == 3, result.output
    summary, = read_rows(out / "summary.csv")
    assert (summary["num_requests"], summary["num_errors"], summary["interrupted"]) == ("5", "1", "False")
    assert "requests (errors)" in result.output and "5 (1)" in result.output
    assert re.search(r"Error: 1 of 6 requests failed; their error: 1 × .*refused", " ".join(result.output.split()))
    allowed = invoke("bench", "--model", "preset:x", "--dataset", dataset, "--output", out, "--allow_errors")
    assert allowed.exit_code == 0, allowed.output
