"""Dataset files: accepted line formats, and malformed lines rejected with the file and line number."""

from __future__ import annotations

import hashlib
import json

import pytest

from kvtool.workloads.datasets import load_dataset, write_jsonl
from kvtool.errors import DatasetError


def write_lines(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_trtllm_prepared_lines_are_read_as_they_are(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [{"task_id": 7, "input_ids": [11, 12, 13], "output_tokens": 4},
                                              {"task_id": 8, "input_ids": [14], "output_tokens": 1}])
    dataset = load_dataset(path)
    assert [r.input_ids for r in dataset.records] == [(11, 12, 13), (14,)]
    assert [r.output_tokens for r in dataset.records] == [4, 1]
    assert [r.request_id for r in dataset.records] == ["7", "8"]  # task_id names the request
    assert [r.line_number for r in dataset.records] == [1, 2]


def test_text_prompts_and_optional_fields(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [
        {"prompt": "Hello", "max_tokens": 3, "arrival_time_s": 0.5, "priority": 80, "cache_salt": "user-1",
         "request_id": "a"},
        {"input_ids": [1, 2], "extra_ids": [0, 9], "output_tokens": 2},
    ])
    first, second = load_dataset(path).records
    assert (first.prompt, first.output_tokens, first.arrival_time_s, first.priority, first.cache_salt,
            first.request_id) == ("Hello", 3, 0.5, 80, "user-1", "a")
    assert second.extra_ids == (0, 9)


def test_blank_lines_are_skipped_and_line_numbers_count_them(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [{"input_ids": [1], "output_tokens": 1}, "", "   ",
                                              {"input_ids": [2], "output_tokens": 1}])
    assert [r.line_number for r in load_dataset(path).records] == [1, 4]


def test_multi_turn_sessions_keep_their_turns(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [
        {"session_id": "s0", "turn": 0, "input_ids": [1, 2], "output_tokens": 2},
        {"session_id": 5, "turn": 0, "prompt": "hi", "max_tokens": 2},
        {"session_id": "s0", "turn": 1, "input_ids": [3], "output_tokens": 2},
    ])
    dataset = load_dataset(path)
    assert [(r.session_id, r.turn) for r in dataset.records] == [("s0", 0), ("5", 0), ("s0", 1)]
    assert dataset.num_sessions == 2


BAD_LINES = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"output_tokens": 3}, "exactly one of 'input_ids'"),
    ({"input_ids": [1], "prompt": "x", "output_tokens": 3}, "exactly one of 'input_ids'"),
    ({"input_ids": [1]}, "exactly one of 'output_tokens' or 'max_tokens'"),
    ({"input_ids": [1], "output_tokens": -4}, "'output_tokens' must be >= 1, got -4"),
    ({"input_ids": [1], "output_tokens": "8"}, "'output_tokens' must be an integer"),
    ({"input_ids": [1], "output_tokens": True}, "'output_tokens' must be an integer"),
    ({"input_ids": [1, -2], "output_tokens": 1}, "'input_ids'[1] must be a non-negative integer"),
    ({"input_ids": [1, 2.5], "output_tokens": 1}, "'input_ids'[1] must be a non-negative integer"),
    ({"input_ids": [], "output_tokens": 1}, "'input_ids' is empty"),
    ({"prompt": 12, "max_tokens": 1}, "'prompt' must be a string"),
    ({"input_ids": [1, 2], "extra_ids": [0], "output_tokens": 1}, "'extra_ids' has 1 entries but 'input_ids' has 2"),
    ({"prompt": "x", "extra_ids": [0], "max_tokens": 1}, "'extra_ids' needs 'input_ids'"),
    ({"input_ids": [1], "output_tokens": 1, "priority": 101}, "'priority' must be in 0..100"),
    ({"input_ids": [1], "output_tokens": 1, "cache_salt": 3}, "'cache_salt' must be a string"),
    ({"input_ids": [1], "output_tokens": 1, "arrival_time_s": -1}, "'arrival_time_s' must be a number"),
    ({"input_ids": [1], "output_tokens": 1, "session_id": "s"}, "'session_id' needs 'turn'"),
    ({"input_ids": [1], "output_tokens": 1, "turn": 0}, "'turn' needs 'session_id'"),
    ({"input_ids": [1], "output_token": 1}, "unknown key(s) ['output_token']"),
    # Beyond int32 no model has the id (the engine could not even read it): refused here, with the line.
    ({"input_ids": [1, 2**31], "output_tokens": 1}, f"'input_ids'[1] is {2**31}, beyond any vocabulary"),
    ({"input_ids": [1, 10**30], "output_tokens": 1}, f"'input_ids'[1] is {10**30}, beyond any vocabulary"),
    ({"input_ids": [1, 2], "extra_ids": [0, 2**64], "output_tokens": 1}, "'extra_ids'[1] is 18446744073709551616"),
]


