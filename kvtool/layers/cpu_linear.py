"""Projections on the CPU: torch's oneDNN product on a weight packed once at load.

torch's ``F.linear`` runs MKL on the CPU for float32. oneDNN with the weight reordered once into
its blocked layout is faster for the row counts of a decode step or a short chunk everywhere, and
on AVX-512 for every row count: there MKL (on an AMD EPYC it takes its AVX2 code) reached 100
GFLOP/s per core on a 1,056-row prefill and oneDNN 230 (``python bench/cpu_gemm.py``;
results/cpu_profile.md). On an AVX2-only CPU the two were level from 512 rows on, so products
above MAX_PACKED_ROWS_AVX2 rows stay on MKL there. bfloat16 products always take oneDNN (MKL has
none). The packed copy costs the weight's bytes once more.

A fused gate_up projection is packed as its two halves, run as two products: a 1,053-token miss of
SmolLM2-135M after decode steps (as a request's prompt comes after others' tokens) took 0.88x (float32)
and 0.90x (bfloat16) of the fused product's time, right after another miss 1.00x, decode steps alike,
results identical (bench/cpu_forward.py --paths kernels,kernels-fused-gate-up; results/cpu_decode_rows.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# On an AVX2-only CPU: oneDNN led by 1.5x at 32-128 rows and 1.2x at 256; level from 512 rows on.
MAX_PACKED_ROWS_AVX2 = 256


def packed_row_limit(dtype: torch.dtype) -> int | None:
    """The most rows a product runs on the packed weight; None: every product does."""
    if dtype == torch.bfloat16 or torch.backends.cpu.get_cpu_capability() == "AVX512":
        return None
    return MAX_PACKED_ROWS_AVX2


def can_pack_dtype(dtype: torch.dtype) -> bool:
    """float32 wherever torch has oneDNN; bfloat16 where oneDNN runs it natively (AVX-512 and up)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """A linear layer whose products run on a oneDNN-packed copy of its weight (up to
    ``max_packed_rows`` rows, all when None; larger ones on ``F.linear``). ``num_parts`` > 1 packs the
    weight's output rows as that many equal parts, each its own product (a fused gate_up's halves)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_packed_rows: int | None,
                 num_parts: int = 1) -> None:
        super().__init__()
        if num_parts < 1 or weight.shape[0] % num_parts:
            raise ValueError(f"cannot split {weight.shape[0]} output features into {num_parts} equal parts")
        self.weight = weight  # [out_features, in_features]
        self.bias = bias
        self.max_packed_rows = max_packed_rows
        # Opaque oneDNN tensors in a blocked layout: not parameters, never saved or moved.
        rows = weight.shape[0] // num_parts
        self.packed_parts = [torch.ops.mkldnn._reorder_linear_weight(part.detach().contiguous(), None)
                             for part in weight.split(rows)]
        self.part_biases = [None] * num_parts if bias is None else list(bias.detach().split(rows))

    @classmethod
    def of(cls, linear: nn.Linear, num_parts: int = 1) -> PackedLinear:
        return cls(linear.weight, linear.bias, packed_row_limit(linear.weight.dtype), num_parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] -> [num_tokens, out_features]."""
        if x.dim() == 2 and (self.max_packed_rows is None or x.shape[0] <= self.max_packed_rows):
            outputs = [torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
                       for packed, bias in zip(self.packed_parts, self.part_biases)]
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return F.linear(x, self.weight, self.bias)


def can_pack(model: nn.Module) -> bool:
    """Packing applies to the CPU, to float32 and (where oneDNN runs it natively) bfloat16 weights."""
    weight = next(model.parameters())
    return weight.device.type == "cpu" and can_pack_dtype(weight.dtype)


def pack_linears(model: nn.Module) -> int:
    """Swaps every ``nn.Linear`` inside ``model.layers`` for a PackedLinear (a fused ``gate_up_proj`` in
    two parts, see the module docstring); returns how many.

    The LM head stays as it is: with tied embeddings its weight is also the embedding table (the
    CPU kernels' decoder packs a copy of it for the logits; kvtool.cpu_kernels.decoder).
    """
    if not can_pack(model):
        return 0
    num_packed = 0
    for layer in model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, PackedLinear.of(child, 2 if name == "gate_up_proj" else 1))
                    num_packed += 1
    return num_packed
