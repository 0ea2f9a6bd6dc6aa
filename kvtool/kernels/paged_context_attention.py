"""Launcher for csrc/kernels/paged_context_attention.cu (FlashAttention-2-style prefill over the paged cache,
split over the keys when the launch is too small to fill the GPU)."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from kvtool.kernels.compiler import KernelSpec
from kvtool.kernels.loader import KernelLibrary, device_arch, device_sm_count, f32, i32, i64, launch, ptr
from kvtool.kernels.tensors import dtype_is_bf16, paged_attention_args

SOURCE = "paged_context_attention.cu"
KERNEL = "kvt_paged_context_attention"
REDUCE_KERNEL = "kvt_paged_context_reduce"
NUM_WARPS = 4             # 32 query rows each: BLOCK_M = 128 query rows per CTA
BLOCK_M = 32 * NUM_WARPS
REDUCE_THREADS = 128
LOG2_E = 1.4426950408889634
# Key splits: a launch of fewer CTAs than TARGET_CTAS_PER_SM per SM (the kernel's __launch_bounds__)
# splits each request's keys into runs of at least MIN_KEYS_PER_SPLIT, so that a 128-token question
# over a 2,048-token prefix (32 CTAs: 1 query tile x 32 heads) spreads over the whole GPU. The H100
# run's 128-token hit step took 13.0 ms of GPU time where its weights and GEMMs need 7.6.
TARGET_CTAS_PER_SM = 2
MIN_KEYS_PER_SPLIT = 256
# A CUDA graph's launch is sized for the runtime's max_seq_len, not the request it replays: splits are
# sized so that a request of REFERENCE_KEYS keys (a typical cached prefix) fills the GPU, the longest
# request taking as many splits as it needs, at most MAX_KEY_SPLITS (splits past a request's keys
# return at once; the reduce reads only the ones it saw).
REFERENCE_KEYS = 2048
MAX_KEY_SPLITS = 32
# The splits' fp32 partials take rows x heads x head_dim x 4 bytes each (8.4 MB for 512 rows of
# qwen3-8b); a graph keeps them in its memory pool, so their total is bounded.
MAX_PARTIAL_BYTES = 64 << 20


class KeySplits(NamedTuple):
    num_splits: int       # 1: no split, the kernel writes the output itself
    tiles_per_split: int  # key tiles per split (the last split also takes any tiles past the others)


def key_splits(num_ctas: int, max_seq_len: int, head_dim: int, num_sms: int,
               max_splits: int = MAX_KEY_SPLITS) -> KeySplits:
    """How to split the keys of a launch of ``num_ctas`` CTAs (query tiles x heads x requests) whose
    requests have at most ``max_seq_len`` tokens: enough splits for a request of min(max_seq_len,
    REFERENCE_KEYS) keys to give TARGET_CTAS_PER_SM CTAs per SM, none shorter than MIN_KEYS_PER_SPLIT
    keys, at most ``max_splits``."""
    if num_ctas < 1 or num_sms < 1:
        raise ValueError(f"num_ctas ({num_ctas}) and num_sms ({num_sms}) must be >= 1")
    keys = keys_per_tile(head_dim)
    num_tiles = math.ceil(max_seq_len / keys)
    min_tiles = math.ceil(MIN_KEYS_PER_SPLIT / keys)
    wanted = math.ceil(TARGET_CTAS_PER_SM * num_sms / num_ctas)
    if wanted <= 1 or max_splits <= 1 or num_tiles < 2 * min_tiles:
        return KeySplits(1, max(num_tiles, 1))
    tiles_per_split = max(min_tiles, math.ceil(min(num_tiles, math.ceil(REFERENCE_KEYS / keys)) / wanted),
                          math.ceil(num_tiles / max_splits))
    return KeySplits(math.ceil(num_tiles / tiles_per_split), tiles_per_split)


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
                            *, num_seqs: int, max_query_len: int, max_seq_len: int, scale: float,
                            sliding_window: int | None, out: torch.Tensor, num_splits: int | None = None) -> None:
    """Attention of the new tokens of sequences ``0..num_seqs-1`` over their paged KV.

    query/out: [num_tokens, num_heads, head_dim]; sequence i owns rows
    ``query_start_loc[i]:query_start_loc[i+1]``, the last query tokens of its ``seq_lens[i]``
    tokens, whose K/V (prefix and new tokens alike) are already in ``kv_cache``
    [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim] at ``block_tables`` [num_seqs, *]
    (-1 = released, never read). Causal aligned bottom-right; with ``sliding_window`` W the token at
    position p sees positions > p - W. ``max_query_len`` bounds every query_len (grid size); a
    sequence with no query rows is skipped (a CUDA graph's padding slot); ``max_seq_len`` bounds every
    seq_len (it sizes the key splits). ``num_splits`` None: key_splits for this launch on this device
    (1: never split). Writes only the rows of these sequences in ``out``; launches on torch's current
    stream.
    """
    if num_seqs == 0 or max_query_len <= 0:
        return
    a = paged_attention_args(query, kv_cache, out, block_tables, query_start_loc, seq_lens)
    device = kv_cache.device
    spec = context_attention_spec(a.head_dim, a.tokens_per_block, kv_cache.dtype, device_arch(device))
    shared = smem_bytes(a.head_dim)
    kernel = library.kernel(spec, KERNEL, device.index, dynamic_smem_bytes=shared)
    num_tiles = math.ceil(max_query_len / BLOCK_M)
    num_ctas = num_tiles * a.num_heads * num_seqs
    if num_splits is None:
        split_bytes = query.shape[0] * a.num_heads * a.head_dim * 4  # one split's fp32 partials
        splits = key_splits(num_ctas, max_seq_len, a.head_dim, device_sm_count(device),
                            min(MAX_KEY_SPLITS, MAX_PARTIAL_BYTES // split_bytes))
    else:
        splits = KeySplits(num_splits, math.ceil(math.ceil(max_seq_len / keys_per_tile(a.head_dim)) / num_splits))
    partial_acc = partial_ml = None
    if splits.num_splits > 1:
        # fp32 per (token row, query head, split): unnormalized output, and (max in the log2 domain, sum).
        rows = (query.shape[0], a.num_heads, splits.num_splits)
        partial_acc = torch.empty((*rows, a.head_dim), dtype=torch.float32, device=device)
        partial_ml = torch.empty((*rows, 2), dtype=torch.float32, device=device)
    grid = (num_tiles, a.num_heads, num_seqs * splits.num_splits)
    window = int(sliding_window) if sliding_window else 0
    args = (ptr(query), *map(i64, a.query_strides),
            ptr(kv_cache), i64(a.cache.block), i64(a.cache.kv), i64(a.cache.token), i64(a.cache.head),
            ptr(a.block_tables), i64(a.block_tables.stride(0)), ptr(a.query_start_loc), ptr(a.seq_lens),
            ptr(out), *map(i64, a.out_strides), ptr(partial_acc), ptr(partial_ml), i32(splits.tiles_per_split),
            i32(splits.num_splits), i32(a.num_heads), i32(a.num_kv_heads), f32(scale * LOG2_E), i32(window))
    launch(kernel, grid, (32 * NUM_WARPS,), args, device_index=device.index, shared_mem=shared)
    if splits.num_splits > 1:
        reduce = library.kernel(spec, REDUCE_KERNEL, device.index)
        args = (ptr(partial_acc), ptr(partial_ml), ptr(a.query_start_loc), ptr(a.seq_lens),
                ptr(out), *map(i64, a.out_strides), i32(splits.tiles_per_split), i32(splits.num_splits),
                i32(a.num_heads), i32(window))
        launch(reduce, (max_query_len, num_seqs), (REDUCE_THREADS,), args, device_index=device.index)
