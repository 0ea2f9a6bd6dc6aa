"""kvtool: build-and-benchmark toolkit for LLM KV-cache reuse.

The LLM API mirrors TensorRT-LLM's names::

    from kvtool import LLM, SamplingParams, KvCacheConfig
    llm = LLM(model="preset:tiny-llama", kv_cache_config=KvCacheConfig(enable_block_reuse=True, tokens_per_block=16))
    out = llm.generate("Hello", SamplingParams(max_tokens=8))

A model given as a checkpoint or preset is built on the fly with ``build_options=BuildOptions(...)``
(trtllm-build's flags) and KvCacheConfig's tokens_per_block.
"""

import os

# torch's CPU kernels run on libgomp, whose idle threads spin-wait between parallel regions. On
# shared or busy cores the spinning thread takes the time the working one needs: 30 layers of
# 32-row projections with one core busy took 336 ms by default and 236 ms with a short spin, the
# same 102-110 ms on a quiet machine (results/cpu_profile.md). libgomp reads this when torch loads,
# so it has effect when kvtool is imported first (the CLI always is); a user's own value wins.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
# torch's CPU allocator backs large tensors (weights, the KV pool) with 2 MB pages when this is set
# (read at its first allocation): a decode step streams ~0.5 GB through 4 KB pages' TLB otherwise.
# SmolLM2's decode step: 23-24 ms with, 25-27 without (1 thread, results/cpu_profile.md).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

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


_CONFIG_NAMES = ("SamplingParams", "KvCacheConfig", "SchedulerConfig", "CapacitySchedulerPolicy",
                 "ContextChunkingPolicy")


def __getattr__(name: str):
    # Every name is imported when first asked for: the configuration needs the C++ extension, LLM
    # and BuildOptions torch too, and the report code must import without either (the peers'
    # venvs run it; bench/peers/common.py).
    if name in _CONFIG_NAMES:
        from kvtool import config

        return getattr(config, name)
    if name == "LLM":
        from kvtool.llm import LLM

        return LLM
    if name == "BuildOptions":
        from kvtool.plan.build_options import BuildOptions

        return BuildOptions
    raise AttributeError(f"module 'kvtool' has no attribute {name!r}")
