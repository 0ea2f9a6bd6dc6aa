"""Prefill / mixed steps replayed from CUDA graphs, and the model's fused kernels, through kvtool.LLM on
a GPU (marked gpu; skipped without one): the same greedy tokens as the eager runtime, logits within
float16 rounding, the graphs' own metadata surviving whatever the allocator hands out afterwards.

The host side (which steps replay which bucket, the padded metadata) is checked on any machine in
tests/test_cuda_graphs.py and tests/test_step_batch.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_llm_generation import GREEDY, ON_A_GPU, Setup, build, shared_prefix_prompts

from kvtool import KvCacheConfig
from kvtool.runtime.model_runner import StepRequest

pytestmark = ON_A_GPU
SETUP = Setup("cuda", "float16", "qwen3_head_dim_64")  # q/k norms: every part of the fused prologue


@pytest.fixture(scope="module")
def target(hf_checkpoint, tmp_path_factory):
    return build(SETUP, hf_checkpoint, tmp_path_factory)


def record_mixed_replays(llm) -> list[tuple[int, int]]:
    """(step tokens, bucket tokens) of every mixed-graph replay from now on."""
    graphs = llm.engine.executor.mixed_graphs
    assert graphs is not None, "LLM on a GPU captures prefill / mixed graphs"
    replayed, run = [], graphs.run
    graphs.run = lambda step, layout: replayed.append((step.num_tokens, layout.num_tokens)) or run(step, layout)
    return replayed


def generate(llm, prompts) -> list[list[int]]:
    outputs = llm.generate(prompts, GREEDY)
    assert all(o.error is None for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("max_batch_size", [1, 4])
def test_prompts_over_a_cached_prefix_and_mixed_steps_replay_graphs_with_eager_tokens(target, max_batch_size):
    # Batch 1: each 103-token prompt, then 23 new tokens over the cached 80 (bucket 24). Batch 4:
    # prompts beside decoding requests (mixed steps).
    prompts = shared_prefix_prompts()
    eager_llm = target.llm(max_batch_size=max_batch_size, cuda_graphs=False)
    eager = generate(eager_llm, prompts)
    eager_llm.shutdown()
    llm = target.llm(max_batch_size=max_batch_size)
    replayed = record_mixed_replays(llm)
    graphs = generate(llm, prompts)
    llm.shutdown()
    assert graphs == eager
    assert replayed and all(tokens <= bucket < 1.5 * tokens + 16 for tokens, bucket in replayed)
    assert (23, 24) in replayed or max_batch_size > 1


def test_prompt_logits_from_a_graph_match_the_eager_step(target):
    prompt = shared_prefix_prompts()[0][:100]
    request = StepRequest(np.asarray(prompt, dtype=np.int32), np.arange(7, dtype=np.int32), 0, True, True)
    llm = target.llm()
    replayed = record_mixed_replays(llm)
    graph_logits = llm.engine.executor.execute([request]).clone()
    assert replayed == [(100, 128)]
    llm.engine.executor.mixed_graphs = None  # the same step launched kernel by kernel
    eager_logits = llm.engine.executor.execute([request])
    llm.shutdown()
    torch.testing.assert_close(graph_logits, eager_logits, atol=2e-2, rtol=2e-2)


def test_fused_kernels_give_the_logits_of_the_unfused_torch_ops(target):
    prompt = shared_prefix_prompts()[1]
    blocks = np.arange(-(-len(prompt) // 16), dtype=np.int32)
    request = StepRequest(np.asarray(prompt, dtype=np.int32), blocks, 0, True, True)
    llm = target.llm(cuda_graphs=False)
    model = llm.engine.executor.model
    assert model.fused_kernels is not None, "the runner enables the fused kernels on kvtool's CUDA attention"
    fused = llm.engine.executor.execute([request]).clone()
    model.fused_kernels = None
    unfused = llm.engine.executor.execute([request])
    llm.shutdown()
    torch.testing.assert_close(fused, unfused, atol=2e-2, rtol=2e-2)


def test_graphs_own_their_metadata_whatever_the_allocator_hands_out_later(target):
    # Issue 12's GPU run: a graph that did not own a tensor it read replayed someone else's bytes.
    # Churn the allocator with garbage-filled tensors between the capture and the replays.
    prompts = shared_prefix_prompts(num_prompts=2)
    llm = target.llm(max_batch_size=2, kv_cache_config=KvCacheConfig(enable_block_reuse=False))
    before = generate(llm, prompts)
    garbage = [torch.full((n,), -1, dtype=torch.int64, device="cuda") for n in (1, 7, 64, 513, 4096, 65536)] * 4
    del garbage[::2]
    after = generate(llm, prompts)
    llm.shutdown()
    assert after == before


def test_an_llm_captures_its_graphs_while_an_earlier_llm_is_cyclic_garbage(target, monkeypatch):
    # The H100 run: two LLMs of the GPU suite failed their captures (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    # when a collection fell due inside one and destroyed an earlier LLM's graphs on the capturing thread.
    import gc

    from kvtool.runtime import cuda_graphs

    prompts = shared_prefix_prompts(num_prompts=1)
    eager_llm = target.llm(cuda_graphs=False)
    eager = generate(eager_llm, prompts)
    eager_llm.shutdown()
    first = target.llm()
    first.itself = first  # only the cyclic collector frees it, and its graphs with it
    del first
    capture = cuda_graphs._capture

    def capture_with_a_collection_due(step, pool, device):
        calls = []

        def step_where_a_collection_falls_due():
            calls.append(None)
            if len(calls) == 2 and gc.isenabled():  # the capture (after the eager warm-up), as the collector
                gc.collect()                         # would on allocating there: only while it is enabled
            return step()

        return capture(step_where_a_collection_falls_due, pool, device)

    monkeypatch.setattr(cuda_graphs, "_capture", capture_with_a_collection_due)
    llm = target.llm()
    monkeypatch.undo()
    gc.collect()  # the first LLM, if a capture has not freed it yet
    graphs = generate(llm, prompts)
    llm.shutdown()
    assert graphs == eager
