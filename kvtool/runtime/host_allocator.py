"""The C allocator's settings for a forward on the CPU: freed memory stays in the process.

A prompt's projections return new tensors of several MB (SmolLM2's gate_up output for a 1,053-token
bfloat16 prompt is 6.5 MB). glibc's malloc serves requests that large with fresh mappings and unmaps
them on free, so every product of every layer page-faults its output in again: the gate_up products
of such a prompt took 209 ms instead of 119 (tcmalloc, which vLLM's CPU backend preloads, keeps
freed memory). Raising glibc's mmap and trim thresholds makes freed blocks reusable by the next
step, as tcmalloc's caches do, at the cost of the process keeping its peak memory mapped.
"""

from __future__ import annotations

import ctypes
import ctypes.util

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
