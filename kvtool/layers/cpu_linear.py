"""Projections on the CPU: small products through oneDNN, with the weight packed once at load.

torch's ``F.linear`` runs MKL on the CPU. For the row counts of a decode step or of a short chunk
after a cached prefix, MKL's two-thread product is slow; oneDNN with the weight reordered once
into its blocked layout is about 1.5x faster there, while for a 1,000-row prefill MKL is level or
ahead (``python bench/cpu_gemm.py``; results/cpu_profile.md). So each projection keeps both, and
the packed copy costs the projections' weight bytes once more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Products of at most this many rows use the packed weight: on the 2-core AVX2 VM oneDNN led by
# 1.5x at 32-128 rows and 1.2x at 256, and the two were level from 512 rows on.
MAX_PACKED_ROWS = 256


class PackedLinear(nn.Module):
    """``nn.Linear`` whose products of up to MAX_PACKED_ROWS rows run on a oneDNN-packed copy of
    its weight (float32, CPU)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight  # [out_features, in_features]
        self.bias = linear.bias
        # An opaque oneDNN tensor in a blocked layout: not a parameter, never saved or moved.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] -> [num_tokens, out_features]."""
        if x.dim() == 2 and x.shape[0] <= MAX_PACKED_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def can_pack(model: nn.Module) -> bool:
    """Packing applies to float32 weights on the CPU, where torch was built with oneDNN."""
    weight = next(model.parameters())
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_linears(model: nn.Module) -> int:
    """Swaps every ``nn.Linear`` inside ``model.layers`` for a PackedLinear; returns how many.

    The LM head stays as it is: it runs on one row per sampled token, and with tied embeddings its
    weight is also the embedding table.
    """
    if not can_pack(model):
        return 0
    num_packed = 0
    for layer in model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, PackedLinear(child))
                    num_packed += 1
    return num_packed
