"""kvtool.bench.precheck on the real scheduler: every request a run could not serve is named by its
dataset file and line before anything runs, even one the engine cannot read at all."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvtool.workloads.datasets import load_dataset, write_jsonl
from kvtool.bench.precheck import check_requests
from kvtool.workloads.requests import dataset_requests
from kvtool.config import EngineConfig, KvCacheConfig
from kvtool.errors import DatasetError
from kvtool.plan import BuildOptions
from kvtool.simulate.cost_model import CostModel
from kvtool.simulate.simulated_llm import SimulatedLLM
from kvtool.simulate.shapes import ModelShapes


@pytest.fixture
def engine():
    shapes = ModelShapes.of("preset:tiny-llama", BuildOptions(tokens_per_block=16, max_seq_len=256))
    llm = SimulatedLLM(shapes, CostModel(device="cpu: test", coefficients={"step": 1e-3}),
                       EngineConfig(kv_cache_config=KvCacheConfig(max_tokens=1024)))
    return llm.engine


def requests_of(tmp_path, lines):
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    return path, dataset_requests(load_dataset(path), tokenizer=None)


def test_a_token_id_outside_the_vocabulary_names_the_file_and_line(tmp_path, engine):
    path, requests = requests_of(tmp_path, [{"input_ids": [5, 6], "output_tokens": 2},
                                            {"input_ids": [5, 1024], "output_tokens": 2}])
    with pytest.raises(DatasetError) as error:
        check_requests(requests, engine, source=str(path))
    assert f"{path} line 2: token id 1024 is outside the model's vocabulary [0, 1024)" in str(error.value)


def test_an_id_the_engine_cannot_even_read_is_still_named_by_its_line(tmp_path, engine):
    path, requests = requests_of(tmp_path, [{"input_ids": [5, 6], "output_tokens": 2}] * 2)
    requests[1] = replace(requests[1], prompt_token_ids=[5, 2**40])  # what dataset validation would refuse
    with pytest.raises(DatasetError) as error:
        check_requests(requests, engine, source=str(path))
    assert f"{path} line 2: " in str(error.value) and str(2**40) in str(error.value)
