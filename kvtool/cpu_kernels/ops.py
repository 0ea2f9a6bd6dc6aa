"""The CPU kernels called on torch tensors: each wrapper reads pointers, strides and the dtype, and
checks what the kernel cannot (a row must be contiguous; float32 or bfloat16 only).

Shapes follow kvtool.models.llama: rows of a step are flattened, [num_tokens, ...].
"""

from __future__ import annotations

import torch

from kvtool.cpu_kernels._kernels import ArgMax, AttentionPlan, CpuKernels, DType

DTYPES = {torch.float32: DType.FLOAT32, torch.bfloat16: DType.BFLOAT16}


def kernel_dtype(tensor: torch.Tensor) -> DType:
    dtype = DTYPES.get(tensor.dtype)
    if dtype is None or tensor.device.type != "cpu":
        raise ValueError(f"the CPU kernels take float32 or bfloat16 CPU tensors, got {tensor.dtype} on {tensor.device}")
    return dtype


def _rows(tensor: torch.Tensor, name: str) -> None:
    if tensor.dim() != 2 or tensor.stride(1) != 1:
        raise ValueError(f"{name} must be [rows, n] with contiguous rows, got shape {tuple(tensor.shape)} and "
                         f"strides {tensor.stride()}")


def rms_norm(kernels: CpuKernels, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """out = rms_norm(x + residual) * weight; residual (when given) becomes x + residual. x, residual,
    out: [rows, dim]."""
    for tensor, name in ((x, "x"), (out, "out")) + (((residual, "residual"),) if residual is not None else ()):
        _rows(tensor, name)
    kernels.rms_norm(x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                     x.shape[0], x.shape[1], x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
                     eps, kernel_dtype(x))
    return out


def silu_mul(kernels: CpuKernels, gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [rows, n] = silu(gate_up[:, :n]) * gate_up[:, n:]."""
    _rows(gate_up, "gate_up")
    _rows(out, "out")
    kernels.silu_mul(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1], gate_up.stride(0), out.stride(0),
                     kernel_dtype(out))
    return out


def linear(kernels: CpuKernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           out: torch.Tensor) -> torch.Tensor:
    """out [rows, out_features] = x [rows, in_features] @ weight [out_features, in_features].T (+ bias),
    each weight row read once for all rows (a decode step's products; few rows)."""
    for tensor, name in ((x, "x"), (weight, "weight"), (out, "out")):
        _rows(tensor, name)
    dtype = kernel_dtype(x)
    if weight.dtype != x.dtype or out.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"linear: x, weight, bias and out must share one dtype, got {x.dtype}, {weight.dtype}, "
                         f"{None if bias is None else bias.dtype} and {out.dtype}")
    (rows, in_features), out_features = x.shape, weight.shape[0]
    if weight.shape[1] != in_features or tuple(out.shape) != (rows, out_features) or (
            bias is not None and (tuple(bias.shape) != (out_features,) or not bias.is_contiguous())):
        raise ValueError(f"linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)} and out {tuple(out.shape)} disagree")
    kernels.linear(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(), rows,
                   in_features, out_features, x.stride(0), weight.stride(0), out.stride(0), dtype)
    return out


def argmax(kernels: CpuKernels, values: torch.Tensor) -> ArgMax:
    """The largest of values [n] (float32 or bfloat16, n >= 1) and the index of its first occurrence; a
    NaN is the largest, its first one taken (NumPy's argmax picks the same index)."""
    if values.dim() != 1 or values.numel() == 0 or not values.is_contiguous():
        raise ValueError(f"argmax: values must be one contiguous row of at least one value, got shape "
                         f"{tuple(values.shape)}")
    return kernels.argmax(values.data_ptr(), kernel_dtype(values), 0, values.numel())


def draw(kernels: CpuKernels, values: torch.Tensor, temperature: float, u: float, *, top_k: int = 0,
         top_p: float = 1.0) -> int:
    """A draw from softmax(values / temperature) (values [n] float32 or bfloat16, n >= 1), cut to its
    top_k largest (0: all) and then the fewest of those whose mass reaches top_p (ties with the last kept
    kept too), by inverse transform of u in [0, 1) in the order of values: the first index whose running
    sum of the kept exp((x - max) / temperature) exceeds u times their total (what a sampled decode step
    picks in C++); argmax's index where the largest value is NaN or infinite."""
    if values.dim() != 1 or values.numel() == 0 or not values.is_contiguous():
        raise ValueError(f"draw: values must be one contiguous row of at least one value, got shape "
                         f"{tuple(values.shape)}")
    return kernels.draw(values.data_ptr(), kernel_dtype(values), values.numel(), temperature, top_k, top_p, u)


def rope_cache(inv_freq: torch.Tensor, max_positions: int, scale: float = 1.0) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of each position's head_dim / 2 angles, then their sin,
    times ``scale`` (a RoPE scaling's attention factor; the values kvtool.models.llama.rope_cos_sin
    computes for a step)."""
    freqs = torch.arange(max_positions, dtype=torch.int64).float().unsqueeze(1) * inv_freq.float().unsqueeze(0)
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return (table * scale if scale != 1.0 else table).contiguous()


def rope_store_kv(kernels: CpuKernels, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  norm_eps: float = 0.0) -> None:
    """Rotates q and k of qkv [tokens, (heads + 2 kv_heads) * head_dim] in place (rotate-half RoPE
    after the optional per-head q/k RMSNorm), then stores k and v of token t at slot_mapping[t] of
    kv_cache [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim]. positions and slot_mapping:
    int64 [tokens]; cos_sin: rope_cache()."""
    _rows(qkv, "qkv")
    check_cache(kv_cache, num_kv_heads, head_dim)
    for tensor, name in ((positions, "positions"), (slot_mapping, "slot_mapping")):
        if tensor.dtype != torch.int64 or not tensor.is_contiguous() or tensor.shape[0] != qkv.shape[0]:
            raise ValueError(f"{name} must be int64 [{qkv.shape[0]}], got {tensor.dtype} {tuple(tensor.shape)}")
    kernels.rope_store_kv(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), num_heads, num_kv_heads, head_dim,
                          positions.data_ptr(), cos_sin.data_ptr(), cos_sin.shape[0],
                          0 if q_norm is None else q_norm.data_ptr(), 0 if k_norm is None else k_norm.data_ptr(),
                          norm_eps, kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
                          kv_cache.stride(3), slot_mapping.data_ptr(), kv_cache.shape[2], kernel_dtype(qkv),
                          kernel_dtype(kv_cache))


def check_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """A layer of the KV cache as the kernels read it: [num_blocks, 2, tokens_per_block, kv_heads, head_dim],
    each head contiguous (the blocks may be strided: a view of a block-major pool)."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim) \
            or kv_cache.stride(4) != 1:
        raise ValueError(f"kv_cache must be [num_blocks, 2, tokens_per_block, {num_kv_heads}, {head_dim}] with "
                         f"contiguous heads, got {tuple(kv_cache.shape)} strides {kv_cache.stride()}")


def plan_attention(kernels: CpuKernels, query_start_loc, seq_lens, block_tables, *, num_blocks: int, num_heads: int,
                   num_kv_heads: int, head_dim: int, tokens_per_block: int,
                   sliding_window: int | None, dtype: torch.dtype) -> AttentionPlan:
    """The step's attention tasks, from int32 query_start_loc [n + 1], seq_lens [n] and block_tables
    [n, max_blocks] (numpy arrays or CPU tensors), shaped for the kernels that will run them on queries
    and a cache of dtype. ValueError when a visible block is not in the pool."""
    if dtype not in DTYPES:
        raise ValueError(f"the CPU kernels take float32 or bfloat16 queries and caches, got {dtype}")
    return kernels.plan_attention(query_start_loc, seq_lens, block_tables, num_blocks, num_heads, num_kv_heads,
                                  head_dim, tokens_per_block, sliding_window or 0, DTYPES[dtype])


def attention(kernels: CpuKernels, plan: AttentionPlan, query: torch.Tensor, kv_cache: torch.Tensor,
              out: torch.Tensor, scale: float) -> torch.Tensor:
    """out [tokens, heads, head_dim] = attention of query (same shape; rows may be strided, heads
    contiguous) over the planned sequences' cached keys and values."""
    if query.dim() != 3 or query.stride(2) != 1 or query.stride(1) != query.shape[2]:
        raise ValueError(f"query must be [tokens, heads, head_dim] with contiguous heads, got {tuple(query.shape)} "
                         f"strides {query.stride()}")
    if not out.is_contiguous() or out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out must be contiguous {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} "
                         f"{out.dtype}")
    check_cache(kv_cache, kv_cache.shape[3], query.shape[2])
    kernels.attention(plan, query.data_ptr(), query.stride(0), out.data_ptr(), out.stride(0), kv_cache.data_ptr(),
                      kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), scale,
                      kernel_dtype(query), kernel_dtype(kv_cache))
    return out
