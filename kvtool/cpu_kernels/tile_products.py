"""A prompt's projections on AMX tiles (the amx kernels; csrc/cpu/tile_linear_amx.h), bfloat16 weights laid
out once at load (``TileWeight``).

oneDNN splits a product evenly between the threads, and on the family 6 model 207 Xeon did not split
SmolLM2-135M's qkv and down products of a 1,053-token prompt at all; the tile product's tasks are taken
by the threads in turn, and gate_up's product ends in SiLU(gate) * up itself (the [rows, 2 * intermediate]
product is never written). results/cpu_tile_linear.md has the figures.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtool.cpu_kernels._kernels import CpuKernels, TileWeight
from kvtool.cpu_kernels.step_buffers import StepBuffers

TileProduct = Callable[[torch.Tensor], torch.Tensor]


def tile_weight(module: torch.nn.Module, *, gated: bool = False) -> TileWeight | None:
    """``module``'s weight laid out for tile products; None where they cannot take it (a bias, another
    dtype than bfloat16, in_features not a multiple of 32, a gated half not of whole 16-row tiles)."""
    weight = module.weight  # [out_features, in_features]
    if module.bias is not None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" \
            or weight.stride(1) != 1 or not TileWeight.fits(weight.shape[0], weight.shape[1], gated):
        return None
    return TileWeight(weight.data_ptr(), weight.shape[0], weight.shape[1], weight.stride(0), gated)


def tile_product(kernels: CpuKernels, weight: TileWeight, outputs: StepBuffers, name: str) -> TileProduct:
    """x [rows, in_features] (contiguous rows) -> ``outputs``' buffer ``name`` [rows, out_features]: x .
    weight^T (gated: SiLU(gate) * up)."""
    out_features = weight.out_features

    def product(x: torch.Tensor) -> torch.Tensor:
        out = outputs.rows(name, x.shape[0], out_features)
        kernels.tile_linear(weight, x.data_ptr(), x.shape[0], x.stride(0), out.data_ptr(), out_features)
        return out

    return product
