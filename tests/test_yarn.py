"""YaRN RoPE scaling: kvtool's frequencies and attention factor are transformers' for the configs
that use it (Qwen3's 128k model card, DeepSeek's mscale, the optional betas); a whole Qwen3 with
YaRN computes transformers' logits in tests/test_model_vs_transformers.py (case qwen3_yarn_rope)."""

from __future__ import annotations

import pytest
import torch

from kvtool.models.model_config import ModelConfig
from kvtool.models.llama import rope_attention_factor, rope_inv_freq
from kvtool.models.presets import preset_config

ROPES = {
    "qwen3_model_card": ({"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                          "original_max_position_embeddings": 32768}, 128),
    "betas_untruncated": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                           "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2,
                           "truncate": False}, 64),
    "deepseek_mscale": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707}, 64),
    "given_attention_factor": ({"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                "original_max_position_embeddings": 32768, "attention_factor": 0.8782488562869419},
                               128),
}


@pytest.mark.parametrize("name", list(ROPES))
def test_yarn_frequencies_and_attention_factor_match_transformers(name):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope, head_dim = ROPES[name]
    hf = transformers.Qwen3Config(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=head_dim,
                                  max_position_embeddings=131072, rope_parameters=rope)
    config = ModelConfig.from_hf_config(hf.to_dict())
    assert config.rope_scaling["rope_type"] == "yarn"
    reference, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    torch.testing.assert_close(rope_inv_freq(config), reference, rtol=1e-6, atol=0)
    assert rope_attention_factor(config) == pytest.approx(attention_factor, rel=1e-12)
    assert attention_factor != 1.0


def test_the_128k_qwen3_preset_is_qwen3_8b_with_the_model_cards_yarn():
    long, base = preset_config("qwen3-8b-128k"), preset_config("qwen3-8b")
    assert long.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert long.max_position_embeddings == 131072
    assert {**long.to_dict(), "rope_scaling": None, "max_position_embeddings": 40960} == base.to_dict()
