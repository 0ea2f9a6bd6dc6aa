"""kvtool's CPU kernels: fused RMSNorm (+ residual), SiLU-and-mul, RoPE + KV append, and paged
attention, in C++ (csrc/cpu), compiled for AVX-512 (with and without AVX512-BF16), AVX2 and plain
C++ and chosen at run time by what the CPU runs. ``ops`` calls them on torch tensors;
``decoder.CpuDecoder`` runs a Llama-family model's forward through them (the CPU path of
kvtool.models.llama).
"""

from __future__ import annotations

# torch first: its OpenMP runtime (libgomp.so.1) is then the one the kernels link to, so they run
# on torch's threads (csrc/cpu/parallel.h).
import torch  # noqa: F401

from kvtool.cpu_kernels._kernels import AttentionPlan, CpuKernels, DType, supported_isas

__all__ = ["AttentionPlan", "CpuKernels", "DType", "supported_isas"]
