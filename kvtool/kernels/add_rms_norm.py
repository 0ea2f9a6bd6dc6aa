"""Launcher for csrc/kernels/add_rms_norm.cu: residual add + RMSNorm in one pass, in place."""

from __future__ import annotations

import functools

import torch

from kvtool.kernels.compiler import KernelSpec
from kvtool.kernels.loader import KernelLibrary, device_arch, f32, i32, i64, launch, ptr
from kvtool.kernels.tensors import dtype_is_bf16, vector_rows

SOURCE = "add_rms_norm.cu"
KERNEL = "kvt_add_rms_norm"
NUM_THREADS = 256


@functools.lru_cache(maxsize=None)  # pure; called per layer per step
def add_rms_norm_spec(dtype: torch.dtype, arch: str) -> KernelSpec:
    """One specialization per (dtype, architecture); the hidden size is a runtime argument."""
    return KernelSpec.create(SOURCE, arch, KVT_DTYPE_BF16=dtype_is_bf16(dtype))


def add_rms_norm(library: KernelLibrary, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> None:
    """In place: ``residual = x + residual``, then ``x = rms_norm(residual) * weight``.

    x, residual: [num_tokens, hidden] (rows 16-byte aligned, hidden a multiple of 8), weight: [hidden],
    all one 16-bit dtype on one device. Launches on torch's current stream.
    """
    num_tokens, hidden = x.shape
    if residual.shape != x.shape or weight.shape != (hidden,):
        raise ValueError(f"x {tuple(x.shape)}, residual {tuple(residual.shape)} and weight {tuple(weight.shape)} "
                         "must be [num_tokens, hidden], [num_tokens, hidden] and [hidden]")
    if residual.dtype != x.dtype or weight.dtype != x.dtype:
        raise ValueError(f"x ({x.dtype}), residual ({residual.dtype}) and weight ({weight.dtype}) must share a dtype")
    x_stride = vector_rows(x, "x")
    residual_stride = vector_rows(residual, "residual")
    vector_rows(weight.view(1, hidden), "weight")
    if num_tokens == 0:
        return
    device = x.device
    kernel = library.kernel(add_rms_norm_spec(x.dtype, device_arch(device)), KERNEL, device.index)
    args = (ptr(x), i64(x_stride), ptr(residual), i64(residual_stride), ptr(weight), i32(hidden), f32(eps))
    launch(kernel, (num_tokens,), (NUM_THREADS,), args, device_index=device.index)
