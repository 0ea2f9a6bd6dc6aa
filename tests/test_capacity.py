"""`kvtool simulate --sweep_capacity`: one command sweeps the GPU pool and the host cache over a trace
and writes capacity.csv and capacity.png, the reused-token ratio and TTFT against cache capacity with
the infinite cache as the ceiling. Replayed one request at a time, the infinite cache reuses exactly
what an unbounded LRU model reuses (tests/lru_reference.py), a GPU pool alone what an LRU cache of
its size reuses, and more capacity never reuses less."""

from __future__ import annotations

import csv
import json

import pytest
from lru_reference import sequential_reuse
from trace_data import mooncake_slice
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.simulate.capacity import PoolProbe, capacity_variants

TPB = 32
SIMULATE = ("simulate", "--model", "preset:qwen3-8b-128k", "--profile", "h100", "--max_seq_len", 131072,
            "--enable_chunked_context", "--tokens_per_block", TPB)


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """The trace's first 300 requests, shrunk 16 times: (the dataset, its token ids and output lengths)."""
    directory = tmp_path_factory.mktemp("trace")
    raw = mooncake_slice(directory, 300)
    for name, more in (("trace.jsonl", ()), ("trace_ids.jsonl", ("--write_token_ids",))):
        result = invoke("dataset", "import", raw, "--format", "mooncake", "--output", directory / name, "--shrink", 16,
                        "--max_output_tokens", 8, *more)
        assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in (directory / "trace_ids.jsonl").read_text().splitlines()]
    return directory / "trace.jsonl", [(line["input_ids"], line["output_tokens"]) for line in lines]


def test_a_capacity_sweep_rises_to_the_infinite_cache_an_lru_model_predicts(trace, tmp_path):
    dataset, requests = trace
    gpu_sizes = (12_000, 24_000)
    result = invoke(*SIMULATE, "--dataset", dataset, "--mode", "sequential", "--sweep_capacity",
                    "--sweep", f"max_tokens_in_paged_kv_cache={','.join(map(str, gpu_sizes))}", "--output", tmp_path)
    assert result.exit_code == 0, result.output
    assert "reused-token ratio and predicted TTFT against cache capacity" in " ".join(result.output.split())
    with (tmp_path / "capacity.csv").open(newline="") as source:
        points = list(csv.DictReader(source))
    assert (tmp_path / "capacity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    *finite, infinite = points
    assert infinite["label"] == "infinite" and infinite["infinite_cache"] == "True"
    assert all(p["infinite_cache"] == "False" for p in finite)
    num_prompt_tokens = sum(len(prompt) for prompt, _ in requests)
    unbounded = sequential_reuse(requests, tokens_per_block=TPB)
    assert float(infinite["reused_token_ratio"]) == sum(unbounded.reused_tokens) / num_prompt_tokens
    for gpu in gpu_sizes:
        line = [p for p in finite if int(p["gpu_pool_tokens"]) == gpu]
        # The host cache grows from the largest pool by 4 while the trace can fill it: 0, 24k, 96k tokens.
        assert [int(p["host_cache_tokens"]) for p in line] == [0, 24_000, 96_000]
        assert all(int(p["cache_capacity_tokens"]) == int(p["gpu_pool_tokens"]) + int(p["host_cache_tokens"])
                   for p in line)
        lru = sequential_reuse(requests, tokens_per_block=TPB, num_blocks=gpu // TPB)
        assert float(line[0]["reused_token_ratio"]) == sum(lru.reused_tokens) / num_prompt_tokens
        ratios = [float(p["reused_token_ratio"]) for p in line] + [float(infinite["reused_token_ratio"])]
        assert ratios == sorted(ratios) and ratios[0] < ratios[-1]
        assert all(float(p["ttft_ms_p50"]) > 0 and float(p["ttft_ms_p90"]) >= float(p["ttft_ms_p50"]) for p in line)


def test_default_pools_are_fractions_of_the_device_none_smaller_than_the_longest_request():
    probe = PoolProbe(num_primary_blocks=1000, tokens_per_block=16, block_bytes=100, num_workload_blocks=20_000,
                      num_request_blocks=300)
    variants = capacity_variants(probe, gpu_fixed=False)
    gpu = sorted({v["max_tokens_in_paged_kv_cache"] for v in variants if v["label"] != "infinite"})
    assert gpu == [300 * 16, 500 * 16, 1000 * 16]
    host = sorted({v["kv_host_cache_bytes"] for v in variants if v["label"] != "infinite"})
    assert host == [0, 1000 * 100, 4000 * 100, 16000 * 100]
    assert variants[-1] == {"label": "infinite", "max_tokens_in_paged_kv_cache": 16000,
                            "kv_host_cache_bytes": 20_000 * 100}
    fixed = capacity_variants(probe, gpu_fixed=True)
    assert all("max_tokens_in_paged_kv_cache" not in v for v in fixed) and len(fixed) == 5


@pytest.mark.parametrize("flags, expected", [
    (("--kv_host_cache_bytes", "1GiB"), "--kv_host_cache_bytes is given and --sweep_capacity sweeps it"),
    (("--sweep", "max_batch_size=4,8"), "--sweep max_batch_size=4,8: --sweep_capacity sweeps only"),
    (("--max_tokens_in_paged_kv_cache", 12_000, "--sweep", "max_tokens_in_paged_kv_cache=12000,24000"),
     "--max_tokens_in_paged_kv_cache is given and swept"),
])
def test_a_capacity_sweep_it_cannot_run_is_a_one_line_error(trace, tmp_path, flags, expected):
    dataset, _ = trace
    result = invoke(*SIMULATE, "--dataset", dataset, "--sweep_capacity", *flags, "--output", tmp_path)
    assert result.exit_code == 2, result.output
    assert expected in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.startswith("Error")]) == 1


def test_a_capacity_sweep_needs_a_dataset(tmp_path):
    result = invoke(*SIMULATE, "--sweep_capacity", "--output", tmp_path)
    assert result.exit_code == 2 and "give --dataset FILE.jsonl to --sweep_capacity" in result.output
