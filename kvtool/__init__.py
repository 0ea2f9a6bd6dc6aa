"""kvtool: build-and-benchmark toolkit for LLM KV-cache reuse.

The LLM API mirrors TensorRT-LLM's names::

    from kvtool import LLM, SamplingParams, KvCacheConfig
    llm = LLM(model="preset:tiny-llama", kv_cache_config=KvCacheConfig(enable_block_reuse=True))
    out = llm.generate("Hello", SamplingParams(max_tokens=8))
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
    "SamplingParams",
    "KvCacheConfig",
    "SchedulerConfig",
    "CapacitySchedulerPolicy",
    "ContextChunkingPolicy",
    "__version__",
]


def __getattr__(name: str):
    # LLM pulls in torch and the C++ extension: import it only when asked for.
    if name == "LLM":
        from kvtool.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvtool' has no attribute {name!r}")
