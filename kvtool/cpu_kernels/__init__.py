"""kvtool's CPU kernels: fused RMSNorm (+ residual), SiLU-and-mul, RoPE + KV append, and paged
attention, in C++ (csrc/cpu), compiled for AVX-512, AVX2 and plain C++ and chosen at run time by
what the CPU runs. ``ops`` calls them on torch tensors; ``decoder.CpuDecoder`` runs a Llama-family
model's forward through them (the CPU path of kvtool.models.llama).
"""

from __future__ import annotations

from kvtool.cpu_kernels._kernels import AttentionPlan, CpuKernels, DType, supported_isas

__all__ = ["AttentionPlan", "CpuKernels", "DType", "supported_isas"]
