"""The LLM API as TensorRT-LLM users write it: KvCacheConfig.tokens_per_block builds a model given as a
checkpoint or preset with that block size; only a plan built beforehand with another block size is
refused. TensorRT-LLM's KV cache offloading example runs with its import line changed."""

from __future__ import annotations

import pytest

from kvtool import LLM, BuildOptions, KvCacheConfig, SamplingParams
from kvtool.errors import KvtoolError
from kvtool.plan import build_plan


def offloading_example(enable_offloading: bool) -> list[dict]:
    """TensorRT-LLM's examples/llm-api/llm_kv_cache_offloading.py, in its structure and numbers: two prompts
    sent A, B, A, B, one at a time, through a primary pool of 256 tokens (one request) in 16-token blocks,
    with a 1 GiB host cache or none. Greedy and ignore_eos so both runs generate the same tokens."""
    prompt_a = ("Given the following question and four candidate answers (A, B, C and D), choose the best "
                "answer. Which tier of memory holds evicted blocks?")
    prompt_b = ("Question: this question refers to the following excerpt. Read it and explain why a request "
                "that shares a prefix can skip computing it.")
    max_batch_size = 1
    max_seq_len = 256
    kv_cache_max_tokens = 256
    kv_cache_page_size = 16
    kv_cache_host_size = 1024**3 if enable_offloading else 0
    sampling_params = SamplingParams(max_tokens=max_seq_len, temperature=0, ignore_eos=True)

    llm = LLM(model="preset:tiny-llama",
              max_batch_size=max_batch_size,
              max_seq_len=max_seq_len,
              kv_cache_config=KvCacheConfig(enable_block_reuse=True,
                                            max_tokens=kv_cache_max_tokens,
                                            tokens_per_block=kv_cache_page_size,
                                            host_cache_size=kv_cache_host_size))
    assert llm.plan.build_options.tokens_per_block == kv_cache_page_size
    rounds = []
    for _ in range(2):
        before = llm.get_stats()
        outputs = [llm.generate(prompt, sampling_params) for prompt in (prompt_a, prompt_b)]
        after = llm.get_stats()
        rounds.append({"outputs": [out.outputs[0].token_ids for out in outputs],
                       "prompt_blocks": sum(len(out.prompt_token_ids) // kv_cache_page_size for out in outputs),
                       **{key: after[key] - before[key] for key in ("reused_blocks", "onboarded_blocks")}})
    llm.shutdown()
    return rounds


def test_trtllm_offloading_example_reuses_both_prompts_only_with_a_host_cache():
    without, with_host = offloading_example(False), offloading_example(True)
    # max_tokens=max_seq_len is cut to what max_seq_len leaves (as TensorRT-LLM does): each request fills the pool.
    assert all(len(tokens) > 100 for tokens in without[0]["outputs"])
    # Without a host cache B evicted A (and A evicted B): round 2 reuses nothing.
    assert without[1]["reused_blocks"] == 0
    # With it, round 2 finds every full prompt block of A and B (bar the block holding the last prompt
    # token, which is always computed) in host memory.
    full_blocks = with_host[1]["prompt_blocks"]
    assert full_blocks - 2 <= with_host[1]["reused_blocks"] <= full_blocks
    assert with_host[1]["onboarded_blocks"] == with_host[1]["reused_blocks"] > 0
    # Where the KV came from never changes what the model says.
    assert with_host[0]["outputs"] == without[0]["outputs"] == with_host[1]["outputs"] == without[1]["outputs"]


def test_tokens_per_block_is_a_build_option_for_checkpoints(hf_checkpoint):
    llm = LLM(model=str(hf_checkpoint("qwen3_qk_norm").path), max_seq_len=128,
              kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=256))
    assert llm.plan.build_options.tokens_per_block == 8 and llm.pool_sizes.tokens_per_block == 8
    out = llm.generate([5, 6, 7, 8, 9, 10, 11, 12, 13], SamplingParams(max_tokens=3, temperature=0))
    assert out.error is None and len(out.outputs[0].token_ids) == 3


def test_a_built_plan_with_another_block_size_is_refused_naming_it(tmp_path):
    plan_dir = build_plan("preset:tiny-llama", tmp_path / "my-plan", BuildOptions(tokens_per_block=32,
                                                                                 max_seq_len=64))
    with pytest.raises(KvtoolError) as error:
        LLM(model=str(plan_dir), kv_cache_config=KvCacheConfig(tokens_per_block=16))
    assert f"does not match the plan {plan_dir}, built with --tokens_per_block 32" in str(error.value)
    assert ".cache" not in str(error.value)


def test_block_sizes_given_twice_must_agree():
    with pytest.raises(KvtoolError, match="KvCacheConfig.tokens_per_block=16 and BuildOptions.tokens_per_block=64 "
                                          "disagree"):
        LLM(model="preset:tiny-llama", build_options=BuildOptions(tokens_per_block=64),
            kv_cache_config=KvCacheConfig(tokens_per_block=16))
