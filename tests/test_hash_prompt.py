"""An imported trace keeps its prompts as block hash ids (a few MB for the conversation trace's 145M
tokens) whose token ids are made when read: they are exactly the ids `--write_token_ids` writes, they
index and slice as a tuple of those ids does, and a bad line of hash ids is one line naming it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from trace_data import mooncake_slice
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.errors import DatasetError
from kvtool.workloads.datasets import load_dataset
from kvtool.workloads.hash_prompt import HashBlockPrompt


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def import_both(raw, directory, *flags):
    """The trace imported as hash ids (the default) and with every token id written."""
    out = []
    for name, more in (("hashes.jsonl", ()), ("ids.jsonl", ("--write_token_ids",))):
        result = invoke("dataset", "import", raw, "--output", directory / name, *flags, *more)
        assert result.exit_code == 0, result.output
        out.append(directory / name)
    return out


@pytest.mark.parametrize("shrink", [1, 16])
def test_a_trace_of_hash_ids_loads_to_the_token_ids_write_token_ids_writes(tmp_path, shrink):
    raw = mooncake_slice(tmp_path, 200, start=4000)
    hashes, ids = import_both(raw, tmp_path, "--format", "mooncake", "--shrink", shrink)
    assert hashes.stat().st_size * 5 < ids.stat().st_size
    assert '"hash_ids"' in hashes.read_text().splitlines()[0]
    lazy, written = load_dataset(hashes).records, load_dataset(ids).records
    assert all(isinstance(record.input_ids, HashBlockPrompt) for record in lazy)
    assert [np.asarray(r.input_ids).tolist() for r in lazy] == [list(r.input_ids) for r in written]
    assert [(r.arrival_time_s, r.output_tokens) for r in lazy] == [(r.arrival_time_s, r.output_tokens)
                                                                  for r in written]


def test_rows_of_lengths_alone_get_hash_ids_of_their_own(tmp_path):
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,1200,4\n"
                     "2023-11-16 18:15:50.0,700,3\n")
    hashes, ids = import_both(trace, tmp_path, "--format", "azure")
    assert [list(r.input_ids) for r in load_dataset(hashes).records] == [
        list(r.input_ids) for r in load_dataset(ids).records]


def test_a_prompt_of_hash_ids_reads_as_a_tuple_of_its_ids(tmp_path):
    raw = mooncake_slice(tmp_path, 20)
    hashes, ids = import_both(raw, tmp_path, "--format", "mooncake", "--shrink", 16)
    lazy, written = load_dataset(hashes).records[7].input_ids, tuple(load_dataset(ids).records[7].input_ids)
    assert len(lazy) == len(written) > 64 and lazy == written and list(lazy) == list(written)
    assert hash(lazy) == hash(written) and {written: 1}[lazy] == 1
    for index in (0, 1, 31, 32, 33, len(written) - 1, -1, -33):
        assert lazy[index] == written[index]
    for piece in (slice(0, 32), slice(5, 70), slice(31, 33), slice(-40, None), slice(None, None, 3), slice(9, 2)):
        assert lazy[piece] == written[piece]
    with pytest.raises(IndexError, match="out of range"):
        lazy[len(written)]
    assert np.asarray(lazy, dtype=np.int64).dtype == np.int64


LINE = {"hash_ids": [1, 2], "hash_block_len": 16, "input_length": 20, "token_id_limit": 32000, "output_tokens": 4}


@pytest.mark.parametrize("line, expected", [
    ({**LINE, "hash_ids": [1]}, "line 2: 'input_length' 20 takes 2 blocks of 'hash_block_len' 16 tokens, but "
                                "'hash_ids' has 1"),
    ({key: value for key, value in LINE.items() if key != "token_id_limit"},
     "line 2: 'hash_ids' needs 'token_id_limit' as well"),
    ({key: value for key, value in LINE.items() if key != "hash_ids"} | {"input_ids": [11, 12]},
     "line 2: 'hash_block_len' goes with 'hash_ids'"),
    ({**LINE, "hash_block_len": 32, "input_length": 40},
     "line 2: 'hash_block_len' 32 and 'token_id_limit' 32000 differ from line 1's (16, 32000)"),
    ({**LINE, "input_ids": [11]}, "line 2: give exactly one of 'input_ids'"),
])
def test_a_bad_line_of_hash_ids_names_the_file_and_line(tmp_path, line, expected):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(json.dumps(LINE) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(DatasetError) as error:
        load_dataset(dataset)
    assert f"{dataset} {expected}" in str(error.value) and "\n" not in str(error.value)
