"""kvtool's greedy generation through its own runtime equals transformers' on the same checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvtool import LLM, KvCacheConfig, SamplingParams


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama-hf"
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.mark.parametrize("enable_reuse", [False, True])
def test_greedy_tokens_match_transformers_generate(llama_checkpoint, enable_reuse):
    path, hf_model = llama_checkpoint
    prompts = [[5 + i for i in range(40)], [5 + i for i in range(40)] + [300, 301, 302]]
    llm = LLM(model=str(path), kv_cache_config=KvCacheConfig(enable_block_reuse=enable_reuse))
    ours = [o.outputs[0].token_ids for o in
            llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
    # ignore_eos generates through EOS (it does not suppress it): let transformers do the same.
    hf_model.generation_config.eos_token_id = None
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8,
                                         do_sample=False)[0, len(prompt):].tolist()
        assert tokens == expected
