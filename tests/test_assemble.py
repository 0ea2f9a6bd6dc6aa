"""kvtool.runtime.assemble: one engine assembled the same way whatever runs its steps. A recording executor
(no model, no pools) shows what assemble_engine asks of an executor and what it settles against the plan;
kvtool.LLM configured by one EngineConfig is the LLM its TensorRT-LLM keyword arguments give."""

from __future__ import annotations

import re

import pytest

from kvtool import LLM
from kvtool.config import EngineConfig, KvCacheConfig, SamplingParams
from kvtool.errors import KvtoolError
from kvtool.plan import BuildOptions
from kvtool.runtime.assemble import PoolBudget, assemble_engine
from kvtool.runtime.request import Request
from kvtool.simulate.shapes import ModelShapes

SHAPES = ModelShapes.of("preset:tiny-llama", BuildOptions(tokens_per_block=16, max_batch_size=4, max_seq_len=128))


class RecordingExecutor:
    """An executor that gives the pools ``free_bytes`` and answers every sampling request with token 7."""

    def __init__(self, free_bytes: int = 1 << 30) -> None:
        self.free_bytes = free_bytes
        self.events: list[tuple] = []

    def pool_budget(self, kv_cache_config):
        self.events.append(("budget", kv_cache_config.max_tokens))
        return PoolBudget(self.free_bytes, available_host_bytes=1 << 30, on_cpu=False)

    def start(self, shape, pool_sizes, config, limits):
        self.events.append(("start", pool_sizes.num_primary_blocks, limits))

    def execute_step(self, batch, requests, generators):
        self.events.append(("step", len(batch.requests)))
        return [7] * len(requests) if len(batch.requests) else None

    def make_generator(self, params):
        return None


def test_the_executor_is_started_with_the_pools_its_budget_allows_before_any_step():
    executor = RecordingExecutor()
    engine, limits, pool_sizes = assemble_engine(SHAPES, EngineConfig(kv_cache_config=KvCacheConfig(max_tokens=256)),
                                                 executor)
    assert (limits.max_batch_size, limits.max_seq_len) == (4, 128)  # the plan's
    assert pool_sizes.num_primary_blocks == 256 // 16
    engine.add_request(Request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))
    finished = []
    while engine.has_unfinished_requests():
        finished += [r for r in engine.step() if r.finished]
    assert executor.events[:2] == [("budget", 256), ("start", 16, limits)]
    assert [event[0] for event in executor.events[2:]] == ["step", "step"]
    request, = finished
    assert request.output_token_ids == [7, 7] and request.finish_reason == "length"


def test_the_budget_sizes_the_primary_pool_by_the_memory_fraction():
    config = EngineConfig(kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.5))
    block_bytes = SHAPES.model_config.num_layers * 2 * 16 * SHAPES.model_config.num_kv_heads * \
        SHAPES.model_config.head_dim * 4
    _, _, pool_sizes = assemble_engine(SHAPES, config, RecordingExecutor(free_bytes=100 * block_bytes))
    assert pool_sizes.block_bytes == block_bytes and pool_sizes.num_primary_blocks == 50


@pytest.mark.parametrize("config, message", [
    (EngineConfig(max_batch_size=5), "--max_batch_size 5 is outside what the plan was built for (1..4)"),
    (EngineConfig(tokens_per_block=32), "--tokens_per_block 32 does not match the plan preset:tiny-llama"),
])
def test_what_the_plan_cannot_do_is_refused_before_the_executor_starts(config, message):
    executor = RecordingExecutor()
    with pytest.raises((ValueError, KvtoolError), match=re.escape(message)):
        assemble_engine(SHAPES, config, executor)
    assert executor.events == []


def test_one_engine_config_configures_the_llm_as_the_keyword_arguments_do(tiny_llama_plan):
    kv = KvCacheConfig(max_tokens=256)
    by_keywords = LLM(tiny_llama_plan, max_batch_size=2, kv_cache_config=kv)
    by_config = LLM(tiny_llama_plan, config=EngineConfig(kv_cache_config=kv, max_batch_size=2))
    for llm in (by_keywords, by_config):
        assert (llm.max_batch_size, llm.pool_sizes.num_primary_blocks * llm.pool_sizes.tokens_per_block) == (2, 256)
    assert by_keywords.config == by_config.config
    assert by_config.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0)).outputs[0].token_ids == \
        by_keywords.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0)).outputs[0].token_ids
    with pytest.raises(ValueError, match="LLM got both config and max_batch_size"):
        LLM(tiny_llama_plan, config=EngineConfig(), max_batch_size=2)
