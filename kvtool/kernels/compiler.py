"""Compiles each CUDA kernel specialization once and caches the cubin on disk.

A specialization is a source file under ``csrc/kernels`` plus ``-D`` defines (head_dim,
tokens_per_block, dtype, ...) plus a real GPU architecture (``sm_90``). Its cubin is cached under
``<cache_dir>/<compiler identity>/<kernel>-<hash>.cubin`` where the hash covers the source, every
shared header, the defines, the architecture and the compiler, so an edited kernel or another
compiler never reuses a stale binary. The default cache is ``~/.cache/kvtool/kernels``
(``$KVTOOL_KERNEL_CACHE`` overrides it; a plan passes its own ``kernels/`` directory).

Two compiler backends, tried in this order: ``nvcc -cubin`` when a CUDA toolkit is installed,
then NVRTC in-process (:mod:`kvtool.kernels.nvrtc`). ``$KVTOOL_KERNEL_COMPILER=nvcc|nvrtc`` pins
one. Nothing here needs a GPU, CuPy or torch: compiling works on a build machine.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from kvtool.errors import KvtoolError
from kvtool.kernels.nvrtc import Nvrtc, NvrtcError, is_cubin, load_nvrtc

# Bump when the flags below change meaning: part of every cache key.
_FLAGS_VERSION = "1"
_ARCH_PATTERN = re.compile(r"^sm_\d{2,3}a?$")
_DEFINE_PATTERN = re.compile(r"^[A-Z][A-Z0-9_]*$")


class KernelToolchainError(KvtoolError, ImportError):
    """No CUDA compiler (nvcc or NVRTC) or no CuPy on this machine; the message says what to install.

    An ImportError too, so a caller that picks the CUDA backend when it imports (and falls back to
    the torch backend on ImportError) also falls back when the toolchain is missing."""


class KernelCompileError(RuntimeError):
    """A compiler rejected a kernel source: a bug in kvtool's kernels, reported with the compiler log."""


