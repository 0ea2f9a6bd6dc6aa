"""kvtool: build-and-benchmark toolkit for LLM KV-cache reuse.

The LLM API mirrors TensorRT-LLM's names::

    from kvtool import LLM, SamplingParams, KvCacheConfig
    llm = LLM(model="preset:tiny-llama", kv_cache_config=KvCacheConfig(enable_block_reuse=True, tokens_per_block=16))
    out = llm.generate("Hello", SamplingParams(max_tokens=8))

A model given as a checkpoint or preset is built on the fly with ``build_options=BuildOptions(...)``
(trtllm-build's flags) and KvCacheConfig's tokens_per_block.
"""

from kvtool.config import (
    CapacitySchedulerPolicy,
    ContextChunkingPolicy,
    KvCacheConfig,
    SamplingParams,
    SchedulerConfig,
)
from kvtool.version import __version__

__all__ = [
    "LLM",
    "BuildOptions",
    "SamplingParams",
    "KvCacheConfig",
    "SchedulerConfig",
    "CapacitySchedulerPolicy",
    "ContextChunkingPolicy",
    "__version__",
]


def __getattr__(name: str):
    # LLM and BuildOptions pull in torch (LLM the C++ extension too): import them only when asked for.
    if name == "LLM":
        from kvtool.llm import LLM

        return LLM
    if name == "BuildOptions":
        from kvtool.plan.options import BuildOptions

        return BuildOptions
    raise AttributeError(f"module 'kvtool' has no attribute {name!r}")
