"""Launcher for csrc/kernels/silu_mul.cu: the MLP's silu(gate) * up in one launch."""

from __future__ import annotations

import functools
import math

import torch

from kvtool.kernels.compiler import KernelSpec
from kvtool.kernels.loader import KernelLibrary, device_arch, i32, i64, launch, ptr
from kvtool.kernels.tensors import dtype_is_bf16, vector_rows

SOURCE = "silu_mul.cu"
KERNEL = "kvt_silu_mul"
NUM_THREADS = 256


@functools.lru_cache(maxsize=None)  # pure; called per layer per step
def silu_mul_spec(dtype: torch.dtype, arch: str) -> KernelSpec:
    """One specialization per (dtype, architecture); sizes are runtime arguments."""
    return KernelSpec.create(SOURCE, arch, KVT_DTYPE_BF16=dtype_is_bf16(dtype))


def silu_mul(library: KernelLibrary, gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * intermediate] ([gate | up], the fused gate_up_proj output) ->
    silu(gate) * up [num_tokens, intermediate], a new tensor. Launches on torch's current stream."""
    num_tokens, width = gate_up.shape
    intermediate = width // 2
    if width % 16:
        raise ValueError(f"gate_up must be [num_tokens, 2 * intermediate] with intermediate a multiple of 8, "
                         f"got {tuple(gate_up.shape)}")
    stride = vector_rows(gate_up, "gate_up")
    out = torch.empty((num_tokens, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    device = gate_up.device
    kernel = library.kernel(silu_mul_spec(gate_up.dtype, device_arch(device)), KERNEL, device.index)
    grid = (num_tokens, math.ceil(intermediate // 8 / NUM_THREADS))
    args = (ptr(gate_up), i64(stride), ptr(out), i64(out.stride(0)), i32(intermediate))
    launch(kernel, grid, (NUM_THREADS,), args, device_index=device.index)
    return out