def default_source_dir() -> Path:
    """``csrc/kernels`` of the source tree this package is installed from (editable install)."""
    override = os.environ.get("KVTOOL_KERNEL_SOURCE_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2] / "csrc" / "kernels"


def default_cache_dir() -> Path:
    override = os.environ.get("KVTOOL_KERNEL_CACHE")
    if override:
        return Path(override)
    return Path.home() / ".cache" / "kvtool" / "kernels"


@dataclass(frozen=True)
class KernelSpec:
    """One specialization: ``source`` (a file in csrc/kernels), ``arch`` (``sm_90``) and defines."""

    source: str
    arch: str
    defines: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.source.endswith(".cu") or "/" in self.source:
            raise ValueError(f"KernelSpec.source must be a .cu file name in csrc/kernels, got {self.source!r}")
        if not _ARCH_PATTERN.match(self.arch):
            raise ValueError(f"KernelSpec.arch must be a real architecture like 'sm_90', got {self.arch!r}")
        for name, value in self.defines:
            if not _DEFINE_PATTERN.match(name) or not isinstance(value, int):
                raise ValueError(f"KernelSpec define {name}={value!r} must be an UPPER_CASE name with an int value")
        if list(self.defines) != sorted(self.defines):
            raise ValueError("KernelSpec.defines must be sorted by name: build specs with KernelSpec.create()")

    @classmethod
    def create(cls, source: str, arch: str, **defines: int) -> "KernelSpec":
        return cls(source, arch, tuple(sorted((name, int(value)) for name, value in defines.items())))

    @property
    def stem(self) -> str:
        return self.source[: -len(".cu")]

    @property
    def label(self) -> str:
        """Readable name, e.g. ``paged_decode_attention[KVT_HEAD_DIM=128,...]@sm_90``."""
        defines = ",".join(f"{name}={value}" for name, value in self.defines)
        return f"{self.stem}[{defines}]@{self.arch}"


class CompilerBackend(Protocol):
    """Turns a specialization into cubin bytes."""

    name: str      # "nvcc" or "nvrtc"
    identity: str  # names the exact compiler version, e.g. "nvcc-13.0.88"; part of the cache key

    def compile(self, spec: KernelSpec, source_dir: Path) -> bytes: ...


def _define_flags(spec: KernelSpec) -> list[str]:
    return [f"-D{name}={value}" for name, value in spec.defines]


class NvccBackend:
    """``nvcc -cubin -arch=sm_XX``: a CUDA toolkit's compiler."""

    name = "nvcc"

    def __init__(self, nvcc_path: str) -> None:
        self.nvcc_path = nvcc_path
        try:
            banner = subprocess.run([nvcc_path, "--version"], capture_output=True, text=True, timeout=60,
                                    check=True).stdout
        except (OSError, subprocess.SubprocessError) as error:
            raise KernelToolchainError(f"nvcc at {nvcc_path} does not run: {error}") from None
        match = re.search(r"V(\d+\.\d+\.\d+)", banner)
        self.version = match.group(1) if match else "unknown"
        self.identity = f"nvcc-{self.version}"

    def command(self, spec: KernelSpec, source_dir: Path, output: Path) -> list[str]:
        return [self.nvcc_path, "-cubin", f"-arch={spec.arch}", "-O3", "-std=c++17", "-lineinfo",
                f"-I{source_dir}", *_define_flags(spec), "-o", str(output), str(source_dir / spec.source)]

    def compile(self, spec: KernelSpec, source_dir: Path) -> bytes:
        with tempfile.TemporaryDirectory(prefix="kvtool-nvcc-") as tmp:
            output = Path(tmp) / f"{spec.stem}.cubin"
            result = subprocess.run(self.command(spec, source_dir, output), capture_output=True, text=True)
            if result.returncode != 0:
                raise KernelCompileError(f"nvcc {self.version} failed to compile {spec.label}:\n"
                                         f"{result.stderr}{result.stdout}")
            return output.read_bytes()


class NvrtcBackend:
    """NVRTC through ctypes (no toolkit needed, only libnvrtc)."""

    name = "nvrtc"

    def __init__(self, nvrtc: Nvrtc) -> None:
        self.nvrtc = nvrtc
        self.identity = f"nvrtc-{nvrtc.version}"

    def options(self, spec: KernelSpec, source_dir: Path) -> list[str]:
        return [f"--gpu-architecture={spec.arch}", "-std=c++17", "-lineinfo", f"-I{source_dir}",
                *_define_flags(spec)]

    def compile(self, spec: KernelSpec, source_dir: Path) -> bytes:
        source = (source_dir / spec.source).read_text()
        try:
            return self.nvrtc.compile_cubin(source, spec.source, self.options(spec, source_dir))
        except NvrtcError as error:
            raise KernelCompileError(f"{spec.label}: {error}") from None


def find_nvcc() -> str | None:
    """``$KVTOOL_NVCC``, ``$CUDA_HOME/bin/nvcc``, ``nvcc`` on PATH, ``/usr/local/cuda/bin/nvcc``."""
    candidates = [os.environ.get("KVTOOL_NVCC")]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(env)
        if root:
            candidates.append(os.path.join(root, "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def discover_backends() -> list[CompilerBackend]:
    """Every usable backend, nvcc first; ``$KVTOOL_KERNEL_COMPILER`` restricts to one."""
    wanted = os.environ.get("KVTOOL_KERNEL_COMPILER", "").strip().lower()
    if wanted not in ("", "nvcc", "nvrtc"):
        raise KernelToolchainError(f"KVTOOL_KERNEL_COMPILER={wanted!r} is unknown: use 'nvcc' or 'nvrtc'")
    backends: list[CompilerBackend] = []
    problems: list[str] = []
    if wanted in ("", "nvcc"):
        nvcc = find_nvcc()
        if nvcc:
            backends.append(NvccBackend(nvcc))
        else:
            problems.append("no nvcc (set CUDA_HOME or put nvcc on PATH)")
    if wanted in ("", "nvrtc"):
        try:
            backends.append(NvrtcBackend(load_nvrtc()))
        except NvrtcError as error:
            problems.append(str(error))
    if not backends:
        raise KernelToolchainError("no CUDA compiler for kvtool's kernels: " + "; ".join(problems))
    return backends


@dataclass(frozen=True)
class CompiledKernel:
    """A specialization's cubin on disk."""

    spec: KernelSpec
    cubin_path: Path
    compiler: str  # the backend identity that produced it
    from_cache: bool


class KernelCompiler:
    """Compiles specializations once per (source, defines, arch, compiler) and caches the cubins.

    Safe to call from several threads (each compile writes its own temporary file and renames it).
    """

    def __init__(self, cache_dir: str | Path | None = None, source_dir: str | Path | None = None,
                 backends: Sequence[CompilerBackend] | None = None) -> None:
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.source_dir = Path(source_dir) if source_dir is not None else default_source_dir()
        self._backends = list(backends) if backends is not None else None
        if not (self.source_dir / "common.cuh").is_file():
            raise KernelToolchainError(
                f"kvtool's CUDA sources are not at {self.source_dir}: install kvtool from its source tree "
                "(pip install -e .) or set KVTOOL_KERNEL_SOURCE_DIR to its csrc/kernels directory")

    @property
    def backends(self) -> list[CompilerBackend]:
        if self._backends is None:
            self._backends = discover_backends()
        return self._backends

    def cache_key(self, spec: KernelSpec, backend: CompilerBackend) -> str:
        digest = hashlib.sha256()
        digest.update(f"flags={_FLAGS_VERSION};compiler={backend.identity};{spec.label}\n".encode())
        # The kernel plus every shared header: an edit to any of them invalidates the cubin.
        for path in [self.source_dir / spec.source, *sorted(self.source_dir.glob("*.cuh"))]:
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        return digest.hexdigest()

    def cubin_path(self, spec: KernelSpec, backend: CompilerBackend) -> Path:
        return self.cache_dir / backend.identity / f"{spec.stem}-{self.cache_key(spec, backend)[:20]}.cubin"

    def compile(self, spec: KernelSpec, backend: CompilerBackend | None = None) -> CompiledKernel:
        """The cubin of ``spec`` from ``backend`` (default: the first available), compiling on a miss."""
        backend = backend if backend is not None else self.backends[0]
        if not (self.source_dir / spec.source).is_file():
            raise ValueError(f"kernel source {spec.source} is not in {self.source_dir}")
        path = self.cubin_path(spec, backend)
        if path.is_file() and is_cubin(path.read_bytes()[:4]):
            return CompiledKernel(spec, path, backend.identity, from_cache=True)
        cubin = backend.compile(spec, self.source_dir)
        if not is_cubin(cubin):
            raise KernelCompileError(f"{backend.identity} returned something that is not a cubin for {spec.label}")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(cubin)
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the whole new file
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return CompiledKernel(spec, path, backend.identity, from_cache=False)
