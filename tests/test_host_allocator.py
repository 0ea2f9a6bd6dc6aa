"""kvtool.runtime.host_allocator: on the CPU, the weights and the KV pool lie in memory advised for
huge pages, and a prompt's large activations come from memory the process keeps, not from mappings of
their own that each free returns to the system."""

import mmap
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtool import LLM
from kvtool.runtime.host_allocator import (ARENA_ALIGNMENT, HUGE_PAGE_BYTES, can_advise_huge_pages,
                                           huge_page_zeros, in_huge_pages, keep_freed_memory)

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_possible() -> bool:
    return can_advise_huge_pages() and THP_SETTING.exists() and "[never]" not in THP_SETTING.read_text()


def mapping_fields(tensor: torch.Tensor) -> dict[str, str]:
    """/proc/self/smaps' fields of the mapping holding ``tensor`` (Rss, THPeligible, ...)."""
    address, fields, inside = tensor.data_ptr(), {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        match = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if match:
            if inside:
                return fields
            inside = int(match[1], 16) <= address < int(match[2], 16)
        elif inside:
            name, _, value = line.partition(":")
            fields[name] = value.split()[0] if value.split() else ""
    if inside:
        return fields
    raise AssertionError(f"no mapping holds address {address:#x}")


def may_use_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether the kernel may back the mapping holding ``tensor`` with huge pages (smaps' THPeligible:
    a region advised for them, whether or not the kernel found free 2 MB pages for it yet)."""
    return mapping_fields(tensor)["THPeligible"] == "1"


needs_huge_pages = pytest.mark.skipif(not huge_pages_possible(), reason="no transparent huge pages on this system")


@needs_huge_pages
def test_huge_page_zeros_are_zeros_starting_on_a_huge_page_the_kernel_may_back():
    tensor = huge_page_zeros((3, HUGE_PAGE_BYTES), torch.bfloat16)
    assert tensor.shape == (3, HUGE_PAGE_BYTES) and tensor.dtype == torch.bfloat16
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    assert may_use_huge_pages(tensor)
    # Every page is touched at once (no page fault later, in a measured step): all of it resident.
    assert int(mapping_fields(tensor)["Rss"]) * 1024 >= tensor.numel() * tensor.element_size()
    assert not tensor.any()
    tensor[2, -1] = 1.0  # the whole extent is writable
    assert tensor.sum() == 1.0


@pytest.mark.skipif(not can_advise_huge_pages(), reason="no madvise on this system")
def test_a_kernel_refusing_the_huge_page_advice_still_gives_zeroed_memory(monkeypatch):
    # An advice the kernel does not know gets EINVAL, as MADV_HUGEPAGE does from a kernel without THP.
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 12345)
    with pytest.raises(OSError):
        mmap.mmap(-1, 4096).madvise(mmap.MADV_HUGEPAGE)
    tensor = huge_page_zeros((4, 1024), torch.float32)
    assert tensor.shape == (4, 1024) and not tensor.any()


def test_in_huge_pages_copies_cast_each_on_a_cache_line_apart_from_the_source():
    source = {"a": torch.arange(5.0), "b": torch.randn(3, 7), "empty": torch.ones(0, 4)}
    copies = in_huge_pages(source, torch.bfloat16)
    assert list(copies) == list(source)
    for name, tensor in source.items():
        assert copies[name].dtype == torch.bfloat16 and copies[name].shape == tensor.shape
        assert torch.equal(copies[name], tensor.to(torch.bfloat16))
        assert copies[name].data_ptr() % ARENA_ALIGNMENT == 0
    copies["a"].zero_()
    assert torch.equal(source["a"], torch.arange(5.0))
    assert torch.equal(in_huge_pages(source)["b"], source["b"])  # no dtype: as it is


@needs_huge_pages
def test_a_cpu_engines_weights_and_kv_pool_lie_in_memory_for_huge_pages(tiny_llama_plan):
    with LLM(tiny_llama_plan, device="cpu") as llm:
        model, pools = llm.engine.executor.model, llm.engine.executor.pools
        assert may_use_huge_pages(model.layers[0].mlp.gate_up_proj.weight)
        assert may_use_huge_pages(model.embed_tokens.weight)
        assert may_use_huge_pages(pools.primary) and pools.primary.data_ptr() % HUGE_PAGE_BYTES == 0

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
