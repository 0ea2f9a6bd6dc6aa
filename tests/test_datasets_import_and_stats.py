"""ShareGPT import and dataset statistics."""

from __future__ import annotations

import json

import pytest

from kvtool.workloads.stats import dataset_stats
from kvtool.workloads.datasets import load_dataset, write_jsonl
from kvtool.workloads.sharegpt import approximate_token_count, import_sharegpt
from kvtool.errors import DatasetError

SHAREGPT = [
    {"id": "c1", "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "What is KV cache reuse?"},
        {"from": "gpt", "value": "x" * 40},
        {"from": "human", "value": "And offloading?"},
        {"from": "gpt", "value": "y" * 9},
    ]},
    {"id": "c2", "conversations": [{"from": "gpt", "value": "orphan answer"}]},   # no human turn: skipped
    {"id": "c3", "conversations": [
        {"from": "human", "value": "part one"}, {"from": "human", "value": "part two"},
        {"from": "gpt", "value": "z" * 8},
        {"from": "human", "value": "unanswered"},
    ]},
    {"id": "c1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    "not a conversation",
]


def write_sharegpt(tmp_path, entries=SHAREGPT):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return path


def test_sharegpt_conversations_become_sessions_turn_by_turn(tmp_path):
    result = import_sharegpt(write_sharegpt(tmp_path))
    assert (result.num_sessions, result.num_turns, result.num_skipped_conversations) == (3, 4, 2)
    assert [(line["session_id"], line["turn"]) for line in result.lines] == [("c1", 0), ("c3", 0), ("c1+", 0), ("c1", 1)]
    first = result.lines[0]
    assert first["prompt"] == "Be brief.\nWhat is KV cache reuse?"      # the system message leads the first turn
    assert first["max_tokens"] == 10                                    # 40 characters / 4
    assert result.lines[3]["max_tokens"] == 3                           # ceil(9 / 4)
    assert result.lines[1]["prompt"] == "part one\npart two"            # consecutive human messages are joined
    # The lines form a valid dataset.
    dataset = load_dataset(write_jsonl(tmp_path / "d.jsonl", result.lines))
    assert dataset.num_sessions == 3


def test_sharegpt_import_with_a_tokenizer_and_limits(tmp_path):
    result = import_sharegpt(write_sharegpt(tmp_path), count_tokens=lambda text: len(text.split()) + 100,
                             max_sessions=1, max_turns=1, max_output_tokens=50)
    assert [(line["session_id"], line["turn"], line["max_tokens"]) for line in result.lines] == [("c1", 0, 50)]


def test_approximate_token_count():
    assert approximate_token_count("") == 1
    assert approximate_token_count("abcd") == 1
    assert approximate_token_count("abcde") == 2


def test_sharegpt_file_errors(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        import_sharegpt(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(DatasetError, match="not valid JSON"):
        import_sharegpt(tmp_path / "bad.json")
    (tmp_path / "obj.json").write_text("{}")
    with pytest.raises(DatasetError, match="expected a JSON list"):
        import_sharegpt(tmp_path / "obj.json")


def test_stats_count_shared_full_blocks_by_hand(tmp_path):
    shared = list(range(100, 108))  # two blocks of 4
    lines = [
        {"input_ids": shared + [1, 2, 3], "output_tokens": 2},      # 11 tokens, nothing seen before
        {"input_ids": shared + [4, 5, 6, 7], "output_tokens": 4},   # 12 tokens: 2 shared blocks = 8 tokens
        {"input_ids": [9, 9, 9], "output_tokens": 1},               # no full block
        {"prompt": "text", "max_tokens": 3},
    ]
    stats = dataset_stats(load_dataset(write_jsonl(tmp_path / "d.jsonl", lines)), tokens_per_block=4)
    assert (stats.num_lines, stats.num_text_prompts, stats.num_sessions) == (4, 1, 0)
    assert stats.total_prompt_tokens == 26
    assert stats.shared_prefix_tokens == 8
    assert stats.shared_prefix_fraction == pytest.approx(8 / 26)
    assert (stats.prompt_tokens.min, stats.prompt_tokens.max) == (3, 12)
    assert (stats.output_tokens.min, stats.output_tokens.max, stats.output_tokens.count) == (1, 4, 4)


def test_stats_follow_session_history(tmp_path):
    lines = [{"session_id": "a", "turn": 0, "input_ids": [1, 2, 3, 4], "output_tokens": 4},
             {"session_id": "a", "turn": 1, "input_ids": [5, 6, 7, 8], "output_tokens": 1}]
    stats = dataset_stats(load_dataset(write_jsonl(tmp_path / "d.jsonl", lines)), tokens_per_block=4)
    # Turn 1's prompt: 4 history + 4 answer + 4 new = 12 tokens; the first 8 (2 blocks) were seen.
    assert stats.prompt_tokens.max == 12 and stats.new_tokens.max == 4
    assert stats.shared_prefix_tokens == 8  # the history block and the cached answer block
    assert stats.total_prompt_tokens == 16
