"""kvtool.runtime.host_allocator: on the CPU, a prompt's large activations come from memory the
process keeps, not from mappings of their own that each free returns to the system."""

import subprocess
import sys

import pytest

from kvtool.runtime.host_allocator import keep_freed_memory

# Holds a fresh 8 MB torch tensor (a prompt's projection output) and prints how many blocks glibc's
# malloc serves from mappings of their own (mallinfo2's hblks) before and while it is held.
PROBE = """
import ctypes, sys, torch
from kvtool.runtime.host_allocator import keep_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = mallinfo2().hblks
activation = torch.empty(2 * 1024 * 1024).fill_(1.0)
print(before, mallinfo2().hblks)
"""


def mapped_blocks(mode: str) -> tuple[int, int]:
    result = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    before, during = result.stdout.split()[-2:]
    return int(before), int(during)


def test_a_prompts_activation_comes_from_kept_memory_not_a_mapping_of_its_own():
    if not keep_freed_memory():
        pytest.skip("the C library is not glibc")
    before, during = mapped_blocks("default")
    assert during == before + 1  # glibc's default: a block this large is a mapping, unmapped when freed
    before, during = mapped_blocks("keep")
    assert during == before
