"""Presets: the shapes of real models (weights are seeded random: TTFT depends on shapes, not
values) plus tiny ones for tests and a small one for CPU benchmarks."""

from __future__ import annotations

from kvtool.models.model_config import ModelConfig

PRESET_PREFIX = "preset:"

# Tiny and small presets reserve ids 256 (BOS) and 257 (EOS) next to the 256 byte tokens.
_TOY_SPECIALS = {"bos_token_id": 256, "eos_token_ids": [257]}
_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}


def _presets() -> dict[str, dict]:
    # Built on each call: callers may mutate what they get.
    return {
        # Qwen/Qwen3-0.6B config.json
        "qwen3-0.6b": dict(family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                           num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                           rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True,
                           qk_norm=True, bos_token_id=151643, eos_token_ids=[151645]),
        # meta-llama/Llama-3.2-1B config.json
        "llama-3.2-1b": dict(family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                             num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
                             rope_theta=500000.0, rope_scaling={**_LLAMA3_SCALING, "factor": 32.0},
                             max_position_embeddings=131072, tie_word_embeddings=True,
                             bos_token_id=128000, eos_token_ids=[128001]),
        # meta-llama/Llama-3.1-8B config.json
        "llama-3.1-8b": dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                             rope_theta=500000.0, rope_scaling=dict(_LLAMA3_SCALING),
                             max_position_embeddings=131072, tie_word_embeddings=False,
                             bos_token_id=128000, eos_token_ids=[128001]),
        # Qwen/Qwen3-8B config.json
        "qwen3-8b": dict(family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                         num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
                         qk_norm=True, bos_token_id=151643, eos_token_ids=[151645]),
        # Qwen3-8B with the YaRN scaling its model card gives for 131,072 tokens (32,768 x 4): long traces.
        "qwen3-8b-128k": dict(family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                              num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                              rope_theta=1000000.0, max_position_embeddings=131072, tie_word_embeddings=False,
                              rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 32768},
                              qk_norm=True, bos_token_id=151643, eos_token_ids=[151645]),
        # Tests: a few layers, vocab >= 1024 so generated datasets' ids (< 1000) are valid.
        "tiny-llama": dict(family="llama", vocab_size=1024, hidden_size=128, intermediate_size=256,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                           rope_theta=10000.0, max_position_embeddings=4096, **_TOY_SPECIALS),
        "tiny-qwen3": dict(family="qwen3", vocab_size=1024, hidden_size=128, intermediate_size=256,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6,
                           rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=True,
                           qk_norm=True, **_TOY_SPECIALS),
        # CPU benchmarks: big enough that attention and KV reuse show in TTFT, small enough for 2 cores.
        "small-llama": dict(family="llama", vocab_size=4096, hidden_size=512, intermediate_size=1376,
                            num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, rms_norm_eps=1e-5,
                            rope_theta=10000.0, max_position_embeddings=8192, **_TOY_SPECIALS),
    }


def preset_names() -> list[str]:
    return list(_presets())


def preset_config(name: str) -> ModelConfig:
    """The ModelConfig of a preset (name with or without the ``preset:`` prefix)."""
    if name.startswith(PRESET_PREFIX):
        name = name[len(PRESET_PREFIX):]
    presets = _presets()
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}: use one of {', '.join(presets)} (e.g. preset:tiny-llama)")
    return ModelConfig(**presets[name])
