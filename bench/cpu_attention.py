"""Decode attention on the CPU: kvtool's kernel (kvtool.cpu_kernels ops.attention) for a step of one
new token per sequence, per layer, with the KV cache read from memory as in a real step.

A real decode step streams every layer's weights between two visits of a layer's cache, so the cache
is never in the CPU's caches when attention reads it. Here --num_layers layers' caches (distinct
tensors, together larger than the last-level cache by default) are visited in turn; the median time
per layer over --rounds rounds, and the cache bytes it read per second, beside the streaming read
rate measured on the spot (bench/peers/floors.py).

    python bench/cpu_attention.py [--context 1056] [--seqs 1 8] [--threads 1 2]

Default shapes: SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64), 32-token blocks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from bench.peers.floors import read_bandwidth
from kvtool.cpu_kernels import CpuKernels, ops


def per_layer(kernels: CpuKernels, args, dtype: torch.dtype, num_seqs: int) -> float:
    """Median seconds of one layer's decode attention for num_seqs sequences of args.context tokens."""
    blocks_per_seq = -(-args.context // args.tokens_per_block)
    num_blocks = blocks_per_seq * num_seqs
    shape = (num_blocks, 2, args.tokens_per_block, args.num_kv_heads, args.head_dim)
    caches = [torch.randn(shape).to(dtype) for _ in range(args.num_layers)]
    query = torch.randn(num_seqs, args.num_heads, args.head_dim).to(dtype)
    out = torch.empty_like(query)
    # Blocks of the sequences interleaved, as a pool hands them out to requests arriving together.
    block_tables = np.arange(num_blocks, dtype=np.int32).reshape(blocks_per_seq, num_seqs).T.copy()
    plan = ops.plan_attention(kernels, np.arange(num_seqs + 1, dtype=np.int32),
                              np.full(num_seqs, args.context, dtype=np.int32), block_tables, num_blocks=num_blocks,
                              num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                              tokens_per_block=args.tokens_per_block, sliding_window=None)
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for cache in caches:
            ops.attention(kernels, plan, query, cache, out, args.head_dim ** -0.5)
        times.append((time.perf_counter() - start) / len(caches))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1056, help="cached tokens per sequence")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 8], help="sequences in the step")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num_layers", type=int, default=30)
    parser.add_argument("--num_heads", type=int, default=9)
    parser.add_argument("--num_kv_heads", type=int, default=3)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--tokens_per_block", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    for threads in args.threads:
        kernels = CpuKernels("auto", threads)
        print(f"{threads} thread(s), kernels in {kernels.isa}: streaming read {read_bandwidth(threads) / 1e9:.1f} GB/s")
        for dtype in (torch.float32, torch.bfloat16):
            for num_seqs in args.seqs:
                seconds = per_layer(kernels, args, dtype, num_seqs)
                cache_bytes = num_seqs * args.context * args.num_kv_heads * args.head_dim * 2 * dtype.itemsize
                print(f"  {str(dtype)[6:]:9s} {num_seqs} seq x {args.context} tokens: {seconds * 1e6:7.1f} us a layer "
                      f"({cache_bytes / seconds / 1e9:5.1f} GB/s of cache)")


if __name__ == "__main__":
    main()
