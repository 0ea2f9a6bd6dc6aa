"""Launcher for csrc/kernels/paged_context_attention.cu (FlashAttention-2-style prefill over the paged cache)."""

from __future__ import annotations

import functools
import math

import torch

from kvtool.kernels.compiler import KernelSpec
from kvtool.kernels.loader import KernelLibrary, device_arch, f32, i32, i64, launch, ptr
from kvtool.kernels.tensors import dtype_is_bf16, paged_attention_args

SOURCE = "paged_context_attention.cu"
KERNEL = "kvt_paged_context_attention"
NUM_WARPS = 4             # 32 query rows each: BLOCK_M = 128 query rows per CTA
BLOCK_M = 32 * NUM_WARPS
LOG2_E = 1.4426950408889634


def keys_per_tile(head_dim: int) -> int:
    """Keys per tile. A warp holds 2 x head_dim/8 accumulator tiles: at head_dim 128 a 64-key S tile
    on top of them spills past 255 registers, so it takes 32 keys."""
    return 32 if head_dim > 64 else 64


def smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of one CTA: Q tile + double-buffered K and V tiles (rows padded by 8
    elements) + two key-validity flag rows. The kernel static_asserts the same number."""
    keys = keys_per_tile(head_dim)
    row_bytes = (head_dim + 8) * 2
    return (BLOCK_M + 4 * keys) * row_bytes + 2 * keys * 4


@functools.lru_cache(maxsize=None)  # pure; called per layer per step
def context_attention_spec(head_dim: int, tokens_per_block: int, dtype: torch.dtype, arch: str) -> KernelSpec:
    """The specialization for one (head_dim, tokens_per_block, dtype, arch)."""
    return KernelSpec.create(SOURCE, arch, KVT_HEAD_DIM=head_dim, KVT_TOKENS_PER_BLOCK=tokens_per_block,
                             KVT_DTYPE_BF16=dtype_is_bf16(dtype), KVT_CTX_BLOCK_N=keys_per_tile(head_dim),
                             KVT_CTX_SMEM_BYTES=smem_bytes(head_dim))


def paged_context_attention(library: KernelLibrary, query: torch.Tensor, kv_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            *, num_seqs: int, max_query_len: int, scale: float, sliding_window: int | None,
                            out: torch.Tensor) -> None:
    """Attention of the new tokens of sequences ``0..num_seqs-1`` over their paged KV.

    query/out: [num_tokens, num_heads, head_dim]; sequence i owns rows
    ``query_start_loc[i]:query_start_loc[i+1]``, the last query tokens of its ``seq_lens[i]``
    tokens, whose K/V (prefix and new tokens alike) are already in ``kv_cache``
    [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim] at ``block_tables`` [num_seqs, *]
    (-1 = released, never read). Causal aligned bottom-right; with ``sliding_window`` W the token at
    position p sees positions > p - W. ``max_query_len`` bounds every query_len (grid size); a
    sequence with no query rows is skipped (a CUDA graph's padding slot). Writes only the rows of
    these sequences in ``out``; launches on torch's current stream.
    """
    if num_seqs == 0 or max_query_len <= 0:
        return
    a = paged_attention_args(query, kv_cache, out, block_tables, query_start_loc, seq_lens)
    device = kv_cache.device
    spec = context_attention_spec(a.head_dim, a.tokens_per_block, kv_cache.dtype, device_arch(device))
    shared = smem_bytes(a.head_dim)
    kernel = library.kernel(spec, KERNEL, device.index, dynamic_smem_bytes=shared)
    grid = (math.ceil(max_query_len / BLOCK_M), a.num_heads, num_seqs)
    window = int(sliding_window) if sliding_window else 0
    args = (ptr(query), *map(i64, a.query_strides),
            ptr(kv_cache), i64(a.cache.block), i64(a.cache.kv), i64(a.cache.token), i64(a.cache.head),
            ptr(a.block_tables), i64(a.block_tables.stride(0)), ptr(a.query_start_loc), ptr(a.seq_lens),
            ptr(out), *map(i64, a.out_strides),
            i32(a.num_heads), i32(a.num_kv_heads), f32(scale * LOG2_E), i32(window))
    launch(kernel, grid, (32 * NUM_WARPS,), args, device_index=device.index, shared_mem=shared)
