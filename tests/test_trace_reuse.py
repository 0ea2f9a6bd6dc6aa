"""A sequential `kvtool simulate` of a slice of the Mooncake conversation trace reuses exactly the
prompt tokens that an independent LRU model of kvtool's cache reuses (tests/lru_reference.py),
request by request, and leaves the pool as it says: evicted, cached and free blocks."""

from __future__ import annotations

import csv
import json

import pytest
from lru_reference import sequential_reuse
from trace_data import mooncake_slice
from typer.testing import CliRunner

from kvtool.cli import app


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def read_rows(path):
    with open(path, newline="") as source:
        return list(csv.DictReader(source))


CASES = {
    # Whole prompts (up to 126k tokens in the trace) on the 128k preset, a pool of a few of them.
    "whole_prompts": dict(start=6000, count=150, shrink=1, tokens_per_block=32, spare_blocks=200),
    # A thousand requests shrunk 16 times (a hash id: two blocks of 16), in a pool where recency decides.
    "shrunk": dict(start=0, count=1000, shrink=16, tokens_per_block=16, spare_blocks=15000),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_sequential_simulation_reuses_what_an_lru_cache_of_its_size_reuses(tmp_path, name):
    case = CASES[name]
    raw = mooncake_slice(tmp_path, case["count"], start=case["start"])
    # The simulation reads the dataset a user imports (hash ids); the reference the same rows' token ids.
    dataset, with_ids = tmp_path / "trace.jsonl", tmp_path / "trace_ids.jsonl"
    for output, more in ((dataset, ()), (with_ids, ("--write_token_ids",))):
        result = invoke("dataset", "import", raw, "--format", "mooncake", "--output", output, "--shrink",
                        case["shrink"], "--max_output_tokens", 16, *more)
        assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in with_ids.read_text().splitlines()]
    requests = [(line["input_ids"], line["output_tokens"]) for line in lines]
    tpb = case["tokens_per_block"]
    num_blocks = max(-(-(len(prompt) + output) // tpb) for prompt, output in requests) + case["spare_blocks"]

    result = invoke("simulate", "--model", "preset:qwen3-8b-128k", "--profile", "h100", "--dataset", dataset,
                    "--mode", "sequential", "--max_seq_len", 131072, "--enable_chunked_context",
                    "--tokens_per_block", tpb, "--max_tokens_in_paged_kv_cache", num_blocks * tpb,
                    "--output", tmp_path / "sim")
    assert result.exit_code == 0, result.output
    rows = sorted(read_rows(tmp_path / "sim" / "requests.csv"), key=lambda row: int(row["request_id"]))
    [summary] = read_rows(tmp_path / "sim" / "summary.csv")
    assert int(summary["kv_primary_blocks"]) == num_blocks

    expected = sequential_reuse(requests, tokens_per_block=tpb, num_blocks=num_blocks)
    assert [int(row["reused_tokens"]) for row in rows] == expected.reused_tokens
    assert int(summary["total_reused_tokens"]) == sum(expected.reused_tokens)
    assert float(summary["token_hit_rate"]) == pytest.approx(
        sum(expected.reused_tokens) / sum(len(prompt) for prompt, _ in requests), abs=1e-6)
    assert (int(summary["evicted_blocks"]), int(summary["primary_cached_blocks"]),
            int(summary["primary_free_blocks"])) == (expected.num_evicted_blocks, expected.num_cached_blocks,
                                                     expected.num_free_blocks)
    # The pool's size decides what is reused: without eviction more would be.
    unbounded = sequential_reuse(requests, tokens_per_block=tpb)
    assert expected.num_evicted_blocks > 0 and sum(unbounded.reused_tokens) > sum(expected.reused_tokens) > 0


def test_the_reference_counts_the_last_token_partial_copies_and_generated_blocks():
    # Blocks of 4. A repeated prompt of whole blocks reuses all but its last token: 3 blocks + 3 tokens
    # copied from the cached block that holds the last one.
    a = list(range(10, 26))
    assert sequential_reuse([(a, 1), (a, 1)], tokens_per_block=4).reused_tokens == [0, 15]
    # A prompt ending mid-block: the first request's answer filled that block, so the repeat copies
    # the 2 prompt tokens it holds (its last token, the 3rd, is computed).
    b = list(range(10, 21))
    assert sequential_reuse([(b, 5), (b, 5)], tokens_per_block=4).reused_tokens == [0, 10]
    # A pool of 5 blocks: d takes the free one and evicts c's last three (released first: the least
    # recently used); c comes back, reuses its first block and evicts d's last three.
    c, d = list(range(100, 116)), list(range(200, 216))
    result = sequential_reuse([(c, 1), (d, 1), (c, 1)], tokens_per_block=4, num_blocks=5)
    assert result.reused_tokens == [0, 0, 4] and result.num_evicted_blocks == 6
    assert (result.num_cached_blocks, result.num_free_blocks) == (5, 0)
    assert sequential_reuse([(c, 1), (d, 1), (c, 1)], tokens_per_block=4, num_blocks=9).reused_tokens == [0, 0, 15]
