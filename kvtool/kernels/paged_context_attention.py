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
NUM_WARPS = 4             # BLOCK_M = ROWS_PER_WARP * NUM_WARPS query rows per CTA
BLOCK_N = 64              # keys per tile (the default variant)
ROWS_PER_WARP = 16        # the default variant; 32 selects the FlashAttention-2-style variant
# What the runtime (CudaPagedAttention) launches: 32 rows per warp ran 10% faster than 16 on an H200
# (4 x 4096 causal prefill, bf16, hd 128: 185 vs 169 TFLOP/s, results/gpu/gpu_suite.md).
RUNTIME_ROWS_PER_WARP = 32
LOG2_E = 1.4426950408889634


def block_m(num_warps: int = NUM_WARPS, rows_per_warp: int = ROWS_PER_WARP) -> int:
    return rows_per_warp * num_warps


def keys_per_tile(head_dim: int, rows_per_warp: int = ROWS_PER_WARP) -> int:
    """Keys per tile. The 32-rows-per-warp variant holds 2 x head_dim/8 accumulator tiles per thread:
    at head_dim 128 a 64-key S tile on top of them spills past 255 registers, so it takes 32 keys."""
    if rows_per_warp == 32 and head_dim > 64:
        return 32
    return BLOCK_N


def smem_bytes(head_dim: int, num_warps: int = NUM_WARPS, block_n: int | None = None,
               rows_per_warp: int = ROWS_PER_WARP) -> int:
    """Dynamic shared memory of one CTA: Q tile + double-buffered K and V tiles (rows padded by 8
    elements) + two key-validity flag rows. The kernel static_asserts the same number."""
    keys = block_n if block_n is not None else keys_per_tile(head_dim, rows_per_warp)
    row_bytes = (head_dim + 8) * 2
    return (block_m(num_warps, rows_per_warp) + 4 * keys) * row_bytes + 2 * keys * 4


def _check_variant(num_warps: int, rows_per_warp: int) -> None:
    if rows_per_warp == 16:
        if num_warps not in (4, 8):
            raise ValueError(f"the context kernel runs 4 or 8 warps per CTA (64 or 128 query rows), got {num_warps}")
    elif rows_per_warp == 32:
        if num_warps != 4:
            raise ValueError(f"the 32-rows-per-warp context kernel runs 4 warps per CTA, got {num_warps}")
    else:
        raise ValueError(f"the context kernel runs 16 or 32 query rows per warp, got {rows_per_warp}")


@functools.lru_cache(maxsize=None)  # pure; called per layer per step
def context_attention_spec(head_dim: int, tokens_per_block: int, dtype: torch.dtype, arch: str,
                           num_warps: int = NUM_WARPS, rows_per_warp: int = ROWS_PER_WARP) -> KernelSpec:
    """The specialization for one (head_dim, tokens_per_block, dtype, arch[, warps per CTA, rows per
    warp]). The default variant passes no KVT_CTX_ROWS_PER_WARP (its label and cache key stay as they
    were); rows_per_warp=32 compiles the FlashAttention-2-style variant."""
    _check_variant(num_warps, rows_per_warp)
    extra = {} if rows_per_warp == ROWS_PER_WARP else {"KVT_CTX_ROWS_PER_WARP": rows_per_warp}
    return KernelSpec.create(SOURCE, arch, KVT_HEAD_DIM=head_dim, KVT_TOKENS_PER_BLOCK=tokens_per_block,
                             KVT_DTYPE_BF16=dtype_is_bf16(dtype), KVT_CTX_NUM_WARPS=num_warps,
                             KVT_CTX_BLOCK_N=keys_per_tile(head_dim, rows_per_warp),
                             KVT_CTX_SMEM_BYTES=smem_bytes(head_dim, num_warps, rows_per_warp=rows_per_warp),
                             **extra)


def paged_context_attention(library: KernelLibrary, query: torch.Tensor, kv_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            *, num_seqs: int, max_query_len: int, scale: float, sliding_window: int | None,
                            out: torch.Tensor, num_warps: int = NUM_WARPS,
                            rows_per_warp: int = ROWS_PER_WARP) -> None:
    """Attention of the new tokens of sequences ``0..num_seqs-1`` over their paged KV.

    query/out: [num_tokens, num_heads, head_dim]; sequence i owns rows
    ``query_start_loc[i]:query_start_loc[i+1]``, the last query tokens of its ``seq_lens[i]``
    tokens, whose K/V (prefix and new tokens alike) are already in ``kv_cache``
    [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim] at ``block_tables`` [num_seqs, *]
    (-1 = released, never read). Causal aligned bottom-right; with ``sliding_window`` W the token at
    position p sees positions > p - W. ``max_query_len`` bounds every query_len (grid size).
    Writes only the rows of these sequences in ``out``; launches on torch's current stream.
    ``num_warps`` (4 or 8) sets the query rows per CTA (16 per warp), a tuning knob.
    ``rows_per_warp=32`` (with 4 warps: 128 rows per CTA) selects the FlashAttention-2-style variant
    (two m16 row groups per warp, split K/V cp.async groups, longest tiles first); same results.
    """
    if num_seqs == 0 or max_query_len <= 0:
        return
    a = paged_attention_args(query, kv_cache, out, block_tables, query_start_loc, seq_lens)
    device = kv_cache.device
    spec = context_attention_spec(a.head_dim, a.tokens_per_block, kv_cache.dtype, device_arch(device), num_warps,
                                  rows_per_warp)
    shared = smem_bytes(a.head_dim, num_warps, rows_per_warp=rows_per_warp)
    kernel = library.kernel(spec, KERNEL, device.index, dynamic_smem_bytes=shared)
    grid = (math.ceil(max_query_len / block_m(num_warps, rows_per_warp)), a.num_heads, num_seqs)
    window = int(sliding_window) if sliding_window else 0
    args = (ptr(query), *map(i64, a.query_strides),
            ptr(kv_cache), i64(a.cache.block), i64(a.cache.kv), i64(a.cache.token), i64(a.cache.head),
            ptr(a.block_tables), i64(a.block_tables.stride(0)), ptr(a.query_start_loc), ptr(a.seq_lens),
            ptr(out), *map(i64, a.out_strides),
            i32(a.num_heads), i32(a.num_kv_heads), f32(scale * LOG2_E), i32(window))
    launch(kernel, grid, (32 * num_warps,), args, device_index=device.index, shared_mem=shared)
