"""Compiles, ahead of time, every kernel specialization a model needs (e.g. into a plan's kernels/).

``kvtool build`` can call :func:`precompile` with the plan's shapes so the first forward on the GPU
loads cubins instead of compiling; no GPU is needed (the architecture is named, default sm_90).

    python -m kvtool.kernels.precompile --head_dim 128 --num_heads 32 --num_kv_heads 8 \
        --tokens_per_block 16 --dtype bfloat16 --cache_dir plans/qwen3-8b/kernels
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvtool.kernels.add_rms_norm import add_rms_norm_spec
from kvtool.kernels.block_copy import block_copy_spec
from kvtool.kernels.compiler import CompiledKernel, KernelCompiler, KernelSpec
from kvtool.kernels.kv_append import kv_append_spec
from kvtool.kernels.paged_context_attention import context_attention_spec
from kvtool.kernels.paged_decode_attention import PARTITION_SIZES, decode_attention_spec
from kvtool.kernels.rope_append import rope_append_spec
from kvtool.kernels.silu_mul import silu_mul_spec

DEFAULT_ARCH = "sm_90"


def specs_for_model(*, head_dim: int, num_heads: int, num_kv_heads: int, tokens_per_block: int,
                    dtype: torch.dtype, arch: str = DEFAULT_ARCH) -> list[KernelSpec]:
    """The specializations CudaPagedAttention, the model's fused kernels and the block copies launch
    for these shapes (the decode kernel at every partition size a batch may choose)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    group_size = num_heads // num_kv_heads
    return [
        kv_append_spec(arch),
        context_attention_spec(head_dim, tokens_per_block, dtype, arch),
        *(decode_attention_spec(head_dim, tokens_per_block, dtype, group_size, arch, size) for size in PARTITION_SIZES),
        block_copy_spec(arch),
        add_rms_norm_spec(dtype, arch),
        rope_append_spec(head_dim, dtype, arch),
        silu_mul_spec(dtype, arch),
    ]


def precompile(specs: list[KernelSpec], compiler: KernelCompiler | None = None,
               max_workers: int | None = None) -> list[CompiledKernel]:
    """Compiles (or finds cached) every spec, in parallel; returns them in order."""
    compiler = compiler if compiler is not None else KernelCompiler()
    workers = max_workers or max(1, min(len(specs), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(compiler.compile, specs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head_dim", type=int, required=True)
    parser.add_argument("--num_heads", type=int, required=True)
    parser.add_argument("--num_kv_heads", type=int, required=True)
    parser.add_argument("--tokens_per_block", type=int, required=True)
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="bfloat16")
    parser.add_argument("--arch", default=DEFAULT_ARCH)
    parser.add_argument("--cache_dir", type=Path, default=None)
    args = parser.parse_args()
    specs = specs_for_model(head_dim=args.head_dim, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                            tokens_per_block=args.tokens_per_block, dtype=getattr(torch, args.dtype), arch=args.arch)
    for compiled in precompile(specs, KernelCompiler(cache_dir=args.cache_dir)):
        origin = "cached" if compiled.from_cache else f"compiled by {compiled.compiler}"
        print(f"{compiled.spec.label}: {compiled.cubin_path} ({origin})")


if __name__ == "__main__":
    main()
