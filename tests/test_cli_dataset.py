"""`kvtool dataset ...`: every subcommand writes a valid dataset; mistakes exit 2 with one line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtool.workloads.datasets import load_dataset
from kvtool.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("command, flags, num_lines, num_sessions", [
    ("system-prompt", ["--num_groups", 2, "--prompts-per-group", 3, "--system_prompt_len", 16, "--question-len", 4,
                       "--output_len", 2], 6, 0),
    ("multi-turn", ["--num-sessions", 2, "--num_turns", 3, "--user-turn-len", 4, "--answer_len", 2,
                    "--system-prompt-len", 8, "--per-session-system-prompt"], 6, 2),
    ("abab", ["--prompt_len", 16, "--num-rounds", 3, "--output-len", 1], 6, 0),
    ("random", ["--num-requests", 5, "--input_len", 8, "--output_len", 2, "--length-spread", 0.5], 5, 0),
    ("prefix-repetition", ["--num_prefixes", 2, "--prefix-len", 8, "--suffix_len", 2, "--num-requests", 6,
                           "--output-len", 2], 6, 0),
])
def test_generators_write_valid_datasets_with_both_flag_spellings(tmp_path, command, flags, num_lines, num_sessions):
    out = tmp_path / f"{command}.jsonl"
    result = invoke("dataset", command, "--output", out, "--seed", 4, "--min-token-id", 20, "--max_token_id", 90,
                    *flags)
    assert result.exit_code == 0, result.output
    assert f"wrote {num_lines} requests" in result.output
    dataset = load_dataset(out)
    assert len(dataset) == num_lines and dataset.num_sessions == num_sessions
    assert all(20 <= t < 90 for r in dataset.records for t in r.input_ids)


def test_same_seed_writes_the_same_file(tmp_path):
    for name in ("a", "b"):
        assert invoke("dataset", "random", "--output", tmp_path / f"{name}.jsonl", "--seed", 9).exit_code == 0
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


@pytest.mark.parametrize("args, message", [
    (["random", "--num-requests", 0], "--num_requests must be a positive integer, got 0"),
    (["random", "--min_token_id", 50, "--max_token_id", 10], "must be greater than --min_token_id"),
    (["abab", "--length_spread", 2], "--length_spread must be a fraction"),
])
def test_bad_values_exit_2_with_one_line_and_no_traceback(tmp_path, args, message):
    result = invoke("dataset", *args[:1], "--output", tmp_path / "x.jsonl", *args[1:])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "x.jsonl").exists()


def test_output_is_required(tmp_path):
    result = invoke("dataset", "random")
    assert result.exit_code == 2 and "--output" in result.output


def test_import_sharegpt_and_stats(tmp_path):
    source = tmp_path / "sg.json"
    source.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hello there"},
                                                     {"from": "gpt", "value": "a" * 20}]}]))
    out = tmp_path / "sg.jsonl"
    result = invoke("dataset", "import-sharegpt", source, "--output", out, "--max-turns", 2)
    assert result.exit_code == 0, result.output
    assert "wrote 1 turns in 1 sessions" in result.output and "characters / 4" in result.output
    record, = load_dataset(out).records
    assert (record.prompt, record.output_tokens, record.session_id) == ("hello there", 5, "0")

    stats = invoke("dataset", "stats", out)
    assert stats.exit_code == 0 and "1 text prompts" in stats.output


def test_import_sharegpt_counts_with_a_plan_tokenizer(tmp_path, tiny_llama_plan):
    source = tmp_path / "sg.json"
    source.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"},
                                                     {"from": "gpt", "value": "abcdefgh"}]}]))
    result = invoke("dataset", "import-sharegpt", source, "--output", tmp_path / "o.jsonl", "--plan", tiny_llama_plan)
    assert result.exit_code == 0, result.output
    assert "counted with the tokenizer" in result.output
    # The presets' byte-level tokenizer: BOS + one token per byte.
    assert load_dataset(tmp_path / "o.jsonl").records[0].output_tokens == 9


def test_import_sharegpt_errors_are_one_line(tmp_path):
    result = invoke("dataset", "import-sharegpt", tmp_path / "none.json", "--output", tmp_path / "o.jsonl")
    assert result.exit_code == 2 and "does not exist" in result.output and "Traceback" not in result.output
    (tmp_path / "empty.json").write_text("[]")
    result = invoke("dataset", "import-sharegpt", tmp_path / "empty.json", "--output", tmp_path / "o.jsonl")
    assert result.exit_code == 2 and "has no conversation" in result.output


def test_stats_prints_counts_and_shared_prefix_fraction(tmp_path):
    out = tmp_path / "sp.jsonl"
    invoke("dataset", "system-prompt", "--output", out, "--num-groups", 2, "--prompts-per-group", 2,
           "--system-prompt-len", 32, "--question-len", 8, "--output-len", 4)
    result = invoke("dataset", "stats", out, "--tokens-per-block", 16)
    assert result.exit_code == 0, result.output
    assert "4 requests" in result.output
    # 2 of 4 requests reuse 2 blocks of 16 each: 64 of 160 prompt tokens.
    assert "shared prefix fraction: 40.0%" in result.output


def test_stats_of_a_malformed_file_names_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1], "output_tokens": 1}\n{"input_ids": [1]}\n')
    result = invoke("dataset", "stats", bad)
    assert result.exit_code == 2
    assert "bad.jsonl line 2" in result.output and "Traceback" not in result.output
