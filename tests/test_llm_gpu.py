"""The whole model on a GPU through kvtool's CUDA kernels (needs a GPU + CuPy).

Greedy outputs never depend on how the KV cache was obtained: recomputed, reused from the
prefix cache, reused while its first owner still runs, or onboarded from host memory; and the
logits match transformers (float32, CPU) within float16 rounding.

float16 rather than bfloat16: reusing a prefix changes which matrix shapes compute the suffix,
hence the rounding of its activations; float16's 3 extra mantissa bits keep such differences far
below the gap between the top two logits, so token identity is a stable check.
"""

from __future__ import annotations

import importlib.util
import random
import numpy as np
import pytest
import torch

from kvtool import LLM, KvCacheConfig, SamplingParams, SchedulerConfig
from kvtool.plan import BuildOptions, build_plan
from kvtool.runtime.model_runner import StepRequest


def _gpu_ready() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA GPU and CuPy")]

CASE = "qwen3_head_dim_64"
TOKENS_PER_BLOCK = 16
POOL_TOKENS = 64 * TOKENS_PER_BLOCK  # small: the default would take most of the GPU's memory
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def plan_dir(hf_checkpoint, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("plan") / CASE
    build_plan(str(hf_checkpoint(CASE).path), out,
               BuildOptions(dtype="float16", tokens_per_block=TOKENS_PER_BLOCK, max_seq_len=512, max_batch_size=8,
                            max_num_tokens=512))
    return str(out)


def shared_prefix_prompts(num_prompts: int = 4, prefix_len: int = 80, suffix_len: int = 23) -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(3, 512) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 512) for _ in range(suffix_len)] for _ in range(num_prompts)]


def make_llm(plan_dir: str, **kwargs) -> LLM:
    from kvtool.layers.cuda_attention import CudaPagedAttention

    kwargs.setdefault("kv_cache_config", KvCacheConfig(max_tokens=POOL_TOKENS))
    llm = LLM(model=plan_dir, device="cuda", **kwargs)
    backend = llm.engine.runner.model.layers[0].attention.backend
    assert isinstance(backend, CudaPagedAttention), f"the GPU model runs on {type(backend).__name__}"
    return llm


def greedy_tokens(plan_dir: str, prompts, **kwargs) -> tuple[list[list[int]], dict]:
    llm = make_llm(plan_dir, **kwargs)
    outputs = llm.generate(prompts, GREEDY)
    stats = llm.get_stats()
    llm.shutdown()
    assert all(o.error is None for o in outputs)
    return [o.outputs[0].token_ids for o in outputs], stats


@pytest.fixture(scope="module")
def reference_tokens(plan_dir):
    """Reuse off, one prompt at a time: every token's KV computed in its own request."""
    tokens = []
    for prompt in shared_prefix_prompts():
        out, _ = greedy_tokens(plan_dir, [prompt], max_batch_size=1,
                               kv_cache_config=KvCacheConfig(enable_block_reuse=False, max_tokens=POOL_TOKENS))
        tokens += out
    return tokens


def test_prompt_logits_on_the_gpu_match_transformers(plan_dir, hf_checkpoint):
    prompt = shared_prefix_prompts()[0]
    llm = make_llm(plan_dir)
    num_blocks = -(-len(prompt) // TOKENS_PER_BLOCK)
    request = StepRequest(np.asarray(prompt, dtype=np.int32), np.arange(num_blocks, dtype=np.int32), 0, True, True)
    ours = llm.engine.runner.execute([request])[0].cpu()  # [vocab] float32
    llm.shutdown()
    with torch.no_grad():
        reference = hf_checkpoint(CASE).model(torch.tensor([prompt])).logits[0, -1].float()
    assert float((ours - reference).abs().max() / reference.abs().max()) <= 2e-2


def test_greedy_outputs_identical_with_reuse_on_and_off(plan_dir, reference_tokens):
    tokens, stats = greedy_tokens(plan_dir, shared_prefix_prompts(), max_batch_size=1)
    assert tokens == reference_tokens
    assert stats["reused_blocks"] == 3 * 5  # the 80-token prefix (5 blocks) for each later prompt


def test_greedy_outputs_identical_with_early_reuse_in_a_batch(plan_dir, reference_tokens):
    tokens, stats = greedy_tokens(plan_dir, shared_prefix_prompts(), max_num_tokens=48,
                                  scheduler_config=SchedulerConfig(enable_chunked_context=True))
    assert tokens == reference_tokens
    assert stats["early_reused_blocks"] > 0


@pytest.mark.parametrize("layered_copies", [False, True])
def test_greedy_outputs_identical_when_blocks_come_back_from_host_memory(plan_dir, reference_tokens, layered_copies):
    # 8 blocks hold one request (103 + 8 tokens = 7 blocks): every prompt evicts the previous one.
    # Layered: each layer's copies get an event that layer's attention waits for (as in large steps).
    prompts = shared_prefix_prompts()
    llm = make_llm(plan_dir, max_batch_size=1,
                   kv_cache_config=KvCacheConfig(max_tokens=8 * TOKENS_PER_BLOCK, host_cache_size=16 << 20))
    llm.engine.runner.pools.layered_copy_min_bytes = 0 if layered_copies else None
    tokens = [llm.generate(p, GREEDY).outputs[0].token_ids for p in prompts + prompts]
    stats = llm.get_stats()
    llm.shutdown()
    assert tokens == reference_tokens + reference_tokens
    assert stats["offloaded_blocks"] > 0 and stats["onboarded_blocks"] > 0


def test_a_fully_cached_prompt_gives_the_same_outputs_as_a_recomputed_one(plan_dir):
    # 96 of 97 tokens reused: the context step is one token, served by the decode kernel.
    prompt = shared_prefix_prompts()[0][:97]
    recomputed, _ = greedy_tokens(plan_dir, [prompt],
                                  kv_cache_config=KvCacheConfig(enable_block_reuse=False, max_tokens=POOL_TOKENS))
    llm = make_llm(plan_dir)
    first = llm.generate(prompt, GREEDY)
    second = llm.generate(prompt, GREEDY)
    assert llm.engine.requests[second.request_id].num_reused_tokens == 96
    llm.shutdown()
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == recomputed[0]
