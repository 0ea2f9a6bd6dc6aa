"""A model as a simulation sees a plan: its architecture, build options and tokenizer, no weights.
Simulating an 8B model's cache needs its shapes, not 16 GB of weights written and read, so
`kvtool simulate --model preset:qwen3-8b` (or a Hugging Face checkpoint directory) runs on any machine
with an estimated or given cost model, whatever --dtype, --tokens_per_block or limits it asks for."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.models.model_config import ModelConfig, torch_dtype
from kvtool.models.presets import PRESET_PREFIX, preset_config
from kvtool.models.tokenizer import ByteLevelTokenizer, HuggingFaceTokenizer, Tokenizer, has_hf_tokenizer
from kvtool.plan.build_options import BuildOptions


@dataclass(frozen=True)
class ModelShapes:
    """What SimulatedLLM and the reports read of a plan, for a preset or checkpoint that is not built."""

    name: str                          # preset:NAME or the checkpoint directory: reports' plan_path
    model_config: ModelConfig
    build_options: BuildOptions        # resolved, as a build would write them
    tokenizer_dir: Path | None = None  # a checkpoint's Hugging Face tokenizer (None: byte-level, as a preset's plan)
    manifest: dict = field(default_factory=dict)

    @classmethod
    def of(cls, model: str, options: BuildOptions) -> ModelShapes:
        """``model``: preset:NAME or a Hugging Face checkpoint directory (only its config.json and
        tokenizer files are read)."""
        if is_preset(model):
            config, tokenizer_dir = preset_config(model), None
        else:
            from kvtool.plan.builder import read_checkpoint_config

            directory = Path(model)
            config = read_checkpoint_config(directory)
            tokenizer_dir = directory if has_hf_tokenizer(directory) else None
        return cls(str(model), config, options.resolved(config.max_position_embeddings), tokenizer_dir)

    @property
    def path(self) -> Path:
        return Path(self.name)  # reports name the preset or checkpoint (plan_path); there is no plan directory

    @property
    def kv_cache_dtype(self):
        return torch_dtype(self.build_options.resolved_kv_cache_dtype)

    @property
    def supports_kv_reuse(self) -> bool:
        return self.build_options.use_paged_context_fmha

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        # What a build puts in the plan (kvtool.models.tokenizer.write_tokenizer): the checkpoint's, else byte-level.
        c = self.model_config
        if self.tokenizer_dir is not None:
            return HuggingFaceTokenizer(self.tokenizer_dir, c.vocab_size, c.eos_token_ids)
        return ByteLevelTokenizer(c.vocab_size, c.bos_token_id, c.eos_token_ids)


def is_preset(model) -> bool:
    return str(model).startswith(PRESET_PREFIX)
