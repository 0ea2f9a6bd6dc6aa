"""NVRTC (the CUDA runtime compiler) through ctypes: compiles a .cu source to a cubin in-process.

Used when no ``nvcc`` is installed (a GPU machine with only the pip CUDA libraries that torch and
CuPy bring). The library is found in, in order: ``$KVTOOL_NVRTC_LIB``, ``$CUDA_HOME/lib64``, the
``nvidia-cuda-nvrtc`` wheels in ``sys.path`` (``nvidia/cu13/lib``, ``nvidia/cuda_nvrtc/lib``), then
the dynamic loader's search path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
from dataclasses import dataclass

_NVRTC_SUCCESS = 0


class NvrtcError(RuntimeError):
    """NVRTC could not be loaded or refused a source; the message carries its log."""


def nvrtc_library_candidates() -> list[str]:
    """Paths (or loader names) of libnvrtc to try, most specific first."""
    candidates: list[str] = []
    explicit = os.environ.get("KVTOOL_NVRTC_LIB")
    if explicit:
        candidates.append(explicit)
    for env in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(env)
        if root:
            candidates += sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*")), reverse=True)
    candidates += sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"), reverse=True)
    for entry in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"):
            candidates += sorted(glob.glob(os.path.join(entry, sub, "libnvrtc.so*")), reverse=True)
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(found)
    # The .alt variant is a second copy for static-linking setups; libnvrtc-builtins is not NVRTC.
    return [c for c in dict.fromkeys(candidates) if ".alt." not in c and "builtins" not in c]


@dataclass(frozen=True)
class NvrtcVersion:
    major: int
    minor: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"


class Nvrtc:
    """One loaded libnvrtc. ``compile_cubin`` returns the cubin bytes for a real ``sm_XX`` arch."""

    def __init__(self, library_path: str) -> None:
        _preload_builtins(library_path)
        try:
            self._lib = ctypes.CDLL(library_path)
        except OSError as error:
            raise NvrtcError(f"cannot load NVRTC from {library_path}: {error}") from None
        self.library_path = library_path
        lib = self._lib
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
        lib.nvrtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p,
                                           ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcGetProgramLogSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetProgramLog.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nvrtcGetCUBINSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetCUBIN.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = NvrtcVersion(major.value, minor.value)

    def _check(self, status: int, what: str) -> None:
        if status != _NVRTC_SUCCESS:
            message = self._lib.nvrtcGetErrorString(status).decode(errors="replace")
            raise NvrtcError(f"{what} failed: {message}")

    def compile_cubin(self, source: str, name: str, options: list[str]) -> bytes:
        """Compiles ``source`` (named ``name`` in diagnostics) with NVRTC ``options``."""
        program = ctypes.c_void_p()
        self._check(self._lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0,
                                                 None, None), "nvrtcCreateProgram")
        try:
            encoded = [option.encode() for option in options]
            argv = (ctypes.c_char_p * len(encoded))(*encoded)
            status = self._lib.nvrtcCompileProgram(program, len(encoded), argv)
            log = self._log(program)
            if status != _NVRTC_SUCCESS:
                message = self._lib.nvrtcGetErrorString(status).decode(errors="replace")
                raise NvrtcError(f"NVRTC {self.version} failed to compile {name} ({message}):\n{log}")
            size = ctypes.c_size_t()
            self._check(self._lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
            if size.value == 0:
                raise NvrtcError(f"NVRTC produced no cubin for {name}: pass a real architecture (sm_XX)")
            buffer = ctypes.create_string_buffer(size.value)
            self._check(self._lib.nvrtcGetCUBIN(program, buffer), "nvrtcGetCUBIN")
            return buffer.raw
        finally:
            self._lib.nvrtcDestroyProgram(ctypes.byref(program))

    def _log(self, program: ctypes.c_void_p) -> str:
        size = ctypes.c_size_t()
        if self._lib.nvrtcGetProgramLogSize(program, ctypes.byref(size)) != _NVRTC_SUCCESS or size.value <= 1:
            return ""
        buffer = ctypes.create_string_buffer(size.value)
        self._lib.nvrtcGetProgramLog(program, buffer)
        return buffer.value.decode(errors="replace")


def _preload_builtins(library_path: str) -> None:
    """NVRTC dlopen()s libnvrtc-builtins by name at compile time; a wheel's lib directory is on no
    search path, so load the builtins beside the library first (dlopen then finds them loaded)."""
    directory = os.path.dirname(library_path)
    if not directory:
        return
    for builtins in sorted(glob.glob(os.path.join(directory, "libnvrtc-builtins.so*"))):
        if ".alt." in builtins:
            continue
        try:
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass  # NVRTC reports a missing builtins library itself, with a clearer message


def load_nvrtc() -> Nvrtc:
    """The first NVRTC library that loads; NvrtcError listing every attempt when none does."""
    failures = []
    for candidate in nvrtc_library_candidates():
        try:
            return Nvrtc(candidate)
        except NvrtcError as error:
            failures.append(str(error))
    tried = "; ".join(failures) if failures else "no libnvrtc found"
    raise NvrtcError(f"NVRTC is not available ({tried}): install the CUDA toolkit, or the "
                     "nvidia-cuda-nvrtc wheel, or set KVTOOL_NVRTC_LIB to libnvrtc.so's path")


def is_cubin(data: bytes) -> bool:
    """True for an ELF image (what nvcc -cubin and nvrtcGetCUBIN produce)."""
    return data[:4] == b"\x7fELF"


__all__ = ["Nvrtc", "NvrtcError", "NvrtcVersion", "load_nvrtc", "nvrtc_library_candidates", "is_cubin"]
