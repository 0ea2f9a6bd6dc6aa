"""What `kvtool bench` checks and reports before the first request, on the real runtime (tiny-llama):
the KV pools it created (printed and in the summary), a host cache larger than memory that the
dataset cannot fill, and every request the plan and limits cannot serve."""

from __future__ import annotations

import csv
import random

import pytest
from typer.testing import CliRunner

from kvtool.workloads.datasets import load_dataset, write_jsonl
from kvtool.workloads.requests import dataset_requests
from kvtool.workloads.blocks import max_num_blocks
from kvtool.cli import app
from kvtool.plan import load_plan

cli = CliRunner()
BLOCK_BYTES = 2 * 2 * 16 * 2 * 32 * 4  # tiny-llama, float32, 16 tokens per block: 16 KiB


def bench(*args):
    result = cli.invoke(app, ["bench", *map(str, args)], env={"COLUMNS": "200"})
    result.text = " ".join(result.output.split())
    return result


def summary(out):
    with (out / "summary.csv").open() as f:
        return next(csv.DictReader(f))


def random_prompts(tmp_path, num_requests, prompt_len=160, output_len=4, name="r.jsonl"):
    rng = random.Random(0)
    return write_jsonl(tmp_path / name, [{"input_ids": [rng.randrange(10, 1000) for _ in range(prompt_len)],
                                          "output_tokens": output_len} for _ in range(num_requests)])


def test_the_pools_created_are_printed_and_recorded(tmp_path, tiny_llama_plan):
    data = random_prompts(tmp_path, 2, prompt_len=40)
    out = tmp_path / "out"
    result = bench("--plan", tiny_llama_plan, "--dataset", data, "--output", out, "--max_tokens_in_paged_kv_cache",
                   2000, "--kv_host_cache_bytes", "1MiB")
    assert result.exit_code == 0, result.output
    # 2000 tokens round up to 125 blocks of 16.
    assert ("KV cache: primary 125 blocks x 16 tokens = 2,000 tokens (2.0 MiB, cpu); host 64 blocks = 1,024 tokens "
            "(1.0 MiB, allocated as blocks are offloaded)") in result.text
    row = summary(out)
    assert (row["kv_primary_blocks"], row["kv_primary_tokens"], row["kv_primary_bytes"]) == \
        ("125", "2000", str(125 * BLOCK_BYTES))
    assert (row["kv_host_blocks"], row["kv_host_bytes"]) == ("64", str(1 << 20))


@pytest.fixture
def two_mib_of_host_memory(monkeypatch):
    """As if the machine had 2 MiB of memory available: with a 16-block primary pool (256 KiB), 112 host
    blocks fit."""
    monkeypatch.setattr("kvtool.runtime.model_runner.available_host_memory_bytes", lambda: 2 << 20)


def test_a_host_cache_beyond_memory_runs_when_the_dataset_cannot_fill_it(tmp_path, tiny_llama_plan,
                                                                         two_mib_of_host_memory):
    data = random_prompts(tmp_path, 4)  # 4 requests x 11 blocks: 44 blocks at most
    plan = load_plan(tiny_llama_plan)
    assert max_num_blocks(dataset_requests(load_dataset(data), tokenizer=plan.tokenizer), 16) == 44
    out = tmp_path / "out"
    result = bench("--plan", tiny_llama_plan, "--dataset", data, "--output", out, "--mode", "sequential",
                   "--max_tokens_in_paged_kv_cache", 256, "--kv_host_cache_bytes", "1GiB")
    assert result.exit_code == 0, result.output
    assert ("--kv_host_cache_bytes 1,073,741,824 bytes (1.0 GiB) is more than the 1.8 MiB of host memory "
            "available, but it is a limit (allocated as blocks are offloaded) and this workload can put at most 44 "
            "blocks (704.0 KiB) there: going ahead") in result.text
    row = summary(out)
    assert row["kv_host_blocks"] == str((1 << 30) // BLOCK_BYTES) and row["num_errors"] == "0"
    # What the run really kept (everything it computed stays cached, in one tier or the other) is within the bound.
    assert 0 < int(row["secondary_cached_blocks"]) + int(row["primary_cached_blocks"]) <= 44
    assert int(row["offloaded_blocks"]) > 0


def test_a_host_cache_the_dataset_could_overfill_is_refused_by_how_much(tmp_path, tiny_llama_plan,
                                                                       two_mib_of_host_memory):
    data = random_prompts(tmp_path, 12)  # 132 blocks: 20 more than the 112 that fit
    result = bench("--plan", tiny_llama_plan, "--dataset", data, "--output", tmp_path / "out",
                   "--max_tokens_in_paged_kv_cache", 256, "--kv_host_cache_bytes", "1GiB")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert (f"exceeds the {112 * BLOCK_BYTES:,} bytes (1.8 MiB) of host memory available, and this workload can fill "
            f"{132 * BLOCK_BYTES:,} bytes (2.1 MiB) of it, {20 * BLOCK_BYTES:,} bytes (320.0 KiB) more than "
            "available") in result.text
    assert not (tmp_path / "out").exists()


def test_requests_the_limits_cannot_serve_are_all_named_before_anything_runs(tmp_path, tiny_llama_plan):
    lines = [{"input_ids": [20 + i] * 10, "output_tokens": 2} for i in range(8)]
    lines[4] = {"input_ids": [7] * 300, "output_tokens": 2}   # line 5: longer than --max_seq_len 256
    lines[6] = {"input_ids": [7] * 10, "output_tokens": 250}  # line 7 too
    data = write_jsonl(tmp_path / "d.jsonl", lines)
    result = bench("--plan", tiny_llama_plan, "--dataset", data, "--output", tmp_path / "out", "--mode", "sequential",
                   "--max_seq_len", 256)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"2 of the 8 requests in {data} cannot run with this plan and these limits (nothing was run" in result.text
    assert (f"{data} line 5: prompt of 300 tokens + 2 output tokens = 302 tokens exceeds --max_seq_len 256"
            in result.text)
    assert f"{data} line 7: prompt of 10 tokens + 250 output tokens = 260 tokens" in result.text
    assert not (tmp_path / "out").exists()
