"""Checks and strides for the tensors handed to the kernels (raw pointers need exact contracts).

The kernels read 16-byte vectors, so every row they touch must start 16-byte aligned: base
pointers aligned to 16 bytes, the last dim contiguous and every other stride a multiple of 8
elements (16-bit dtypes). A tensor that breaks this is a caller bug and raises ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvtool.config import is_power_of_two

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128)


def kernels_apply(head_dim: int, dtype: torch.dtype) -> bool:
    """True when kvtool's CUDA kernels cover a model (else the torch attention serves it)."""
    return dtype in SUPPORTED_DTYPES and head_dim in SUPPORTED_HEAD_DIMS


def dtype_is_bf16(dtype: torch.dtype) -> int:
    """The KVT_DTYPE_BF16 define: 1 for bfloat16, 0 for float16."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"kvtool's CUDA kernels take float16 or bfloat16 tensors, got {dtype}: "
                         "cast the model and KV cache to one of them")
    return int(dtype == torch.bfloat16)


def _check_vector_aligned(tensor: torch.Tensor, name: str, strides: tuple[int, ...]) -> None:
    if not tensor.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got one on {tensor.device}")
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {tuple(tensor.stride())}")
    if tensor.data_ptr() % 16 or any(s % 8 for s in strides):
        raise ValueError(f"{name} rows must be 16-byte aligned (base address and strides {tuple(tensor.stride())} "
                         "multiples of 8 elements): pass a contiguous tensor")


@dataclass(frozen=True)
class CacheStrides:
    """Element strides of one layer's cache view [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim]."""

    block: int
    kv: int
    token: int
    head: int


def cache_strides(kv_cache: torch.Tensor) -> CacheStrides:
    """Validates a layer's KV cache view (e.g. ``pool[:, layer]``) and returns its strides."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError("kv_cache must be [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim], "
                         f"got shape {tuple(kv_cache.shape)}")
    dtype_is_bf16(kv_cache.dtype)
    tokens_per_block, head_dim = kv_cache.shape[2], kv_cache.shape[4]
    if not is_power_of_two(tokens_per_block):
        raise ValueError(f"kv_cache tokens_per_block must be a power of two, got {tokens_per_block}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"kvtool's CUDA attention supports head_dim {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    strides = tuple(kv_cache.stride()[:4])
    _check_vector_aligned(kv_cache, "kv_cache", strides)
    return CacheStrides(*strides)


def row_strides(tensor: torch.Tensor, name: str, num_heads: int, head_dim: int) -> tuple[int, int]:
    """(token stride, head stride) of a [num_tokens, num_heads, head_dim] activation tensor."""
    if tensor.dim() != 3 or tensor.shape[1] != num_heads or tensor.shape[2] != head_dim:
        raise ValueError(f"{name} must be [num_tokens, {num_heads}, {head_dim}], got {tuple(tensor.shape)}")
    token_stride, head_stride = tensor.stride(0), tensor.stride(1)
    _check_vector_aligned(tensor, name, (token_stride, head_stride))
    return token_stride, head_stride


def vector_rows(tensor: torch.Tensor, name: str) -> int:
    """The row stride of a [num_rows, width] 16-bit tensor whose rows the fused kernels read as 16-byte
    vectors (width a multiple of 8, rows 16-byte aligned)."""
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be 2-D [num_rows, width], got shape {tuple(tensor.shape)}")
    dtype_is_bf16(tensor.dtype)
    if tensor.shape[1] % 8:
        raise ValueError(f"{name} rows must hold a multiple of 8 values (16-byte vectors), got {tensor.shape[1]}")
    _check_vector_aligned(tensor, name, (tensor.stride(0),))
    return tensor.stride(0)


def int32_on(tensor: torch.Tensor, device: torch.device, name: str) -> torch.Tensor:
    """``tensor`` as a contiguous int32 tensor on ``device`` (metadata usually already is)."""
    if tensor.dtype == torch.int32 and tensor.device == device and tensor.is_contiguous():
        return tensor  # the usual case (the runner's metadata): no op dispatched, per layer per kernel
    if tensor.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an integer tensor, got {tensor.dtype}")
    return tensor.to(device=device, dtype=torch.int32).contiguous()


class PagedAttentionArgs(NamedTuple):
    """The checked inputs of a paged attention launch (context or decode)."""

    cache: CacheStrides
    tokens_per_block: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    query_strides: tuple[int, int]  # (token, head) element strides
    out_strides: tuple[int, int]
    block_tables: torch.Tensor      # int32 on the cache's device, contiguous
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor


def paged_attention_args(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, block_tables: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> PagedAttentionArgs:
    """Checks query/out [num_tokens, num_heads, head_dim] against a layer's kv_cache
    [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim] and brings the metadata to int32."""
    if kv_cache.dim() != 5 or query.dim() != 3:
        raise ValueError("kv_cache must be [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim] and query "
                         f"[num_tokens, num_heads, head_dim], got {tuple(kv_cache.shape)} and {tuple(query.shape)}")
    _num_blocks, _two, tokens_per_block, num_kv_heads, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype != kv_cache.dtype or out.dtype != kv_cache.dtype:
        raise ValueError(f"query ({query.dtype}), out ({out.dtype}) and kv_cache ({kv_cache.dtype}) must share a dtype")
    cache = cache_strides(kv_cache)
    device = kv_cache.device
    return PagedAttentionArgs(cache, tokens_per_block, num_heads, num_kv_heads, head_dim,
                              row_strides(query, "query", num_heads, head_dim),
                              row_strides(out, "out", num_heads, head_dim),
                              int32_on(block_tables, device, "block_tables"),
                              int32_on(query_start_loc, device, "query_start_loc"),
                              int32_on(seq_lens, device, "seq_lens"))
