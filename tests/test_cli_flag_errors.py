"""Every command's bad input names the flag to change, never the Python field it sets
(BuildOptions.max_seq_len, KvCacheConfig.max_tokens, free_gpu_memory_fraction=...): one line, exit
code 2, no traceback. A test per command, each over the error paths a user reaches."""

from __future__ import annotations

import json
import re
import socket

import pytest
from typer.testing import CliRunner

from kvtool.workloads.datasets import write_jsonl
from kvtool.cli import app

cli = CliRunner()

# A Python name where a flag belongs: a class's field, a keyword argument, a field name without its --.
PYTHON_NAMES = re.compile(
    r"\b(BuildOptions|KvCacheConfig|SchedulerConfig|EngineConfig|ReplayOptions)\b"
    r"|\b(free_gpu_memory_fraction|host_cache_size|max_new_tokens|enable_block_reuse|max_attention_window)\b"
    r"|(?<![-\w'])(tokens_per_block|max_seq_len|max_num_tokens|max_batch_size|max_tokens|dtype|num_requests"
    r"|enable_chunked_context)(?![\w'])")


def run(*args) -> str:
    result = cli.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    output = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and output.startswith("Error:"), result.output
    assert not PYTHON_NAMES.search(output), output
    return output


@pytest.fixture
def dataset(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", [{"input_ids": list(range(10, 50)), "output_tokens": 4}] * 2)


@pytest.mark.parametrize("args, message", [
    (["--tokens_per_block", 1048576], "--tokens_per_block must be a power of 2 from 2 to 256 (16, 32, 64, ...), got "
                                      "1048576"),
    (["--tokens_per_block", 1], "--tokens_per_block must be a power of 2 from 2 to 256"),
    (["--tokens_per_block", 256, "--max_seq_len", 128], "--tokens_per_block 256 is more than --max_seq_len 128: a "
                                                        "block would never fill"),
    (["--max_seq_len", 100000], "--max_seq_len 100000 exceeds the model's max_position_embeddings 4096"),
    (["--max_batch_size", 0], "--max_batch_size must be >= 1, got 0"),
    (["--max_num_tokens", 0], "--max_num_tokens must be >= 1, got 0"),
])
def test_build_names_the_flag(tmp_path, args, message):
    assert message in run("build", "--model", "preset:tiny-llama", "--output", tmp_path / "plan", *args)
    assert not (tmp_path / "plan").exists()


@pytest.mark.parametrize("args, message", [
    (["--model", "preset:tiny-llama", "--max_seq_len", 100000], "--max_seq_len 100000 exceeds the model's"),
    (["--model", "preset:tiny-llama", "--tokens_per_block", 512], "--tokens_per_block must be a power of 2 from 2 to "
                                                                  "256"),
    (["--plan", "{plan}", "--max_seq_len", 5000], "--max_seq_len 5000 is outside what the plan was built for "
                                                  "(1..1024)"),
    (["--plan", "{plan}", "--tokens_per_block", 32], "--tokens_per_block 32 does not match the plan"),
    (["--plan", "{plan}", "--kv_cache_free_gpu_mem_fraction", 1e-9], ": --kv_cache_free_gpu_mem_fraction 1e-09 of "
                                                                     "the"),
    (["--plan", "{plan}", "--max_num_tokens", 8, "--enable_chunked_context"],
     "--max_num_tokens (8) must be >= --tokens_per_block (16) with --enable_chunked_context"),
    (["--plan", "{plan}", "--max_tokens_in_paged_kv_cache", 32],
     "cannot hold one request of 44 tokens: raise --max_tokens_in_paged_kv_cache or --kv_cache_free_gpu_mem_fraction"),
    (["--plan", "{plan}", "--max_num_tokens", 32],
     "exceeds --max_num_tokens 32 tokens per step: enable chunked context (--enable_chunked_context)"),
    (["--plan", "{plan}", "--max_seq_len", 40], "44 tokens exceeds --max_seq_len 40"),
    (["--plan", "{plan}", "--cpu_kernels_isa", "avx1024"], "--cpu_kernels_isa 'avx1024' is unknown: use auto, off or "
                                                           "one of ['amx', 'avx512_bf16', 'avx512', 'avx2', 'generic']"),
    # The third KV tier: a directory that cannot be made, a size below one block, a URL that is not Redis's,
    # a server that does not answer, no host tier.
    (["--plan", "{plan}", "--kv_host_cache_bytes", "1MiB", "--kv_disk_cache_dir", "{file}/kv",
      "--kv_disk_cache_bytes", "1MiB"], "--kv_disk_cache_dir cannot use {file}/kv for the disk tier: Not a "
                                        "directory; give a writable directory"),
    (["--plan", "{plan}", "--kv_host_cache_bytes", "1MiB", "--kv_disk_cache_dir", "{tmp}/kv",
      "--kv_disk_cache_bytes", "4KiB"], "--kv_disk_cache_bytes 4096 holds no KV block: a block takes 20480 bytes"),
    (["--plan", "{plan}", "--kv_host_cache_bytes", "1MiB", "--kv_remote_cache", "http://127.0.0.1:6379"],
     "--kv_remote_cache 'http://127.0.0.1:6379' is not a Redis URL: use redis://host:port"),
    (["--plan", "{plan}", "--kv_host_cache_bytes", "1MiB", "--kv_remote_cache", "redis://127.0.0.1:1"],
     "--kv_remote_cache redis://127.0.0.1:1: no Redis server answers there"),
    (["--plan", "{plan}", "--kv_remote_cache", "redis://127.0.0.1:1"], "--kv_remote_cache needs a host cache"),
])
def test_bench_names_the_flag(tiny_llama_plan, dataset, tmp_path, args, message):
    (tmp_path / "file").write_text("")
    places = {"{plan}": str(tiny_llama_plan), "{file}": str(tmp_path / "file"), "{tmp}": str(tmp_path)}

    def placed(text):
        for name, value in places.items():
            text = str(text).replace(name, value)
        return text

    assert placed(message) in run("bench", "--dataset", dataset, "--output", tmp_path / "out", *map(placed, args))


@pytest.mark.parametrize("args, message", [
    (["--model", "preset:qwen3-8b", "--max_seq_len", 10**8], "--max_seq_len 100000000 exceeds the model's"),
    (["--model", "preset:qwen3-8b", "--max_tokens_in_paged_kv_cache", 10**9],
     "--max_tokens_in_paged_kv_cache 1,000,000,000 needs"),
    (["--plan", "{plan}", "--dtype", "bfloat16"], "--dtype bfloat16: the plan"),
    (["--plan", "{plan}", "--max_batch_size", 1000], "--max_batch_size 1000 is outside what the plan was built for"),
])
def test_simulate_names_the_flag(tiny_llama_plan, dataset, tmp_path, args, message):
    args = [str(tiny_llama_plan) if a == "{plan}" else a for a in args]
    assert message in run("simulate", "--profile", "h100", "--dataset", dataset, "--output", tmp_path / "out",
                          "--plan_cache_dir", tmp_path / "plans", *args)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    (["--model", "preset:tiny-llama", "--max_seq_len", 100000], "--max_seq_len 100000 exceeds the model's"),
    (["--model", "preset:tiny-llama", "--tokens_per_block", 1024], "--tokens_per_block must be a power of 2"),
    (["--plan", "{plan}", "--max_batch_size", 1000], "--max_batch_size 1000 is outside what the plan was built for"),
    (["--plan", "{plan}", "--tokens_per_block", 32], "--tokens_per_block 32 does not match the plan"),
    (["--plan", "{plan}", "--kv_host_cache_bytes", "1MiB", "--kv_remote_cache", "redis://127.0.0.1:1"],
     "--kv_remote_cache redis://127.0.0.1:1: no Redis server answers there"),
])
def test_serve_names_the_flag(tiny_llama_plan, tmp_path, args, message):
    args = [str(tiny_llama_plan) if a == "{plan}" else a for a in args]
    assert message in run("serve", "--host", "127.0.0.1", "--port", _free_port(), "--plan_cache_dir",
                          tmp_path / "plans", *args)