@pytest.mark.parametrize("bad_line, message", BAD_LINES)
def test_malformed_line_names_file_line_and_problem(tmp_path, bad_line, message):
    good = {"input_ids": [1, 2], "output_tokens": 2}
    path = write_lines(tmp_path / "bad.jsonl", [good, good, bad_line, good])
    with pytest.raises(DatasetError) as error:
        load_dataset(path)
    assert "bad.jsonl line 3: " in str(error.value)
    assert message in str(error.value)


def session_line(session, turn):
    return {"session_id": session, "turn": turn, "input_ids": [1], "output_tokens": 1}


@pytest.mark.parametrize("lines, line_number, message", [
    ([session_line("a", 0), session_line("a", 0)], 2, "duplicate turn 0 of session 'a' (first on line 1)"),
    ([session_line("a", 0), session_line("a", 2)], 2, "session 'a' jumps to turn 2 after turn 0 (line 1)"),
    ([session_line("a", 1), session_line("a", 0)], 2, "session 'a' jumps to turn 0 after turn 1"),
    ([session_line("a", 3)], 1, "session 'a' starts at turn 3"),
    ([{"input_ids": [1], "output_tokens": 1, "request_id": "x"},
      {"input_ids": [1], "output_tokens": 1, "request_id": "x"}], 2, "request id 'x' was already used on line 1"),
])
def test_session_and_id_errors_name_the_line(tmp_path, lines, line_number, message):
    path = write_lines(tmp_path / "s.jsonl", lines)
    with pytest.raises(DatasetError) as error:
        load_dataset(path)
    assert f"s.jsonl line {line_number}: " in str(error.value)
    assert message in str(error.value)


def test_sessions_may_start_at_turn_one(tmp_path):
    path = write_lines(tmp_path / "s.jsonl", [session_line("a", 1), session_line("a", 2)])
    assert [r.turn for r in load_dataset(path).records] == [1, 2]


def test_missing_and_empty_files_are_clear_errors(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="has no requests"):
        load_dataset(tmp_path / "empty.jsonl")


def test_written_lines_read_back_identically(tmp_path):
    lines = [{"input_ids": [5, 6, 7], "output_tokens": 3}, {"prompt": "héllo", "max_tokens": 2}]
    path = write_jsonl(tmp_path / "sub" / "d.jsonl", lines)
    assert [json.loads(line) for line in path.read_text().splitlines()] == lines
    assert not [p for p in path.parent.iterdir() if p.name != "d.jsonl"]  # no temporary file left behind


def test_a_byte_order_mark_is_not_part_of_the_first_line(tmp_path):
    path = tmp_path / "bom.jsonl"
    data = "\ufeff" + json.dumps({"input_ids": [5, 6], "output_tokens": 2}) + "\n" + \
        json.dumps({"prompt": "héllo", "max_tokens": 1}) + "\r\n"
    path.write_bytes(data.encode("utf-8"))
    dataset = load_dataset(path)
    assert [r.input_ids for r in dataset.records] == [(5, 6), None]
    assert dataset.records[1].prompt == "héllo"
    assert dataset.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()  # of the file as it is


def test_largest_int32_token_id_is_read_and_left_to_the_vocabulary_check(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [{"input_ids": [2**31 - 1], "output_tokens": 1}])
    assert load_dataset(path).records[0].input_ids == (2**31 - 1,)


def test_sharegpt_and_text_files_with_a_byte_order_mark_import(tmp_path):
    from kvtool.workloads.sharegpt import import_sharegpt
    from kvtool.workloads.text import TextSource
    from kvtool.models.tokenizer import ByteLevelTokenizer

    conversations = [{"id": "a", "conversations": [{"from": "human", "value": "Hi there"},
                                                   {"from": "gpt", "value": "Hello!"}]}]
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_bytes(("\ufeff" + json.dumps(conversations)).encode("utf-8"))
    imported = import_sharegpt(sharegpt)
    assert imported.num_turns == 1 and imported.lines[0]["prompt"] == "Hi there"
    text = tmp_path / "text.txt"
    text.write_bytes("\ufeffOnce upon a time.".encode("utf-8"))
    source = TextSource.from_file(text, ByteLevelTokenizer(512, None, [0]), chat=False)
    assert source.words[0] == "Once "


def test_a_sharegpt_file_that_is_not_utf8_names_the_file(tmp_path):
    from kvtool.workloads.sharegpt import import_sharegpt

    path = tmp_path / "latin1.json"
    path.write_bytes('[{"conversations": [{"from": "human", "value": "caf\xe9"}]}]'.encode("latin-1"))
    with pytest.raises(DatasetError, match=r"latin1.json is not UTF-8 text"):
        import_sharegpt(path)
