"""Loads compiled kernels into CUDA through CuPy and launches them on torch's current stream.

torch owns every tensor; CuPy is only the loader and launcher: a cubin becomes a
``cupy.RawModule``, kernels get raw pointers (``tensor.data_ptr()``) and run on
``torch.cuda.current_stream()`` (handed to CuPy through the CUDA stream protocol,
``cupy.cuda.Stream.from_external``), so they order with torch's own work without any
synchronization, and a CUDA graph capturing torch's stream captures them too.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Sequence

import numpy as np
import torch

from kvtool.kernels.compiler import KernelCompileError, KernelCompiler, KernelSpec, KernelToolchainError


def device_arch(device: torch.device | int | None = None) -> str:
    """``sm_XY`` of a CUDA device (``sm_90`` on H100/H200)."""
    index = device.index if isinstance(device, torch.device) else device
    return _arch_of(torch.cuda.current_device() if index is None else index)


@functools.lru_cache(maxsize=None)  # a device's capability never changes; asked per layer per step
def _arch_of(device_index: int) -> str:
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def device_sm_count(device: torch.device | int | None = None) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H100 SXM / H200)."""
    index = device.index if isinstance(device, torch.device) else device
    return _sm_count_of(torch.cuda.current_device() if index is None else index)


@functools.lru_cache(maxsize=None)
def _sm_count_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def require_cupy() -> None:
    """Raises KernelToolchainError (an ImportError) when CuPy is not installed."""
    _import_cupy()


def _import_cupy():
    try:
        import cupy  # noqa: PLC0415 - optional dependency, only needed on a GPU
    except ImportError as error:
        raise KernelToolchainError(
            f"CuPy is needed to load kvtool's CUDA kernels ({error}): pip install cupy-cuda12x or cupy-cuda13x, "
            "matching the CUDA version of torch") from None
    return cupy


class KernelLibrary:
    """Kernels by (specialization, name, device), each compiled and loaded at most once.

    If a cubin fails to load (e.g. nvcc is newer than the driver), the next compiler backend is
    tried (NVRTC shipped with torch / CuPy usually matches the driver).
    """

    def __init__(self, compiler: KernelCompiler | None = None) -> None:
        self.compiler = compiler if compiler is not None else KernelCompiler()
        self._modules: dict[tuple[KernelSpec, int], Any] = {}
        self._kernels: dict[tuple[KernelSpec, str, int], Any] = {}
        self._smem_limits: dict[tuple[KernelSpec, str, int], int] = {}
        self._lock = threading.Lock()

    def kernel(self, spec: KernelSpec, name: str, device_index: int, *, dynamic_smem_bytes: int = 0):
        """The ``cupy.RawKernel`` ``name`` of ``spec`` on ``device_index``; allows
        ``dynamic_smem_bytes`` of dynamic shared memory (above the 48 KiB default when asked)."""
        key = (spec, name, device_index)
        with self._lock:
            kernel = self._kernels.get(key)
            if kernel is None:
                kernel = self._load_kernel(spec, name, device_index)
                self._kernels[key] = kernel
            if dynamic_smem_bytes > max(48 * 1024, self._smem_limits.get(key, 0)):
                # Above 48 KiB a kernel must opt in (cudaFuncAttributeMaxDynamicSharedMemorySize).
                cupy = _import_cupy()
                with cupy.cuda.Device(device_index):
                    kernel.max_dynamic_shared_size_bytes = dynamic_smem_bytes
                self._smem_limits[key] = dynamic_smem_bytes
            return kernel

    def _load_kernel(self, spec: KernelSpec, name: str, device_index: int):
        cupy = _import_cupy()
        module = self._modules.get((spec, device_index))
        if module is not None:
            with cupy.cuda.Device(device_index):
                return module.get_function(name)
        failures = []
        for backend in self.compiler.backends:
            try:
                compiled = self.compiler.compile(spec, backend)
            except KernelCompileError as error:
                failures.append(f"{backend.identity}: {error}")
                continue
            try:
                with cupy.cuda.Device(device_index):
                    module = cupy.RawModule(path=str(compiled.cubin_path))
                    kernel = module.get_function(name)  # the module is loaded into the context here
            except Exception as error:  # noqa: BLE001 - CuPy's driver errors vary by version
                failures.append(f"{backend.identity}: loading {compiled.cubin_path} failed: {error}")
                continue
            self._modules[(spec, device_index)] = module
            return kernel
        raise KernelToolchainError(f"could not build or load {spec.label}:\n  " + "\n  ".join(failures))


def launch(kernel, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], *, device_index: int,
           shared_mem: int = 0) -> None:
    """Launches on torch's current stream of ``device_index``; returns without waiting."""
    cupy = _import_cupy()
    with cupy.cuda.Device(device_index):
        stream = cupy_stream(torch.cuda.current_stream(device_index))
        kernel(tuple(int(g) for g in grid), tuple(int(b) for b in block), tuple(args), shared_mem=int(shared_mem),
               stream=stream)


def cupy_stream(stream: torch.cuda.Stream):
    """A torch stream as CuPy's (call with its device current). CuPy 14 deprecates ExternalStream for
    ``Stream.from_external`` (the CUDA stream protocol, ``__cuda_stream__``, which torch implements);
    older CuPy has only ExternalStream."""
    cupy = _import_cupy()
    if hasattr(cupy.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
        return cupy.cuda.Stream.from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream, stream.device_index)


# ---- kernel argument helpers: the kernels' C types, spelled as NumPy scalars for CuPy ----

def ptr(tensor: torch.Tensor | None) -> np.uint64:
    """Device address of a tensor (0 for None)."""
    return np.uint64(0 if tensor is None else tensor.data_ptr())


def i32(value: int) -> np.int32:
    return np.int32(value)


def i64(value: int) -> np.int64:
    return np.int64(value)


def f32(value: float) -> np.float32:
    return np.float32(value)