def test_calibrate_names_the_flag_of_a_build_option_this_kvtool_refuses(tmp_path):
    from kvtool.plan import BuildOptions, build_plan
    from kvtool.plan.format import PLAN_FILE, manifest_digest

    plan_dir = build_plan("preset:tiny-llama", tmp_path / "old", BuildOptions(tokens_per_block=16, max_seq_len=256))
    manifest = json.loads((plan_dir / PLAN_FILE).read_text())
    manifest["build_options"]["tokens_per_block"] = 1  # what an older kvtool let `kvtool build` write
    manifest["plan_digest"] = manifest_digest(manifest)
    (plan_dir / PLAN_FILE).write_text(json.dumps(manifest))
    output = run("calibrate", "--plan", plan_dir, "--quick")
    assert "records a build option this kvtool refuses (--tokens_per_block must be a power of 2" in output
    assert f"rebuild it with `kvtool build --model preset:tiny-llama --output {plan_dir}`" in output


@pytest.mark.parametrize("args, message", [
    (["random", "--num_requests", 0], "--num_requests must be a positive integer, got 0"),
    (["random", "--min_token_id", 10, "--max_token_id", 5], "--max_token_id (5) must be greater than --min_token_id "
                                                            "(10)"),
    (["prefix-repetition", "--num_prefixes", 8, "--num_requests", 4], "--num_requests (4) must be >= --num_prefixes "
                                                                      "(8)"),
    (["multi-turn", "--user_turn_len", 0], "--user_turn_len must be a positive integer"),
    (["system-prompt", "--length_spread", 2], "--length_spread must be a fraction in [0, 1)"),
    (["stats", "{dataset}", "--tokens_per_block", 0], "--tokens_per_block must be >= 1, got 0"),
    (["import-sharegpt", "{sharegpt}", "--max_sessions", 0], "--max_sessions must be a positive integer, got 0"),
])
def test_dataset_names_the_flag(dataset, tmp_path, args, message):
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"},
                                                       {"from": "gpt", "value": "hello"}]}]))
    args = [{"{dataset}": str(dataset), "{sharegpt}": str(sharegpt)}.get(str(a), a) for a in args]
    if args[0] != "stats":
        args += ["--output", tmp_path / "out.jsonl"]
    assert message in run("dataset", *args)
    assert not (tmp_path / "out.jsonl").exists()
