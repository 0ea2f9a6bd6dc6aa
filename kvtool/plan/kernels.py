"""Ahead-of-time CUDA kernels of a plan: every specialization its shapes need, in <plan>/kernels/.

`kvtool build` compiles them when asked (or, by default, when the build machine has a GPU), so
the first forward on the GPU loads cubins instead of compiling; the runtime compiles missing ones
on first use into the same directory's cache layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvtool.models.model_config import ModelConfig
from kvtool.plan.format import file_checksum

KERNELS_DIR = "kernels"


def compile_plan_kernels(plan_dir: Path, config: ModelConfig, tokens_per_block: int,
                         kv_cache_dtype: torch.dtype) -> tuple[list[dict[str, Any]], str]:
    """Compiles the plan's kernel specializations into plan_dir/kernels; returns the manifest
    entries (file, size, checksum: verified when the plan loads) and the target architecture."""
    from kvtool.kernels.compiler import KernelCompiler
    from kvtool.kernels.precompile import DEFAULT_ARCH, precompile, specs_for_model

    specs = specs_for_model(head_dim=config.head_dim, num_heads=config.num_heads,
                            num_kv_heads=config.num_kv_heads, tokens_per_block=tokens_per_block,
                            dtype=kv_cache_dtype, arch=DEFAULT_ARCH)
    compiled = precompile(specs, KernelCompiler(cache_dir=plan_dir / KERNELS_DIR))
    artifacts = []
    for kernel in compiled:
        path = Path(kernel.cubin_path)
        artifacts.append({"file": str(path.relative_to(plan_dir)), "size_bytes": path.stat().st_size,
                          "checksum": file_checksum(path), "kernel": kernel.spec.label})
    return artifacts, DEFAULT_ARCH


def plan_kernel_cache(plan_dir: Path) -> Path:
    """Where the runtime looks for (and adds) this plan's compiled kernels."""
    return Path(plan_dir) / KERNELS_DIR
