"""Launcher for csrc/kernels/rope_append.cu: q/k norms, RoPE and the KV append in one launch."""

from __future__ import annotations

import functools
import math

import torch

from kvtool.kernels.compiler import KernelSpec
from kvtool.kernels.loader import KernelLibrary, device_arch, f32, i32, i64, launch, ptr
from kvtool.kernels.tensors import SUPPORTED_HEAD_DIMS, cache_strides, dtype_is_bf16, vector_rows

SOURCE = "rope_append.cu"
KERNEL = "kvt_rope_append"
NUM_WARPS = 4  # one head row per warp


@functools.lru_cache(maxsize=None)  # pure; called per layer per step
def rope_append_spec(head_dim: int, dtype: torch.dtype, arch: str) -> KernelSpec:
    """One specialization per (head_dim, dtype, architecture)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"the fused RoPE + KV append kernel supports head_dim {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    return KernelSpec.create(SOURCE, arch, KVT_HEAD_DIM=head_dim, KVT_DTYPE_BF16=dtype_is_bf16(dtype))


def rope_append(library: KernelLibrary, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
                kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *, num_heads: int,
                num_kv_heads: int) -> torch.Tensor:
    """The rotated queries [num_tokens, num_heads, head_dim] (a new tensor); keys and values stored.

    qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], the fused projection's output;
    cos / signed_sin: [num_tokens, 1, head_dim] or [num_tokens, head_dim] (``rope_cos_sin``'s tables);
    q_norm_weight / k_norm_weight: [head_dim] per-head RMSNorm weights applied before RoPE, or None;
    kv_cache: a layer's [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim] view; slot_mapping:
    [num_tokens] int64 (negative: store nothing). Everything in one 16-bit dtype on one device.
    Launches on torch's current stream.
    """
    strides = cache_strides(kv_cache)
    _num_blocks, _two, tokens_per_block, cache_kv_heads, head_dim = kv_cache.shape
    num_tokens = qkv.shape[0]
    if cache_kv_heads != num_kv_heads or qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} must be [num_tokens, ({num_heads} + 2 x {num_kv_heads}) x "
                         f"{head_dim}] for a cache of {cache_kv_heads} KV heads of {head_dim}")
    dtype = kv_cache.dtype
    if num_tokens == 0:
        return torch.empty((0, num_heads, head_dim), dtype=dtype, device=kv_cache.device)
    tables = [t.reshape(t.shape[0], -1) for t in (cos, signed_sin)]
    if any(t.shape != (num_tokens, head_dim) for t in tables) or tables[0].stride() != tables[1].stride():
        raise ValueError(f"cos {tuple(cos.shape)} and signed_sin {tuple(signed_sin.shape)} must be "
                         f"[{num_tokens}, 1, {head_dim}] with the same strides")
    weights = [w for w in (q_norm_weight, k_norm_weight) if w is not None]
    if any(w.shape != (head_dim,) for w in weights) or (len(weights) == 1):
        raise ValueError("q_norm_weight and k_norm_weight must both be [head_dim] or both None")
    if any(t.dtype != dtype for t in (qkv, *tables, *weights)):
        raise ValueError(f"qkv, the RoPE tables and the norm weights must have the KV cache's dtype {dtype}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be [{num_tokens}]")
    qkv_stride = vector_rows(qkv, "qkv")
    rope_stride = vector_rows(tables[0], "cos")
    vector_rows(tables[1], "signed_sin")
    for weight in weights:
        vector_rows(weight.view(1, head_dim), "norm weight")
    device = kv_cache.device
    query = torch.empty((num_tokens, num_heads, head_dim), dtype=dtype, device=device)
    slots = slot_mapping.to(device=device, dtype=torch.int64).contiguous()
    kernel = library.kernel(rope_append_spec(head_dim, dtype, device_arch(device)), KERNEL, device.index)
    grid = (num_tokens, math.ceil((num_heads + 2 * num_kv_heads) / NUM_WARPS))
    args = (ptr(qkv), i64(qkv_stride), ptr(tables[0]), ptr(tables[1]), i64(rope_stride),
            ptr(q_norm_weight), ptr(k_norm_weight), f32(eps), ptr(query), i64(query.stride(0)), ptr(slots),
            ptr(kv_cache), i64(strides.block), i64(strides.kv), i64(strides.token), i64(strides.head),
            i32(num_heads), i32(num_kv_heads), i32(tokens_per_block))
    launch(kernel, grid, (32 * NUM_WARPS,), args, device_index=device.index)
    return query
