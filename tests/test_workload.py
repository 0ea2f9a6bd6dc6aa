"""The most KV blocks a dataset can create (what it can ever put in a host cache), against counts
worked out by hand and an actual run that offloads everything it can."""

from __future__ import annotations

from bench_fakes import FakeTokenizer

from kvtool.workloads.datasets import load_dataset, write_jsonl
from kvtool.workloads.requests import dataset_requests
from kvtool.workloads.blocks import max_num_blocks


def requests_of(tmp_path, lines):
    return dataset_requests(load_dataset(write_jsonl(tmp_path / "d.jsonl", lines)), tokenizer=FakeTokenizer(1000))


def test_shared_prompt_blocks_count_once_and_generated_blocks_per_request(tmp_path):
    shared = list(range(100, 132))  # 8 blocks of 4
    lines = [{"input_ids": shared + [i, i], "output_tokens": 3} for i in range(5)]
    # Each request: 8 shared blocks + its own 2 prompt tokens and 3 generated = 5 tokens -> 2 more blocks.
    assert max_num_blocks(requests_of(tmp_path, lines), tokens_per_block=4) == 8 + 5 * 2


def test_a_block_after_a_different_one_is_a_block_of_its_own(tmp_path):
    x, y, z, w = ([base + i for i in range(4)] for base in (100, 200, 300, 400))
    lines = [{"input_ids": x + y + z, "output_tokens": 4}, {"input_ids": x + w + z, "output_tokens": 4},
             {"input_ids": x + y, "output_tokens": 4}, {"input_ids": x + y + z + w, "output_tokens": 4}]
    # x y z; then w and z after it (x shared); then nothing new; then w after z. One generated block each.
    assert max_num_blocks(requests_of(tmp_path, lines), tokens_per_block=4) == 3 + 2 + 0 + 1 + 4


def test_cache_salt_and_extra_ids_make_blocks_distinct(tmp_path):
    ids = list(range(10, 18))
    lines = [{"input_ids": ids, "output_tokens": 1}, {"input_ids": ids, "output_tokens": 1, "cache_salt": "a"},
             {"input_ids": ids, "output_tokens": 1, "extra_ids": [0, 0, 0, 0, 7, 7, 7, 7]},
             {"input_ids": ids, "output_tokens": 1}]
    # 2 prompt blocks each; the plain ones share both, the extra ids share the first; 1 generated block each.
    assert max_num_blocks(requests_of(tmp_path, lines), tokens_per_block=4) == 2 + 2 + 1 + 4


def test_a_session_counts_its_whole_conversation(tmp_path):
    lines = [{"session_id": "s", "turn": 0, "input_ids": list(range(10, 16)), "output_tokens": 3},
             {"session_id": "s", "turn": 1, "input_ids": list(range(20, 25)), "output_tokens": 2}]
    # Turn 0: 6 + 3 = 9 tokens -> 3 blocks (2 of them partly generated). Turn 1: 9 + 5 + 2 = 16 tokens
    # -> 4 blocks, of which the 2 full blocks of turn 0 are shared: 2 more.
    assert max_num_blocks(requests_of(tmp_path, lines), tokens_per_block=4) == 3 + 2
