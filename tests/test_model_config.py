"""ModelConfig reads Hugging Face config.json files of both transformers generations, validates
its fields, and the presets carry the real models' shapes."""

from __future__ import annotations

import pytest
import torch

from kvtool.models.model_config import ModelConfig
from kvtool.models.presets import preset_config, preset_names

# meta-llama/Llama-3.1-8B config.json as transformers 4.x writes it (rope_theta + rope_scaling).
LLAMA_31_8B_HF = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}

# Qwen/Qwen3-8B config.json.
QWEN3_8B_HF = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_llama_31_config_json_reads_as_the_preset():
    assert ModelConfig.from_hf_config(LLAMA_31_8B_HF) == preset_config("llama-3.1-8b")


def test_qwen3_config_json_reads_as_the_preset():
    assert ModelConfig.from_hf_config(QWEN3_8B_HF) == preset_config("preset:qwen3-8b")


def test_transformers_5_rope_parameters_are_read():
    hf = {key: value for key, value in LLAMA_31_8B_HF.items() if key not in ("rope_theta", "rope_scaling")}
    hf["rope_parameters"] = {**LLAMA_31_8B_HF["rope_scaling"], "rope_theta": 500000.0}
    assert ModelConfig.from_hf_config(hf) == preset_config("llama-3.1-8b")
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    config = ModelConfig.from_hf_config(hf)
    assert config.rope_scaling is None and config.rope_theta == 10000.0


def test_qwen_sliding_window_applies_only_when_enabled_on_every_layer():
    assert ModelConfig.from_hf_config({**QWEN3_8B_HF, "sliding_window": 4096}).sliding_window is None
    enabled = {**QWEN3_8B_HF, "sliding_window": 4096, "use_sliding_window": True}
    assert ModelConfig.from_hf_config(enabled).sliding_window == 4096
    with pytest.raises(ValueError, match="mixes sliding and full attention"):
        ModelConfig.from_hf_config({**enabled, "layer_types": ["sliding_attention", "full_attention"]})


def test_qwen2_always_has_a_qkv_bias_and_no_output_bias():
    config = ModelConfig.from_hf_config({**QWEN3_8B_HF, "model_type": "qwen2", "head_dim": None})
    assert (config.attention_bias, config.attention_output_bias, config.qk_norm) == (True, False, False)


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_key_value_heads": 5}, "multiple of num_kv_heads"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling type 'longrope' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"yarn scaling needs a positive \['original_max_pos"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 scaling needs"),
    ({"eos_token_id": 200000}, "outside the vocabulary"),
    ({"hidden_size": None}, "hidden_size must be a positive integer"),
])
def test_unsupported_or_inconsistent_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**LLAMA_31_8B_HF, **change})


def test_incomplete_config_json_names_the_missing_keys():
    with pytest.raises(ValueError, match="lacks \\['hidden_size', 'num_hidden_layers'\\]"):
        ModelConfig.from_hf_config({key: value for key, value in LLAMA_31_8B_HF.items()
                                    if key not in ("hidden_size", "num_hidden_layers")})


def test_dict_round_trip_and_unknown_keys():
    config = preset_config("tiny-qwen3")
    assert ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown keys \\['num_experts'\\]"):
        ModelConfig.from_dict({**config.to_dict(), "num_experts": 8})


def test_kv_bytes_per_token_sizes_the_pools():
    config = preset_config("llama-3.1-8b")
    # 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB per token in bf16.
    assert config.num_kv_bytes_per_token(torch.bfloat16) == 131072
    assert config.num_kv_bytes_per_token("float32") == 262144


# Parameter counts published for the real models (exact for Llama, model cards' rounding for Qwen3).
@pytest.mark.parametrize("name,expected,tolerance", [
    ("llama-3.1-8b", 8_030_261_248, 0), ("llama-3.2-1b", 1_235_814_400, 0),
    ("qwen3-8b", 8.19e9, 0.01e9), ("qwen3-0.6b", 0.60e9, 0.01e9),
])
def test_real_presets_have_the_real_parameter_counts(name, expected, tolerance):
    assert abs(preset_config(name).num_parameters() - expected) <= tolerance


def test_every_preset_is_valid_and_test_presets_cover_generated_token_ids():
    for name in preset_names():
        config = preset_config(name)
        assert config.vocab_size >= 1024, name
    small = preset_config("small-llama")
    assert (small.num_layers, small.hidden_size, small.num_heads, small.num_kv_heads) == (8, 512, 8, 4)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
], ids=lambda rope: rope["rope_type"])
def test_rope_frequencies_match_transformers(rope):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvtool.models.llama import rope_inv_freq

    hf = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                                  max_position_embeddings=1024, rope_parameters=rope)
    ours = rope_inv_freq(ModelConfig.from_hf_config(hf.to_dict()))
    if rope["rope_type"] == "default":
        reference = 1.0 / rope["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128)
    else:
        reference, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
        assert attention_factor == 1.0
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=0)
