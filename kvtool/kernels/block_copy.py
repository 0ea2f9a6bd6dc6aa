"""Moves whole KV block slabs between the device pool and the pinned host pool.

A pool is either one block-major tensor ``[num_blocks, num_layers, 2, tpb, kvh, hd]`` (the primary
pool), a list of such chunk tensors whose block id ``b`` lives in chunk ``b // len(chunks[0])`` at
index ``b % len(chunks[0])`` (the lazily grown host pool), or any object with ``block(block_id)``
returning that block's ``[num_layers, 2, tpb, kvh, hd]`` view (``kvtool.runtime.kv_pool.HostBlockPool``).

Two interchangeable methods, both asynchronous on the given stream:
  * ``"memcpy"`` (what the runtime uses): the copy engines (DMA), one ``cudaMemcpyAsync`` per run of
    blocks that are back to back on both sides, or for a byte range of every block (one layer's
    slice) one ``cudaMemcpy2DAsync`` per run (rows of that range, the block size apart).
    ``prepare_dma_copy`` resolves a list's runs once. The SMs stay free for the forward, and the two
    directions move at once on two streams (97.6 GB/s together on an H200 where the kernel gave 52.8).
  * ``"kernel"``: one launch of csrc/kernels/block_copy.cu for the whole list; the GPU reads/writes
    pinned host memory directly through its mapped (UVA) address. One launch per call, however
    scattered the ids. ``prepare_block_copy`` uploads a list's address tables once and launches it for
    any byte range of every block.
bench/gpu_suite.py measures both against the plain pinned-copy bandwidth.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, NamedTuple, Sequence

import numpy as np
import torch

from kvtool.kernels.compiler import KernelSpec
from kvtool.kernels.loader import KernelLibrary, device_arch, i64, launch, ptr

SOURCE = "block_copy.cu"
KERNEL = "kvt_block_copy"
NUM_THREADS = 256
BYTES_PER_CTA = 64 * 1024

CopyMethod = Literal["kernel", "memcpy"]


@functools.lru_cache(maxsize=None)  # pure; called per layer per step
def block_copy_spec(arch: str) -> KernelSpec:
    return KernelSpec.create(SOURCE, arch)


class CopyRun(NamedTuple):
    """``count`` consecutive blocks from ``src_start`` to ``dst_start``."""

    src_start: int
    dst_start: int
    count: int


def coalesce_runs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[CopyRun]:
    """Groups copy ops whose source and destination ids both continue the previous op's."""
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"src_block_ids ({len(src_block_ids)}) and dst_block_ids ({len(dst_block_ids)}) "
                         "must have the same length")
    runs: list[CopyRun] = []
    for src, dst in zip(src_block_ids, dst_block_ids):
        src, dst = int(src), int(dst)
        if runs and runs[-1].src_start + runs[-1].count == src and runs[-1].dst_start + runs[-1].count == dst:
            last = runs[-1]
            runs[-1] = CopyRun(last.src_start, last.dst_start, last.count + 1)
        else:
            runs.append(CopyRun(src, dst, 1))
    return runs


