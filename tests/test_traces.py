"""`kvtool dataset import`: a request trace becomes a dataset with arrival times whose prompts share
exactly what the trace says they share; a bad row is one line naming the file and the row."""

from __future__ import annotations

import json
import random

import pytest
from trace_data import mooncake_slice
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.workloads.datasets import load_dataset
from kvtool.workloads.trace_tokens import MIN_TOKEN_ID, HashBlockTokens
from kvtool.workloads.traces import TraceImportOptions, import_trace

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def import_ok(*args):
    result = invoke("dataset", "import", *args)
    assert result.exit_code == 0, result.output
    return result.output


def import_error(*args) -> str:
    """The one-line error of an import that must fail."""
    result = invoke("dataset", "import", *args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    return result.output


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def trace_slice(tmp_path_factory):
    """The first 300 requests of the conversation trace, and its rows."""
    path = mooncake_slice(tmp_path_factory.mktemp("trace"), 300)
    return path, [json.loads(line) for line in path.read_text().splitlines()]


def test_a_mooncake_trace_becomes_requests_at_their_arrival_times(trace_slice, tmp_path):
    path, rows = trace_slice
    out = tmp_path / "mc.jsonl"
    output = import_ok(path, "--format", "mooncake", "--output", out)
    assert f"wrote 300 requests to {out}" in output
    records = load_dataset(out).records
    assert [r.arrival_time_s for r in records] == [row["timestamp"] / 1000 for row in rows]
    assert [len(r.input_ids) for r in records] == [row["input_length"] for row in rows]
    assert [r.output_tokens for r in records] == [row["output_length"] for row in rows]
    assert all(MIN_TOKEN_ID <= t < 32000 for r in records for t in r.input_ids)


def test_prompts_share_exactly_the_tokens_of_their_common_hash_prefix(trace_slice, tmp_path):
    path, rows = trace_slice
    out = tmp_path / "mc.jsonl"
    import_ok(path, "--format", "mooncake", "--output", out)
    records = load_dataset(out).records
    rng = random.Random(0)
    pairs = [(i, j) for i in range(len(rows)) for j in range(i)]
    for i, j in rng.sample(pairs, 4000) + [(i, i - 1) for i in range(1, len(rows))]:
        shared_blocks = common_prefix(rows[i]["hash_ids"], rows[j]["hash_ids"])
        shortest = min(rows[i]["input_length"], rows[j]["input_length"])
        assert common_prefix(records[i].input_ids, records[j].input_ids) == min(shared_blocks * 512, shortest)
    assert max(common_prefix(rows[i]["hash_ids"], rows[j]["hash_ids"]) for i, j in pairs) > 10  # the slice shares


def test_shrink_divides_prompts_and_keeps_what_they_share(trace_slice, tmp_path):
    path, rows = trace_slice
    out = tmp_path / "small.jsonl"
    import_ok(path, "--format", "mooncake", "--output", out, "--shrink", 32, "--vocab_size", 1024,
              "--max_output_tokens", 8)
    records = load_dataset(out).records
    for row, record in zip(rows, records):
        last = row["input_length"] - (len(row["hash_ids"]) - 1) * 512
        assert len(record.input_ids) == (len(row["hash_ids"]) - 1) * 16 + -(-last // 32)
        assert record.output_tokens == min(row["output_length"], 8)
        assert max(record.input_ids) < 1024
    for i in range(1, len(rows)):
        shared_blocks = common_prefix(rows[i]["hash_ids"], rows[i - 1]["hash_ids"])
        shortest = min(len(records[i].input_ids), len(records[i - 1].input_ids))
        assert common_prefix(records[i].input_ids, records[i - 1].input_ids) == min(shared_blocks * 16, shortest)


def test_distinct_hash_ids_give_distinct_blocks_and_siblings_differ_in_their_first_token():
    tokens = HashBlockTokens(block_len=8, token_id_limit=60, max_hash_id=5000)  # 50 ids: 3 digits
    rng = random.Random(1)
    # Prompts branching at random from a few common prefixes: 60 children of hash 0 wrap the 50 ids.
    prompts = [[0, 1 + i] + [100 + 10 * i + k for k in range(rng.randrange(3))] for i in range(60)]
    blocks = {}
    for hash_ids in prompts:
        ids = tokens.prompt_ids(hash_ids, 8)
        for position, hash_id in enumerate(hash_ids):
            blocks.setdefault(hash_id, ids[position * 8:(position + 1) * 8])
            assert blocks[hash_id] == ids[position * 8:(position + 1) * 8]  # the same hash id, the same block
    assert len({tuple(block) for block in blocks.values()}) == len(blocks)  # never two hash ids alike
    first_tokens = [blocks[1 + i][0] for i in range(60)]
    assert len(set(first_tokens[:50])) == 50  # siblings differ in their first token, up to 50 of them
    assert all(MIN_TOKEN_ID <= t < 60 for block in blocks.values() for t in block)


@pytest.mark.parametrize("last", [1, 2, 3, 4, 7, 8])
def test_a_last_partial_block_is_the_start_of_its_full_block_and_the_text_matches_the_ids(last):
    tokens = HashBlockTokens(block_len=8, token_id_limit=60, max_hash_id=5000)
    full = tokens.prompt_ids([0, 7, 9], 8)
    assert tokens.prompt_ids([0, 7, 9], last) == full[:16 + last]
    assert json.loads(f"[{tokens.prompt_text([0, 7, 9], last)}]") == full[:16 + last]
    assert json.loads(f"[{tokens.prompt_text(range(4000, 4003), last)}]") == tokens.prompt_ids(range(4000, 4003), last)


def test_ids_stay_below_a_plans_special_tokens(trace_slice, tmp_path):
    path, _ = trace_slice
    options = TraceImportOptions(shrink=32, vocab_size=1024, special_token_ids=(256, 257, 2))
    import_trace(path, "mooncake", tmp_path / "d.jsonl", options)
    assert max(t for r in load_dataset(tmp_path / "d.jsonl").records for t in r.input_ids) < 256


def test_too_long_requests_are_an_error_unless_skipped(trace_slice, tmp_path):
    path, rows = trace_slice
    too_long = [i for i, row in enumerate(rows) if row["input_length"] + row["output_length"] > 8000]
    line = too_long[0] + 1
    first = rows[too_long[0]]
    message = import_error(path, "--format", "mooncake", "--output", tmp_path / "d.jsonl", "--max_seq_len", 8000)
    assert (f"{len(too_long)} of the 300 requests in {path} are longer than --max_seq_len 8000 (prompt + output "
            f"tokens), the first on line {line} ({first['input_length']} + {first['output_length']})") in message
    assert "--skip_too_long" in message and not (tmp_path / "d.jsonl").exists()
    output = import_ok(path, "--format", "mooncake", "--output", tmp_path / "d.jsonl", "--max_seq_len", 8000,
                       "--skip_too_long")
    assert f"wrote {300 - len(too_long)} requests" in output and f"left out {len(too_long)}" in output
    kept = load_dataset(tmp_path / "d.jsonl").records
    assert [r.arrival_time_s for r in kept] == [row["timestamp"] / 1000 for i, row in enumerate(rows)
                                                if i not in too_long]


def test_text_prompts_are_measured_with_the_plans_tokenizer(tiny_llama_plan, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text('arrival_time_s,prompt,output_tokens\n0.5,"hi, there",2\n1.25,' + "x" * 5000 + ",2\n")
    message = import_error(trace, "--format", "csv", "--output", tmp_path / "d.jsonl", "--plan", tiny_llama_plan)
    assert f"1 of the 2 requests in {trace} are longer than --max_seq_len" in message and "line 3" in message
    output = import_ok(trace, "--format", "csv", "--output", tmp_path / "d.jsonl", "--plan", tiny_llama_plan,
                       "--skip_too_long")
    assert "wrote 1 requests" in output
    [record] = load_dataset(tmp_path / "d.jsonl").records
    assert (record.prompt, record.arrival_time_s, record.output_tokens) == ("hi, there", 0.5, 2)


def test_azure_timestamps_of_2023_and_2024_become_seconds_after_the_first(tmp_path):
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n"
                     "2023-11-16 18:15:50.0000001,1000,3\n"
                     "2023-11-16 18:16:46.6805900,20,1\n")
    import_ok(trace, "--format", "azure", "--output", tmp_path / "a.jsonl")
    records = load_dataset(tmp_path / "a.jsonl").records
    assert [r.arrival_time_s for r in records] == [0.0, 3.3194101, 60.0]
    assert [len(r.input_ids) for r in records] == [374, 1000, 20] and [r.output_tokens for r in records] == [44, 3, 1]
    assert common_prefix(records[0].input_ids, records[1].input_ids) == 0  # the trace says nothing is shared
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2024-05-12 00:00:00.001163+00:00,1452,3\n"
                     "2024-05-12 00:00:01+00:00,584,3\n"
                     "2024-05-12 02:00:00.5+02:00,862,38\n")
    import_ok(trace, "--format", "azure", "--output", tmp_path / "b.jsonl", "--shrink", 4)
    records = load_dataset(tmp_path / "b.jsonl").records
    assert [r.arrival_time_s for r in records] == [0.0, 0.998837, 0.498837]
    assert [len(r.input_ids) for r in records] == [363, 146, 216]


def test_plain_csv_and_json_lines_of_arrival_times_and_prompts(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("timestamp,input_ids,max_tokens\n1500,11 12 13,4\n0,\"[14, 15]\",\n")
    import_ok(trace, "--format", "csv", "--output", tmp_path / "a.jsonl", "--output_len", 9)
    records = load_dataset(tmp_path / "a.jsonl").records
    assert [(r.arrival_time_s, r.input_ids, r.output_tokens) for r in records] == [(1.5, (11, 12, 13), 4),
                                                                                   (0.0, (14, 15), 9)]
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_time_s": 2, "prompt": "Hello", "output_length": 3}\n')
    import_ok(trace, "--format", "csv", "--output", tmp_path / "b.jsonl")
    [record] = load_dataset(tmp_path / "b.jsonl").records
    assert (record.arrival_time_s, record.prompt, record.output_tokens) == (2.0, "Hello", 3)


MOONCAKE_ROW = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}


def test_rows_without_hash_ids_get_blocks_of_their_own(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [MOONCAKE_ROW, {"timestamp": 5, "input_length": 600, "output_length": 2},
            {"timestamp": 7, "input_length": 100, "output_length": 2}]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    import_ok(trace, "--format", "mooncake", "--output", tmp_path / "d.jsonl")
    records = load_dataset(tmp_path / "d.jsonl").records
    assert [len(r.input_ids) for r in records] == [600, 600, 100]
    assert all(common_prefix(a.input_ids, b.input_ids) == 0 for a in records for b in records if a is not b)


@pytest.mark.parametrize("row, expected", [
    ({**MOONCAKE_ROW, "hash_ids": [0]}, "'input_length' 600 takes 2 blocks of --block_size 512 tokens, but "
                                        "'hash_ids' has 1"),
    ({**MOONCAKE_ROW, "output_length": 0}, "'output_length' must be >= 1, got 0"),
    ({**MOONCAKE_ROW, "timestamp": -1}, "'timestamp' must be a number >= 0, got -1"),
    ({**MOONCAKE_ROW, "hash_ids": [0, -1]}, "'hash_ids'[1] must be a non-negative integer, got -1"),
    ({key: value for key, value in MOONCAKE_ROW.items() if key != "input_length"}, "'input_length' is missing"),
    ({**MOONCAKE_ROW, "text": "hi"}, "unknown key(s) ['text']"),
    ("[1, 2]", "expected a JSON object, got list"),
    ("{oops", "not valid JSON"),
])
def test_a_bad_mooncake_row_names_the_file_and_line(tmp_path, row, expected):
    trace = tmp_path / "t.jsonl"
    text = row if isinstance(row, str) else json.dumps(row)
    trace.write_text(json.dumps(MOONCAKE_ROW) + "\n\n" + text + "\n")
    message = import_error(trace, "--format", "mooncake", "--output", tmp_path / "d.jsonl")
    assert f"{trace} line 3: {expected}" in message


@pytest.mark.parametrize("fmt, text, expected", [
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n11/16/2023 18:15,3,4\n",
     "line 2: TIMESTAMP '11/16/2023 18:15' is not a date and time like 2023-11-16 18:15:46.6805900"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,0,4\n",
     "line 2: ContextTokens must be an integer >= 1, got '0'"),
    ("azure", "TIMESTAMP,Tokens\n2023-11-16 18:15:46,3\n", "the header has no column ContextTokens"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3\n", "line 2: 2 values for the "
                                                                               "header's 3 columns"),
    ("csv", "prompt,output_tokens\nhi,3\n", "line 2: give the arrival time as 'arrival_time_s' (seconds) or "
                                            "'timestamp' (milliseconds), once; got neither"),
    ("csv", "arrival_time_s,prompt\n1,hi\n", "line 2: no output length: add one of ['output_tokens', 'max_tokens', "
                                             "'output_length'], or give --output_len N"),
    ("csv", "arrival_time_s,prompt,input_ids,output_tokens\n1,hi,1 2,3\n", "line 2: give exactly one of 'prompt'"),
    ("csv", "arrival_time_s,input_ids,output_tokens\n1,5 5000,3\n", "line 2: 'input_ids'[1] is 5000, outside the "
                                                                    "vocabulary: ids must be below 1,000"),
])
def test_a_bad_csv_row_names_the_file_and_line(tmp_path, fmt, text, expected):
    trace = tmp_path / "t.csv"
    trace.write_text(text)
    message = import_error(trace, "--format", fmt, "--output", tmp_path / "d.jsonl", "--vocab_size", 1000)
    assert expected in message and str(trace) in message


@pytest.mark.parametrize("flags, expected", [
    (["--format", "sharegpt"], "--format sharegpt: unknown: use one of mooncake, azure, csv"),
    (["--format", "mooncake", "--shrink", 3], "--shrink 3 must divide --block_size 512"),
    (["--format", "mooncake", "--skip_too_long"], "--skip_too_long needs a limit: give --max_seq_len N"),
    (["--format", "mooncake", "--shrink", 256, "--vocab_size", 1000],
     "a block of 2 tokens cannot tell 1,300 hash ids apart with 990 token ids: it needs 3 tokens"),
    (["--format", "csv", "--shrink", 2], "--shrink divides traces that give prompt lengths"),
    (["--format", "mooncake", "--vocab_size", 0], "--vocab_size must be a positive integer, got 0"),
])
def test_bad_flags_are_one_line_errors(tmp_path, flags, expected):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({**MOONCAKE_ROW, "hash_ids": [0, 1000 + i]}) for i in range(300)) + "\n")
    assert expected in import_error(trace, "--output", tmp_path / "d.jsonl", *flags)


def test_stats_of_an_imported_trace_count_the_blocks_earlier_prompts_had(trace_slice, tmp_path):
    from kvtool.workloads.stats import dataset_stats

    path, _ = trace_slice
    import_ok(path, "--format", "mooncake", "--output", tmp_path / "d.jsonl", "--shrink", 16)
    dataset = load_dataset(tmp_path / "d.jsonl")
    seen, shared = set(), 0  # the definition: every prefix of whole blocks, as a tuple
    for record in dataset.records:
        prefixes = [record.input_ids[:end] for end in range(16, len(record.input_ids) + 1, 16)]
        shared += 16 * sum(prefix in seen for prefix in prefixes)
        seen.update(prefixes)
    stats = dataset_stats(dataset, tokens_per_block=16)
    assert stats.shared_prefix_tokens == shared > 0
