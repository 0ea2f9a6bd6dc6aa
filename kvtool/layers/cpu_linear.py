"""Projections on the CPU: torch's oneDNN product on a weight packed once at load.

torch's ``F.linear`` runs MKL on the CPU for float32. oneDNN with the weight reordered once into
its blocked layout is faster for the row counts of a decode step or a short chunk everywhere, and
on AVX-512 for every row count: there MKL (on an AMD EPYC it takes its AVX2 code) reached 100
GFLOP/s per core on a 1,056-row prefill and oneDNN 230 (``python bench/cpu_gemm.py``;
results/cpu_profile.md). On an AVX2-only CPU the two were level from 512 rows on, so products
above MAX_PACKED_ROWS_AVX2 rows stay on MKL there. bfloat16 products always take oneDNN (MKL has
none). The packed copy costs the weight's bytes once more. MKL's own packed sgemm, on an Intel
Xeon, took a 1,053-token float32 miss step in 0.94-1.00x oneDNN's time but a 32-token hit in
1.01-1.03x, so it would need a second packed copy to gain both (results/cpu_float32_products.md).
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
    ``max_packed_rows`` rows, all when None; larger ones on ``F.linear``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_packed_rows: int | None) -> None:
        super().__init__()
        self.weight = weight  # [out_features, in_features]
        self.bias = bias
        self.max_packed_rows = max_packed_rows
        # An opaque oneDNN tensor in a blocked layout: not a parameter, never saved or moved.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def drop_packed_weight(self) -> None:
        """Frees the packed copy (another packed copy runs the products: the CPU kernels' tile products);
        forward then runs ``F.linear``."""
        self.packed_weight = None

    @classmethod
    def of(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias, packed_row_limit(linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] -> [num_tokens, out_features]."""
        if x.dim() == 2 and self.packed_weight is not None and (self.max_packed_rows is None
                                                                 or x.shape[0] <= self.max_packed_rows):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def can_pack(model: nn.Module) -> bool:
    """Packing applies to the CPU, to float32 and (where oneDNN runs it natively) bfloat16 weights."""
    weight = next(model.parameters())
    return weight.device.type == "cpu" and can_pack_dtype(weight.dtype)


def unpacked_bfloat16_note(model: nn.Module) -> str | None:
    """What a user should know when ``model`` holds bfloat16 weights on a CPU whose oneDNN has no native
    bfloat16 product (no AVX512-BF16 or AMX: an AVX2-only CPU): its prompts run on kvtool's row
    product (torch's emulated bfloat16 products take 2-2.5x its time; kvtool.cpu_kernels.decoder), and
    a 1,053-token miss of SmolLM2-135M took 3.1 s where float32 on a packed weight took 1.6 (AVX2 code
    on the AMD EPYC VM). None when that does not apply."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or can_pack_dtype(torch.bfloat16):
        return None
    return ("oneDNN has no native bfloat16 products on this CPU (they need AVX512-BF16 or AMX): a bfloat16 plan's "
            "prompts take about twice float32's time here; rebuild the plan with --dtype float32 for faster "
            "prompts (decode steps, which read the weights once, gain from bfloat16's half the bytes)")


def pack_linears(model: nn.Module) -> int:
    """Swaps every ``nn.Linear`` inside ``model.layers`` for a PackedLinear; returns how many.

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
                    setattr(parent, name, PackedLinear.of(child))
                    num_packed += 1
    return num_packed
