"""Tiny random transformers checkpoints, one per family feature kvtool must reproduce."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

TEST_TOKENS_PER_BLOCK = 8

_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               max_position_embeddings=512, rms_norm_eps=1e-5)

# name -> (transformers config class name, config kwargs). Each case covers a family feature.
HF_CASES: dict[str, tuple[str, dict]] = {
    "llama_llama3_rope_gqa": ("LlamaConfig", dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama_mha_tied_bias": ("LlamaConfig", dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True)),
    "mistral_sliding_window": ("MistralConfig", dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=20,
        tie_word_embeddings=False)),
    "qwen2_qkv_bias_tied": ("Qwen2Config", dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2)),
    "qwen3_qk_norm": ("Qwen3Config", dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2)),
    # YaRN as Qwen3's model card enables it for 128k, shrunk: prompts run past the original 32 positions.
    "qwen3_yarn_rope": ("Qwen3Config", dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32})),
    # Wide enough that the CPU kernels share a step's projections among their threads (and, past ~1,000
    # cached tokens, its attention): the other cases run each kernel on one thread.
    "llama_threads_medium": ("LlamaConfig", dict(
        _COMMON, hidden_size=256, intermediate_size=1024, max_position_embeddings=2048, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False)),
    # head_dim 64: the smallest shape kvtool's CUDA kernels serve (tests/test_llm_generation.py).
    "qwen3_head_dim_64": ("Qwen3Config", dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2)),
}

_CAUSAL_LM = {"LlamaConfig": "LlamaForCausalLM", "MistralConfig": "MistralForCausalLM",
              "Qwen2Config": "Qwen2ForCausalLM", "Qwen3Config": "Qwen3ForCausalLM"}


@dataclass
class HfCheckpoint:
    path: Path
    model: torch.nn.Module  # the transformers model whose weights were saved


def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is far from uniform (transformers' 0.02 init would hide
    position and masking errors); norms near 1, biases non-zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5 * 1.5)


def make_hf_checkpoint(name: str, path: Path) -> HfCheckpoint:
    """Create the HF_CASES model ``name`` with seeded random weights and save it (safetensors) to ``path``."""
    import transformers

    config_class, kwargs = HF_CASES[name]
    config = getattr(transformers, config_class)(**kwargs)
    config._attn_implementation = "eager"  # the plainest reference
    model = getattr(transformers, _CAUSAL_LM[config_class])(config).eval()
    randomize_weights(model, seed=sum(map(ord, name)))
    model.tie_weights()
    model.save_pretrained(path)
    return HfCheckpoint(path, model)
