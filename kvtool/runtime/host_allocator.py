"""Host memory for a forward on the CPU: weights and KV cache in huge pages, freed activations kept.

Huge pages: a plan's weights come from safetensors mapped from the file, in the page cache's 4 KB
pages. A decode step streams every weight once, and on 4 KB pages the TLB misses every 4 KB and
the hardware prefetcher starts over at every page. A bfloat16 SmolLM2-135M decode step took 7.7 ms
there and 6.7 ms with the same weights copied into anonymous memory advised for 2 MB pages (the AMD
EPYC VM at 80 GB/s; 1.06x at 50 GB/s). ``in_huge_pages`` makes the weights' copy once at load.
``huge_page_zeros`` holds the KV pool: torch advises only some of its allocations (by size, as its
version sees fit), and decode attention read a pool from huge_page_zeros about 1.04x faster.

Activations: a prompt's projections return new tensors of several MB (SmolLM2's gate_up output
for a 1,053-token bfloat16 prompt is 6.5 MB). glibc's malloc serves requests that large with fresh
mappings and unmaps them on free, so every product of every layer page-faults its output in again:
the gate_up products of such a prompt took 209 ms instead of 119 (tcmalloc, which vLLM's CPU backend
preloads, keeps freed memory). Raising glibc's mmap and trim thresholds makes freed blocks reusable by the next
step, as tcmalloc's caches do, at the cost of the process keeping its peak memory mapped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20
# Each tensor of an arena starts on a cache line (what the kernels' vector loads want).
ARENA_ALIGNMENT = 64

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit systems: blocks up to this size come from the heap.
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024
# Free memory at the heap's top kept rather than returned to the system.
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to keep freed memory for reuse (see the module docstring); False where the
    C library is not glibc (another allocator keeps its own policy)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 -- only glibc has it
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def can_advise_huge_pages() -> bool:
    """Whether this system's mmap can ask for transparent huge pages (Linux)."""
    return hasattr(mmap, "MADV_HUGEPAGE")


def _huge_page_buffer(num_bytes: int) -> torch.Tensor:
    """uint8 [num_bytes] of anonymous memory advised for transparent huge pages, starting on a huge
    page, its pages not yet touched (the kernel zeroes each as it is first written); where the system
    has no such advice, torch.empty."""
    if num_bytes == 0 or not can_advise_huge_pages():
        return torch.empty(num_bytes, dtype=torch.uint8)
    # One huge page more than asked for, to start on a huge page (mmap aligns to 4 KB pages only).
    buffer = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(buffer, dtype=torch.uint8)  # holds the mapping for as long as any view lives
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE, start, num_bytes)
    except OSError:
        pass  # a kernel built without transparent huge pages refuses the advice: 4 KB pages, as torch's
    return whole[start:start + num_bytes]


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor in anonymous memory advised for transparent huge pages, its start on a huge
    page. Where the system has no such advice, torch.zeros."""
    # Touched now, as torch.zeros does, so that no page fault lands in a measured step (a KV block's
    # first write).
    return _huge_page_buffer(math.prod(shape) * dtype.itemsize).zero_().view(dtype).view(shape)


def in_huge_pages(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Copies of ``tensors`` (cast to ``dtype`` when given) side by side in one buffer advised for huge
    pages (plain memory where the system has no such advice), each on a cache line."""
    def nbytes(tensor: torch.Tensor) -> int:
        return tensor.numel() * (dtype or tensor.dtype).itemsize

    def padded(tensor: torch.Tensor) -> int:
        return -(-nbytes(tensor) // ARENA_ALIGNMENT) * ARENA_ALIGNMENT

    # The copies write every page: no zeroing first.
    arena = _huge_page_buffer(sum(padded(tensor) for tensor in tensors.values()))
    copies, offset = {}, 0
    for name, tensor in tensors.items():
        copy = arena[offset:offset + nbytes(tensor)].view(dtype or tensor.dtype).view(tensor.shape)
        copies[name] = copy.copy_(tensor)
        offset += padded(tensor)
    return copies
