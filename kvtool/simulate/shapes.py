"""A preset as a simulation sees a plan: its architecture and build options, no weights. Simulating
an 8B model's cache needs its shapes, not 16 GB of random weights, so `kvtool simulate --model
preset:qwen3-8b` runs on any machine (with an estimated or given cost model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvtool.models.config import ModelConfig, torch_dtype
from kvtool.models.presets import PRESET_PREFIX, preset_config
from kvtool.models.tokenizer import ByteLevelTokenizer
from kvtool.plan.options import BuildOptions


@dataclass(frozen=True)
class PresetShapes:
    """What SimulatedLLM and the reports read of a plan, for a preset that is not built."""

    name: str  # preset:NAME
    model_config: ModelConfig
    build_options: BuildOptions
    manifest: dict = field(default_factory=dict)

    @classmethod
    def of(cls, model: str, options: BuildOptions) -> PresetShapes:
        config = preset_config(model)
        return cls(model, config, options.resolved(config.max_position_embeddings))  # as a build resolves them

    @property
    def path(self) -> Path:
        return Path(self.name)  # reports name the preset (plan_path); there is no directory

    @property
    def kv_cache_dtype(self):
        return torch_dtype(self.build_options.resolved_kv_cache_dtype)

    @property
    def supports_kv_reuse(self) -> bool:
        return self.build_options.use_paged_context_fmha

    @property
    def tokenizer(self) -> ByteLevelTokenizer:
        # A preset's plan gets the byte-level tokenizer too (kvtool.models.tokenizer.write_tokenizer).
        c = self.model_config
        return ByteLevelTokenizer(c.vocab_size, c.bos_token_id, c.eos_token_ids)


def is_preset(model: str) -> bool:
    return str(model).startswith(PRESET_PREFIX)
