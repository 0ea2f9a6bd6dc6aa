"""kvtool's CUDA kernels: compilation (nvcc or NVRTC, cached per specialization), loading and
launching through CuPy, and one thin launcher per kernel in csrc/kernels.

* :mod:`kvtool.kernels.compiler` - :class:`KernelSpec`, :class:`KernelCompiler` (no GPU needed)
* :mod:`kvtool.kernels.loader` - :class:`KernelLibrary` (CuPy modules), ``launch``
* :mod:`kvtool.kernels.kv_append` - ``append_kv``
* :mod:`kvtool.kernels.paged_context_attention` - ``paged_context_attention``
* :mod:`kvtool.kernels.paged_decode_attention` - ``paged_decode_attention``
* :mod:`kvtool.kernels.rope_append` - ``rope_append`` (q/k norms, RoPE and the KV append)
* :mod:`kvtool.kernels.add_rms_norm` - ``add_rms_norm`` (residual add + RMSNorm)
* :mod:`kvtool.kernels.silu_mul` - ``silu_mul``
* :mod:`kvtool.kernels.block_copy` - ``copy_blocks``, ``prepare_dma_copy`` (copy engines), ``prepare_block_copy``

The attention backend built on them is :class:`kvtool.layers.cuda_attention.CudaPagedAttention`.
"""

from kvtool.kernels.compiler import (
    CompiledKernel,
    KernelCompileError,
    KernelCompiler,
    KernelSpec,
    KernelToolchainError,
)

__all__ = ["CompiledKernel", "KernelCompileError", "KernelCompiler", "KernelSpec", "KernelToolchainError"]
