"""KvCacheRetentionConfig through the LLM API, as TensorRT-LLM users write it: a system prompt kept at
a high priority survives the conversations that would otherwise push it out of the KV cache, until
its duration runs out. The KV cache rules themselves: tests/test_kv_cache_retention.py."""

from __future__ import annotations

from datetime import timedelta

import pytest

from kvtool import LLM, KvCacheConfig, SamplingParams
from kvtool.config import ConfigError, KvCacheRetentionConfig, TokenRangeRetentionConfig

SYSTEM = ("You are a careful assistant. Answer in one short sentence, and say which tier of memory holds the "
          "blocks of a long system prompt.")


def run(retention: KvCacheRetentionConfig | None) -> int:
    """Sends the system prompt with a question, then unrelated prompts that fill the KV cache, then the
    system prompt with another question: returns how many blocks the last request reused."""
    llm = LLM(model="preset:tiny-llama", max_batch_size=1, max_seq_len=256,
              kv_cache_config=KvCacheConfig(max_tokens=192, tokens_per_block=16))
    tokens = llm.tokenizer.encode(SYSTEM)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, kv_cache_retention_config=retention)
    llm.generate(SYSTEM + " What is a block?", params)
    for k in range(4):
        llm.generate(f"Unrelated prompt number {k}: " + "tell me about the weather in a long paragraph " * 2,
                     SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    before = llm.get_stats()["reused_blocks"]
    llm.generate(SYSTEM + " What is a tier?", params)
    reused = llm.get_stats()["reused_blocks"] - before
    llm.shutdown()
    assert len(tokens) >= 32  # the system prompt spans whole blocks
    return reused


def test_system_prompt_kept_at_a_high_priority_survives_other_requests():
    keep = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 32, 90, timedelta(minutes=10))])
    assert run(None) == 0
    assert run(keep) == 2


def test_retention_config_checks_its_ranges():
    with pytest.raises(ConfigError, match="overlapping"):
        KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 32, 90), TokenRangeRetentionConfig(16, 48, 10)])
    with pytest.raises(ConfigError, match="priority must be in 0..100"):
        TokenRangeRetentionConfig(0, 32, 101)
    with pytest.raises(ConfigError, match="duration_ms must be a positive"):
        TokenRangeRetentionConfig(0, 32, 90, timedelta(0))
    with pytest.raises(ConfigError, match="kv_cache_retention_config must be a KvCacheRetentionConfig"):
        SamplingParams(kv_cache_retention_config=[(0, 32, 90)])


def test_ranges_end_with_the_prompt_and_generated_tokens_take_the_decode_priority():
    def core(config, num_prompt_tokens):
        return [(r.token_start, r.token_end, r.priority, r.duration_ms) for r in config.to_core(num_prompt_tokens)]

    config = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 50, 90, 1000), TokenRangeRetentionConfig(300, 400, 10)],
                                    decode_retention_priority=20)
    assert core(config, 100) == [(0, 50, 90, 1000), (100, None, 20, None)]  # the range past the prompt is gone
    assert core(KvCacheRetentionConfig([TokenRangeRetentionConfig(8, None, 60)]), 100) == [(8, 100, 60, None)]
    assert core(KvCacheRetentionConfig(), 100) == []
