"""Launcher for csrc/kernels/paged_decode_attention.cu (split-K decode attention + partition reduce)."""

from __future__ import annotations

import functools
import math

import torch

from kvtool.kernels.compiler import KernelSpec
from kvtool.kernels.loader import KernelLibrary, device_arch, device_sm_count, f32, i32, i64, launch, ptr
from kvtool.kernels.tensors import dtype_is_bf16, paged_attention_args

SOURCE = "paged_decode_attention.cu"
KERNEL = "kvt_paged_decode_attention"
REDUCE_KERNEL = "kvt_paged_decode_reduce"
NUM_THREADS = 128
PARTITION_SIZE = 512          # keys per split-K partition when the batch fills the GPU (compile-time)
PARTITION_SIZES = (64, 128, 256, 512)  # what partition_size_for chooses from (each compiled on first use)
# A small batch gets smaller partitions, so that a 4,096-token sequence still spreads over at least
# this many CTAs per SM: at batch 1, 8 KV heads x 8 partitions of 512 keys fill 64 of an H200's 132
# SMs (455 GB/s measured, results/gpu/h200-2026-11-26/). bench/gpu_suite.py's decode section measures
# batch 1 at every size in PARTITION_SIZES; on the H100 (results/gpu/gpu_suite.md) 128 keys (256 CTAs,
# one wave of one CTA per SM) gave 857 GB/s, 64 keys (two per SM) 747, 256 keys 771, 512 keys 514.
REFERENCE_SEQ_LEN = 4096
TARGET_CTAS_PER_SM = 1
MAX_HEADS_PER_CTA = 8         # query heads sharing one K/V read; bounded by registers
UNROLL = 4                    # 16-byte K or V loads per thread in flight (a compile-time constant)
LOG2_E = 1.4426950408889634


def heads_per_cta(group_size: int) -> int:
    """The largest divisor of the GQA group size (num_heads / num_kv_heads) that is at most 8."""
    if group_size < 1:
        raise ValueError(f"GQA group size must be >= 1, got {group_size}")
    return max(d for d in range(1, min(group_size, MAX_HEADS_PER_CTA) + 1) if group_size % d == 0)


def num_partitions(max_seq_len: int, partition_size: int = PARTITION_SIZE) -> int:
    """Split-K partitions of the longest sequence; 1 means no reduce pass."""
    return max(1, math.ceil(max_seq_len / partition_size))


def partition_size_for(num_row_ctas: int, num_sms: int) -> int:
    """Keys per split-K partition for a launch of ``num_row_ctas`` CTAs per partition index (KV-head
    chunks x sequences): the largest of PARTITION_SIZES (the fewest partials to reduce) at which a
    REFERENCE_SEQ_LEN-token sequence gives TARGET_CTAS_PER_SM CTAs per SM, else the smallest."""
    if num_row_ctas < 1 or num_sms < 1:
        raise ValueError(f"num_row_ctas ({num_row_ctas}) and num_sms ({num_sms}) must be >= 1")
    for size in sorted(PARTITION_SIZES, reverse=True):
        if num_row_ctas * math.ceil(REFERENCE_SEQ_LEN / size) >= TARGET_CTAS_PER_SM * num_sms:
            return size
    return min(PARTITION_SIZES)


@functools.lru_cache(maxsize=None)  # pure; called per layer per step
def decode_attention_spec(head_dim: int, tokens_per_block: int, dtype: torch.dtype, group_size: int, arch: str,
                          partition_size: int = PARTITION_SIZE, unroll: int = UNROLL) -> KernelSpec:
    """The specialization for one (head_dim, tokens_per_block, dtype, GQA group, arch, partition, unroll)."""
    if unroll not in (2, 4, 8):
        raise ValueError(f"decode unroll must be 2, 4 or 8 loads per thread, got {unroll}")
    return KernelSpec.create(SOURCE, arch, KVT_HEAD_DIM=head_dim, KVT_TOKENS_PER_BLOCK=tokens_per_block,
                             KVT_DTYPE_BF16=dtype_is_bf16(dtype), KVT_HEADS_PER_CTA=heads_per_cta(group_size),
                             KVT_PARTITION_SIZE=partition_size, KVT_DECODE_UNROLL=unroll)


def paged_decode_attention(library: KernelLibrary, query: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           *, seq_offset: int, num_seqs: int, max_seq_len: int, scale: float,
                           sliding_window: int | None, out: torch.Tensor,
                           partition_size: int | None = None, unroll: int = UNROLL) -> None:
    """Attention of one new token per sequence for sequences ``seq_offset..seq_offset+num_seqs-1``.

    Sequence s's token is query row ``query_start_loc[s]`` (its query_len is 1) at position
    ``seq_lens[s] - 1``; it attends to the sequence's keys in ``kv_cache``
    [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim] through ``block_tables`` (-1 =
    released, never read), the last ``sliding_window`` of them when set. ``max_seq_len`` bounds
    every seq_len (it sizes the split-K grid); a sequence of seq_len 0 is skipped (a CUDA graph's
    padding slot). ``partition_size`` None: partition_size_for this batch on this device. Writes
    those rows of ``out`` [num_tokens, num_heads, head_dim]; launches on torch's current stream.
    """
    if num_seqs == 0:
        return
    a = paged_attention_args(query, kv_cache, out, block_tables, query_start_loc, seq_lens)
    device = kv_cache.device
    group_size = a.num_heads // a.num_kv_heads
    kv_chunks = a.num_kv_heads * (group_size // heads_per_cta(group_size))
    if partition_size is None:
        partition_size = partition_size_for(kv_chunks * num_seqs, device_sm_count(device))
    spec = decode_attention_spec(a.head_dim, a.tokens_per_block, kv_cache.dtype, group_size, device_arch(device),
                                 partition_size, unroll)
    parts = num_partitions(max_seq_len, partition_size)
    partial_out = partial_max = partial_sum = None
    if parts > 1:
        # fp32 per (decode seq, query head, partition): normalized output, max (log2 domain), sum.
        partial_out = torch.empty((num_seqs, a.num_heads, parts, a.head_dim), dtype=torch.float32, device=device)
        partial_max = torch.empty((num_seqs, a.num_heads, parts), dtype=torch.float32, device=device)
        partial_sum = torch.empty((num_seqs, a.num_heads, parts), dtype=torch.float32, device=device)
    window = int(sliding_window) if sliding_window else 0
    kernel = library.kernel(spec, KERNEL, device.index)
    grid = (kv_chunks, num_seqs, parts)
    args = (ptr(query), *map(i64, a.query_strides),
            ptr(kv_cache), i64(a.cache.block), i64(a.cache.kv), i64(a.cache.token), i64(a.cache.head),
            ptr(a.block_tables), i64(a.block_tables.stride(0)), ptr(a.query_start_loc), ptr(a.seq_lens),
            i32(seq_offset), ptr(out), *map(i64, a.out_strides),
            ptr(partial_out), ptr(partial_max), ptr(partial_sum),
            i32(a.num_heads), i32(a.num_kv_heads), f32(scale * LOG2_E), i32(window))
    launch(kernel, grid, (NUM_THREADS,), args, device_index=device.index)
    if parts > 1:
        reduce = library.kernel(spec, REDUCE_KERNEL, device.index)
        args = (ptr(partial_out), ptr(partial_max), ptr(partial_sum), ptr(a.query_start_loc), ptr(a.seq_lens),
                i32(seq_offset), ptr(out), *map(i64, a.out_strides), i32(a.num_heads), i32(parts))
        launch(reduce, (a.num_heads, num_seqs), (a.head_dim,), args, device_index=device.index)
