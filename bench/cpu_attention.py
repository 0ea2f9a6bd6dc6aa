"""Decode attention on the CPU: kvtool's kernel (kvtool.cpu_kernels ops.attention) for a step of one
new token per sequence, per layer, with the KV cache read from memory as in a real step.

A real decode step streams every layer's weights between two visits of a layer's cache, so the cache
is never in the CPU's caches when attention reads it. Here --num_layers layers' caches (distinct
tensors) are visited in turn with a read of --flush_mb MB before each (the weights streaming past);
the median time per layer over --rounds rounds, and the layer's cache bytes per second, beside the
streaming read rate measured on the spot (bench/peers/floors.py). Several sequences run twice: each
with blocks of its own, and all beginning with the same --shared_tokens tokens' blocks (a cached
prompt prefix, which the kernel reads once for them all).

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


def block_tables(args, num_seqs: int, shared: bool) -> tuple[np.ndarray, int]:
    """[num_seqs, blocks] int32 and the pool's size: each sequence's blocks of its own, interleaved as
    a pool hands them out to requests arriving together; or (shared) the first --shared_tokens
    tokens' blocks the same for every sequence, a prompt prefix cached once."""
    blocks_per_seq = -(-args.context // args.tokens_per_block)
    num_shared = args.shared_tokens // args.tokens_per_block if shared else 0
    own = blocks_per_seq - num_shared
    own_ids = np.arange(num_shared, num_shared + own * num_seqs, dtype=np.int32).reshape(own, num_seqs).T
    tables = np.concatenate([np.broadcast_to(np.arange(num_shared, dtype=np.int32), (num_seqs, num_shared)), own_ids],
                            axis=1)
    return np.ascontiguousarray(tables), num_shared + own * num_seqs


def per_layer(kernels: CpuKernels, args, dtype: torch.dtype, num_seqs: int, shared: bool) -> tuple[float, int]:
    """Median seconds of one layer's decode attention for num_seqs sequences of args.context tokens,
    and the cache bytes a layer holds for them."""
    tables, num_blocks = block_tables(args, num_seqs, shared)
    shape = (num_blocks, 2, args.tokens_per_block, args.num_kv_heads, args.head_dim)
    caches = [torch.randn(shape).to(dtype) for _ in range(args.num_layers)]
    query = torch.randn(num_seqs, args.num_heads, args.head_dim).to(dtype)
    out = torch.empty_like(query)
    plan = ops.plan_attention(kernels, np.arange(num_seqs + 1, dtype=np.int32),
                              np.full(num_seqs, args.context, dtype=np.int32), tables, num_blocks=num_blocks,
                              num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                              tokens_per_block=args.tokens_per_block, sliding_window=None, dtype=dtype)
    if shared != (plan.num_shared_prefixes > 0):
        raise SystemExit(f"the plan of {num_seqs} sequences has {plan.num_shared_prefixes} shared prefixes")
    # Between two layers a step streams the layer's weights: here a read of more than the last-level
    # cache, so that no layer's cache is still there when attention reads it.
    weights = torch.empty(args.flush_mb * 2 ** 20 // 4)
    times = []
    for _ in range(args.rounds):
        seconds = 0.0
        for cache in caches:
            kernels.sum(weights.data_ptr(), weights.numel())
            start = time.perf_counter()
            ops.attention(kernels, plan, query, cache, out, args.head_dim ** -0.5)
            seconds += time.perf_counter() - start
        times.append(seconds / len(caches))
    return statistics.median(times), caches[0].numel() * caches[0].element_size()


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
    parser.add_argument("--shared_tokens", type=int, default=1024,
                        help="tokens of the prefix the sequences share in the shared variant")
    parser.add_argument("--flush_mb", type=int, default=64,
                        help="MB read between two layers' attention (a step's weights streaming past)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    for threads in args.threads:
        kernels = CpuKernels("auto", threads)
        print(f"{threads} thread(s), kernels in {kernels.isa}: streaming read {read_bandwidth(threads) / 1e9:.1f} GB/s")
        for dtype in (torch.float32, torch.bfloat16):
            for num_seqs in args.seqs:
                for shared in (False, True) if num_seqs > 1 else (False,):
                    seconds, cache_bytes = per_layer(kernels, args, dtype, num_seqs, shared)
                    tables = f"the first {args.shared_tokens} shared" if shared else "own blocks"
                    print(f"  {str(dtype)[6:]:9s} {num_seqs} seq x {args.context} tokens ({tables:>20s}): "
                          f"{seconds * 1e6:7.1f} us a layer ({cache_bytes / seconds / 1e9:5.1f} GB/s of cache)")


if __name__ == "__main__":
    main()
