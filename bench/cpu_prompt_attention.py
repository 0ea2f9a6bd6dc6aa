"""Prompt attention on the CPU: kvtool's kernel (kvtool.cpu_kernels ops.attention) for one prompt of
--context tokens attending itself causally, a layer at a time: what a miss's attention costs.

Its cache is the one the prompt has just written (in the CPU's caches, as in a real step: RoPE and
the KV append run right before it). Prints the median time per layer over --rounds calls, in each
dtype and --isa, and the rate in GFLOP/s of the causal products (scores and weighted values:
4 x context x (context + 1) / 2 x head_dim x heads).

    python bench/cpu_prompt_attention.py [--context 1053] [--isa auto avx2] [--threads 2]

Default shapes: SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64), 32-token blocks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kvtool.cpu_kernels import CpuKernels, ops


def per_layer(kernels: CpuKernels, args, dtype: torch.dtype) -> float:
    """Median seconds of one layer's attention over a prompt of args.context tokens."""
    num_blocks = -(-args.context // args.tokens_per_block)
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn((num_blocks, 2, args.tokens_per_block, args.num_kv_heads, args.head_dim),
                        generator=generator).to(dtype)
    query = torch.randn((args.context, args.num_heads, args.head_dim), generator=generator).to(dtype)
    out = torch.empty_like(query)
    plan = ops.plan_attention(kernels, np.array([0, args.context], dtype=np.int32),
                              np.array([args.context], dtype=np.int32),
                              np.arange(num_blocks, dtype=np.int32)[None, :], num_blocks=num_blocks,
                              num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                              tokens_per_block=args.tokens_per_block, sliding_window=None, dtype=dtype)
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        ops.attention(kernels, plan, query, cache, out, args.head_dim ** -0.5)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1053, help="prompt tokens")
    parser.add_argument("--isa", nargs="+", default=["auto"], help="the kernels' instruction sets")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num_heads", type=int, default=9)
    parser.add_argument("--num_kv_heads", type=int, default=3)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--tokens_per_block", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    flops = 4 * args.context * (args.context + 1) / 2 * args.head_dim * args.num_heads
    for isa in args.isa:
        kernels = CpuKernels(isa, args.threads)
        for dtype in (torch.float32, torch.bfloat16):
            seconds = per_layer(kernels, args, dtype)
            print(f"{kernels.isa:12s} {str(dtype)[6:]:9s} {args.context} tokens, {args.threads} thread(s): "
                  f"{seconds * 1e3:6.2f} ms a layer ({flops / seconds / 1e9:5.1f} GFLOP/s)")


if __name__ == "__main__":
    main()
