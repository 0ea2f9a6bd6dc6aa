"""The plan an engine runs: a built plan as it is, or a model built on the fly (once, into the plan cache)
with the block size and runtime limits its EngineConfig asks for."""

from __future__ import annotations

from pathlib import Path

from kvtool.config import EngineConfig
from kvtool.errors import KvtoolError
from kvtool.plan.load import Plan, is_built_plan, resolve_model
from kvtool.plan.build_options import BuildOptions


def on_the_fly_build_options(config: EngineConfig, build_options: BuildOptions | None = None, *,
                             dtype: str | None = None) -> BuildOptions:
    """What a model built on the fly is built with: ``build_options`` (default: BuildOptions() in
    ``dtype``, else the device's: bfloat16 on a GPU, float32 on a CPU), with the block size the config
    asks for and its runtime limits where they exceed those options."""
    if build_options is None:
        if dtype is None:
            from kvtool.runtime.device import default_dtype  # torch: only when a model is built here

            dtype = default_dtype()
        build_options = BuildOptions(dtype=dtype)
    wanted, given = config.tokens_per_block, build_options.tokens_per_block
    if wanted is not None and wanted != given and given != BuildOptions().tokens_per_block:
        # The LLM API's spelling of the block size asked for (EngineConfig takes it from KvCacheConfig).
        raise KvtoolError(f"KvCacheConfig.tokens_per_block={wanted} and BuildOptions.tokens_per_block={given} "
                          "disagree: give the block size once")
    return build_options.admitting(tokens_per_block=wanted, max_batch_size=config.max_batch_size,
                                   max_seq_len=config.max_seq_len, max_num_tokens=config.max_num_tokens)


def engine_plan(model: str | Path | Plan, config: EngineConfig, *, build_options: BuildOptions | None = None,
                cache_dir: Path | None = None) -> Plan:
    """A Plan or plan directory as built (kvtool.runtime.assemble checks the config against it); a
    checkpoint, GGUF file or preset built on the fly into ``cache_dir`` (see on_the_fly_build_options)."""
    if is_built_plan(model):
        return resolve_model(model)
    return resolve_model(str(model), options=on_the_fly_build_options(config, build_options), cache_dir=cache_dir)
