"""Llama-family models over the paged KV cache: config, presets, tokenizer, the model itself."""

from kvtool.models.model_config import ModelConfig
from kvtool.models.presets import preset_config, preset_names

__all__ = ["ModelConfig", "preset_config", "preset_names"]