@dataclass
class _Pool:
    """Uniform view of the three pool forms."""

    tensor: torch.Tensor | None = None            # one block-major tensor
    chunks: Sequence[torch.Tensor] | None = None  # equal-size chunks (the last may be shorter)
    holder: Any = None                            # object with block(block_id)

    @classmethod
    def of(cls, pool: Any, name: str) -> "_Pool":
        if isinstance(pool, torch.Tensor):
            return cls(tensor=pool)
        if isinstance(pool, (list, tuple)):
            if not pool or not all(isinstance(c, torch.Tensor) for c in pool):
                raise ValueError(f"{name} as a list must hold the chunk tensors of a block pool")
            return cls(chunks=pool)
        if hasattr(pool, "block"):
            return cls(holder=pool)
        raise ValueError(f"{name} must be a tensor, a list of chunk tensors, or have block(block_id); got {type(pool)}")

    def block(self, block_id: int) -> torch.Tensor:
        if block_id < 0:
            raise ValueError(f"block id {block_id} is negative")
        if self.tensor is not None:
            if block_id >= self.tensor.shape[0]:
                raise ValueError(f"block id {block_id} is out of range for a pool of {self.tensor.shape[0]} blocks")
            return self.tensor[block_id]
        if self.chunks is not None:
            chunk, index = divmod(block_id, self.chunks[0].shape[0])
            if chunk >= len(self.chunks) or index >= self.chunks[chunk].shape[0]:
                raise ValueError(f"block id {block_id} is out of range for the chunked pool")
            return self.chunks[chunk][index]
        return self.holder.block(block_id)

    def block_addresses(self, block_ids: Sequence[int], bytes_per_block: int, name: str,
                        address: Callable[[torch.Tensor, str], int] | None = None) -> np.ndarray:
        """Device-usable addresses of the blocks [len(block_ids)] int64, one lookup per chunk.

        Blocks of one tensor (or chunk) are ``bytes_per_block`` apart, so a block's address is
        its tensor's mapped base plus an offset: no per-block tensor views or driver calls.
        ``address`` gives a tensor's base address (default: what a kernel uses, ``_device_address``).
        """
        address = address or _device_address
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size and ids.min() < 0:
            raise ValueError(f"{name}: block id {int(ids.min())} is negative")
        if self.holder is not None and not hasattr(self.holder, "chunk"):
            return np.array([address(self.holder.block(int(b)), name) for b in ids], dtype=np.int64)
        if self.tensor is not None:
            chunk_of, index = np.zeros_like(ids), ids
        else:
            per_chunk = self.chunks[0].shape[0] if self.chunks is not None else self.holder.blocks_per_chunk
            chunk_of, index = np.divmod(ids, per_chunk)
        addresses = np.empty_like(ids)
        for chunk_index in np.unique(chunk_of).tolist():
            chunk = self._chunk(chunk_index, name)
            selected = chunk_of == chunk_index
            if index[selected].max() >= chunk.shape[0]:
                raise ValueError(f"{name}: block id {int(ids[selected][index[selected].argmax()])} is out of range")
            if _block_bytes(chunk[0], name) != bytes_per_block or chunk.stride(0) * chunk.element_size() != bytes_per_block:
                raise ValueError(f"{name} blocks must be contiguous {bytes_per_block}-byte slabs, back to back")
            addresses[selected] = address(chunk, name) + index[selected] * bytes_per_block
        return addresses

    def chunk_of(self, block_ids: Sequence[int]) -> np.ndarray:
        """[len(block_ids)] int64: the allocation each block lives in (its chunk; each block its own for a
        holder without chunks)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if self.tensor is not None:
            return np.zeros_like(ids)
        if self.chunks is not None:
            return ids // self.chunks[0].shape[0]
        if hasattr(self.holder, "chunk"):
            return ids // self.holder.blocks_per_chunk
        return ids

    def _chunk(self, chunk_index: int, name: str) -> torch.Tensor:
        """[blocks, ...] tensor holding chunk ``chunk_index`` (the whole pool for one tensor)."""
        if self.tensor is not None:
            return self.tensor
        if self.chunks is not None:
            if chunk_index >= len(self.chunks):
                raise ValueError(f"{name}: block ids reach chunk {chunk_index} of a pool of {len(self.chunks)} chunks")
            return self.chunks[chunk_index]
        return self.holder.chunk(chunk_index)

    @property
    def device(self) -> torch.device:
        if self.tensor is not None:
            return self.tensor.device
        if self.chunks is not None:
            return self.chunks[0].device
        return self.holder.block(0).device


def _block_bytes(block: torch.Tensor, name: str) -> int:
    if not block.is_contiguous():
        raise ValueError(f"{name} blocks must be contiguous slabs [num_layers, 2, tpb, kvh, hd]")
    return block.numel() * block.element_size()


def _device_address(tensor: torch.Tensor, name: str) -> int:
    """The address a kernel uses for this tensor: device memory as is, pinned host memory mapped."""
    if tensor.is_cuda:
        return tensor.data_ptr()
    if not tensor.is_pinned():
        raise ValueError(f"{name} is in pageable host memory, which a kernel cannot read: pin it "
                         "(torch.empty(..., pin_memory=True)) or use method='memcpy'")
    return _mapped_host_address(tensor.data_ptr())


def _mapped_host_address(host_address: int) -> int:
    # With unified addressing (every 64-bit CUDA platform) pinned host memory has the same address
    # on the device; ask the driver anyway so a registered (cudaHostRegister) buffer also works.
    try:
        import cupy  # noqa: PLC0415

        attributes = cupy.cuda.runtime.pointerGetAttributes(host_address)
        device_pointer = int(getattr(attributes, "devicePointer", 0) or 0)
        return device_pointer or host_address
    except Exception:  # noqa: BLE001 - old CuPy without the call: UVA address
        return host_address


def copy_blocks(src_pool: Any, dst_pool: Any, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                stream: torch.cuda.Stream | None = None, *, method: CopyMethod = "memcpy",
                library: KernelLibrary | None = None) -> None:
    """Copies block ``src_block_ids[i]`` of ``src_pool`` to block ``dst_block_ids[i]`` of ``dst_pool``.

    Asynchronous on ``stream`` (default: the current stream); the caller orders it against the
    compute stream (wait_stream / events) and keeps host buffers alive until it completes.
    """
    if method not in ("kernel", "memcpy"):
        raise ValueError(f"method must be 'kernel' or 'memcpy', got {method!r}")
    runs = coalesce_runs(src_block_ids, dst_block_ids)
    if not runs:
        return
    src, dst, device, bytes_per_block = _resolve_pools(src_pool, dst_pool, runs[0].src_start, runs[0].dst_start)
    stream = stream if stream is not None else torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        if method == "memcpy":
            _dma_copy(src, dst, src_block_ids, dst_block_ids, device, bytes_per_block).launch()
        else:
            _upload(src, dst, src_block_ids, dst_block_ids, device, bytes_per_block, library).launch()


def _check_byte_range(byte_offset: int, num_bytes: int | None, bytes_per_block: int, multiple: int) -> int:
    """num_bytes (None: to the block's end) once [byte_offset, byte_offset + num_bytes) is checked to lie
    inside the block, in multiples of ``multiple`` bytes (the copy kernel's 16-byte vectors)."""
    num_bytes = bytes_per_block - byte_offset if num_bytes is None else num_bytes
    if byte_offset % multiple or num_bytes % multiple or byte_offset < 0 or num_bytes <= 0 \
            or byte_offset + num_bytes > bytes_per_block:
        raise ValueError(f"byte range [{byte_offset}, {byte_offset + num_bytes}) must lie inside the "
                         f"{bytes_per_block}-byte block, in multiples of {multiple}")
    return num_bytes


def dma_runs(src_addresses: np.ndarray, dst_addresses: np.ndarray, bytes_per_block: int,
             src_allocations: np.ndarray | None = None, dst_allocations: np.ndarray | None = None) -> np.ndarray:
    """[num_runs, 3] int64 (source address, destination address, blocks): consecutive copy ops whose
    blocks are back to back on both sides (consecutive ids within one tensor or host chunk) form one
    run, one copy-engine transfer. (prepare_dma_copy sorts a batch by source address first.)

    ``*_allocations``: which allocation (host chunk) each block lives in; a run never spans two, even
    where two chunks happen to be adjacent in memory (one transfer must stay inside one pinned or
    device allocation)."""
    src, dst = np.asarray(src_addresses, np.int64), np.asarray(dst_addresses, np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"source ({src.shape}) and destination ({dst.shape}) addresses must be equal-length lists")
    if src.size == 0:
        return np.zeros((0, 3), np.int64)
    breaks = (np.diff(src) != bytes_per_block) | (np.diff(dst) != bytes_per_block)
    for allocations in (src_allocations, dst_allocations):
        if allocations is not None:
            breaks |= np.diff(np.asarray(allocations, np.int64)) != 0
    starts = np.flatnonzero(np.concatenate([[True], breaks]))
    counts = np.diff(np.append(starts, src.size))
    return np.stack([src[starts], dst[starts], counts], axis=1)


class DmaBlockCopy:
    """A batch of block copies for the copy engines, its runs resolved: launch it for whole blocks (one
    cudaMemcpyAsync per run) or for a byte range of every block (one cudaMemcpy2DAsync per run: the
    range of each of its blocks, rows ``bytes_per_block`` apart on both sides), on the current stream."""

    def __init__(self, runs: np.ndarray, bytes_per_block: int, device: torch.device) -> None:
        self.runs = runs  # [num_runs, 3] int64: source address, destination address, blocks
        self.bytes_per_block = bytes_per_block
        self.device = device

    def launch(self, byte_offset: int = 0, num_bytes: int | None = None) -> None:
        """Copies bytes [byte_offset, byte_offset + num_bytes) of every block, on the current stream."""
        num_bytes = _check_byte_range(byte_offset, num_bytes, self.bytes_per_block, 1)
        import cupy  # noqa: PLC0415 - a GPU dependency; the runtime has it wherever it copies between tiers

        runtime = cupy.cuda.runtime
        stream = torch.cuda.current_stream(self.device).cuda_stream
        pitch = self.bytes_per_block
        with cupy.cuda.Device(self.device.index):
            for src, dst, count in self.runs.tolist():
                if num_bytes == pitch:  # whole blocks, back to back: one linear transfer
                    runtime.memcpyAsync(dst, src, count * pitch, runtime.memcpyDefault, stream)
                else:
                    runtime.memcpy2DAsync(dst + byte_offset, pitch, src + byte_offset, pitch, num_bytes, count,
                                          runtime.memcpyDefault, stream)


def prepare_dma_copy(src_pool: Any, dst_pool: Any, src_block_ids: Sequence[int],
                     dst_block_ids: Sequence[int]) -> DmaBlockCopy:
    """Checks the pools and resolves the copies into runs of blocks back to back on both sides."""
    if len(src_block_ids) != len(dst_block_ids) or len(src_block_ids) == 0:
        raise ValueError(f"src_block_ids ({len(src_block_ids)}) and dst_block_ids ({len(dst_block_ids)}) "
                         "must have the same, non-zero length")
    src, dst, device, bytes_per_block = _resolve_pools(src_pool, dst_pool, int(src_block_ids[0]),
                                                       int(dst_block_ids[0]))
    return _dma_copy(src, dst, src_block_ids, dst_block_ids, device, bytes_per_block)


def _dma_copy(src: _Pool, dst: _Pool, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
              device: torch.device, bytes_per_block: int) -> DmaBlockCopy:
    # The copy engines take host pointers as they are (unified addressing; pinned host memory keeps
    # the transfer asynchronous: the host pool is pinned on a GPU machine).
    def address(tensor: torch.Tensor, name: str) -> int:
        return tensor.data_ptr()

    src_addresses = src.block_addresses(src_block_ids, bytes_per_block, "src_pool", address)
    dst_addresses = dst.block_addresses(dst_block_ids, bytes_per_block, "dst_pool", address)
    src_chunks, dst_chunks = src.chunk_of(src_block_ids), dst.chunk_of(dst_block_ids)
    # The copies of a batch are independent: in source order, ids descending on both sides (blocks
    # freed last-in first-out come back that way) join into runs too.
    order = np.argsort(src_addresses, kind="stable")
    runs = dma_runs(src_addresses[order], dst_addresses[order], bytes_per_block, src_chunks[order], dst_chunks[order])
    return DmaBlockCopy(runs, bytes_per_block, device)


class PreparedBlockCopy:
    """A batch of block copies for the copy kernel, its device address tables already uploaded:
    launch it for whole blocks, or once per layer (``byte_offset``/``num_bytes`` = that layer's
    slice of every block) with no further host work than the launch itself."""

    def __init__(self, kernel, table: torch.Tensor, bytes_per_block: int, device: torch.device) -> None:
        self.kernel = kernel
        self.table = table  # [2, num_ops] int64: source, destination addresses
        self.bytes_per_block = bytes_per_block
        self.device = device

    def launch(self, byte_offset: int = 0, num_bytes: int | None = None) -> None:
        """Copies bytes [byte_offset, byte_offset + num_bytes) of every block, on the current stream."""
        num_bytes = _check_byte_range(byte_offset, num_bytes, self.bytes_per_block, 16)
        grid = (self.table.shape[1], math.ceil(num_bytes / BYTES_PER_CTA))
        args = (ptr(self.table[0]), ptr(self.table[1]), i64(byte_offset), i64(num_bytes), i64(BYTES_PER_CTA))
        launch(self.kernel, grid, (NUM_THREADS,), args, device_index=self.device.index)


def prepare_block_copy(src_pool: Any, dst_pool: Any, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                       *, library: KernelLibrary | None = None) -> PreparedBlockCopy:
    """Checks the pools and uploads the address tables on the current stream (the stream the
    copies will run on: the upload is ordered before them)."""
    if len(src_block_ids) != len(dst_block_ids) or len(src_block_ids) == 0:
        raise ValueError(f"src_block_ids ({len(src_block_ids)}) and dst_block_ids ({len(dst_block_ids)}) "
                         "must have the same, non-zero length")
    src, dst, device, bytes_per_block = _resolve_pools(src_pool, dst_pool, int(src_block_ids[0]),
                                                       int(dst_block_ids[0]))
    return _upload(src, dst, src_block_ids, dst_block_ids, device, bytes_per_block, library)


def block_copy_kernel(library: KernelLibrary, device: torch.device):
    """The copy kernel for ``device``, compiled and loaded on first use."""
    return library.kernel(block_copy_spec(device_arch(device)), KERNEL, device.index)


def _upload(src: _Pool, dst: _Pool, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
            device: torch.device, bytes_per_block: int, library: KernelLibrary | None) -> PreparedBlockCopy:
    """The address tables of already resolved pools, uploaded on the current stream."""
    if bytes_per_block % 16:
        raise ValueError(f"a block of {bytes_per_block} bytes is not a multiple of 16: use method='memcpy'")
    # [2, num_ops]: source addresses, destination addresses
    addresses = np.stack([src.block_addresses(src_block_ids, bytes_per_block, "src_pool"),
                          dst.block_addresses(dst_block_ids, bytes_per_block, "dst_pool")])
    if (addresses % 16).any():
        raise ValueError("block addresses must be 16-byte aligned: allocate the pools with torch")
    # Pinned staging + async upload on this stream: torch keeps the staging buffer alive until the
    # copy has run, and the device table belongs to this stream's allocations.
    table = torch.from_numpy(addresses).pin_memory().to(device, non_blocking=True)
    kernel = block_copy_kernel(library if library is not None else KernelLibrary(), device)
    return PreparedBlockCopy(kernel, table, bytes_per_block, device)


def _resolve_pools(src_pool: Any, dst_pool: Any, src_block_id: int,
                   dst_block_id: int) -> tuple[_Pool, _Pool, torch.device, int]:
    """Both pools' views, the CUDA device involved and the bytes of one block (equal on both sides)."""
    src, dst = _Pool.of(src_pool, "src_pool"), _Pool.of(dst_pool, "dst_pool")
    cuda_devices = [p.device for p in (src, dst) if p.device.type == "cuda"]
    if not cuda_devices:
        raise ValueError("copy_blocks moves blocks to or from a GPU: at least one pool must be on a CUDA device")
    bytes_per_block = _block_bytes(src.block(src_block_id), "src_pool")
    dst_bytes = _block_bytes(dst.block(dst_block_id), "dst_pool")
    if dst_bytes != bytes_per_block:
        raise ValueError(f"src_pool and dst_pool blocks differ in size ({bytes_per_block} vs {dst_bytes} bytes): "
                         "they must hold the same block shape")
    return src, dst, cuda_devices[0], bytes_per_block
