"""Every launcher passes its kernel exactly the parameters the kernel's CUDA signature declares, in
order and with matching C types (checked on any machine: the launch itself is intercepted).

A kernel receives raw bytes: an argument in the wrong place or of the wrong width is not an error
CuPy can report, it is garbage the kernel computes with. The signatures are read from the .cu
sources, so a kernel edit that the launcher does not follow fails here.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from kvtool.kernels import (add_rms_norm, block_copy, kv_append, paged_context_attention, paged_decode_attention,
                            rope_append, silu_mul, tensors)
from kvtool.kernels.compiler import default_source_dir

C_TYPES = {"i64": np.int64, "long long": np.int64, "int": np.int32, "float": np.float32}


def kernel_parameter_types(source: str, kernel: str) -> list[type]:
    """NumPy scalar types of the parameters of ``extern "C" __global__ ... kernel(...)``."""
    text = re.sub(r"//[^\n]*", "", (default_source_dir() / source).read_text())
    match = re.search(rf"\b{kernel}\s*\(([^)]*)\)\s*\{{", text)
    assert match, f"{kernel} not found in {source}"
    types = []
    for parameter in match.group(1).split(","):
        declaration = parameter.replace("__restrict__", "").replace("const", "").strip()
        if "*" in declaration:
            types.append(np.uint64)
        else:
            base = declaration.rsplit(" ", 1)[0].strip()
            types.append(C_TYPES[base])
    return types


class FakeLibrary:
    def kernel(self, spec, name, device_index, *, dynamic_smem_bytes=0):
        return name


@pytest.fixture
def launches(monkeypatch):
    """Launches as (kernel name, argument types); CPU tensors pass the CUDA-only checks."""
    calls: list[tuple[str, list[type]]] = []
    monkeypatch.setattr(tensors, "_check_vector_aligned", lambda tensor, name, strides: None)
    monkeypatch.setattr(paged_decode_attention, "device_sm_count", lambda device: 132)
    monkeypatch.setattr(paged_context_attention, "device_sm_count", lambda device: 132)
    for module in (block_copy, kv_append, paged_context_attention, paged_decode_attention, add_rms_norm, rope_append,
                   silu_mul):
        monkeypatch.setattr(module, "device_arch", lambda device: "sm_90")
        monkeypatch.setattr(module, "launch",
                            lambda kernel, grid, block, args, **kwargs: calls.append((kernel, [type(a) for a in args])))
    return calls


def step_tensors(num_tokens=4, num_heads=4, num_kv_heads=2, head_dim=64, tpb=16):
    query = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float16)
    kv_cache = torch.zeros(8, 3, 2, tpb, num_kv_heads, head_dim, dtype=torch.float16)[:, 1]  # a layer's view
    metadata = dict(block_tables=torch.zeros(2, 4, dtype=torch.int32),
                    query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
                    seq_lens=torch.tensor([3, 1200], dtype=torch.int32))
    return query, kv_cache, metadata


@pytest.mark.parametrize("num_splits", [1, None])  # None: 4 CTAs over 1,200 keys split them
def test_context_attention_and_reduce_launches_match_the_kernel_signatures(launches, num_splits):
    query, kv_cache, meta = step_tensors()
    paged_context_attention.paged_context_attention(FakeLibrary(), query, kv_cache, **meta, num_seqs=1,
                                                    max_query_len=3, max_seq_len=1200, scale=0.125,
                                                    sliding_window=None, out=torch.empty_like(query),
                                                    num_splits=num_splits)
    kernels = ["kvt_paged_context_attention"] + (["kvt_paged_context_reduce"] if num_splits is None else [])
    assert launches == [(name, kernel_parameter_types("paged_context_attention.cu", name)) for name in kernels]


def test_decode_attention_and_reduce_launches_match_the_kernel_signatures(launches):
    query, kv_cache, meta = step_tensors()
    paged_decode_attention.paged_decode_attention(FakeLibrary(), query, kv_cache, **meta, seq_offset=1, num_seqs=1,
                                                  max_seq_len=1200, scale=0.125, sliding_window=None,
                                                  out=torch.empty_like(query))
    source = "paged_decode_attention.cu"
    assert launches == [("kvt_paged_decode_attention", kernel_parameter_types(source, "kvt_paged_decode_attention")),
                        ("kvt_paged_decode_reduce", kernel_parameter_types(source, "kvt_paged_decode_reduce"))]


def test_kv_append_launch_matches_the_kernel_signature(launches):
    query, kv_cache, _ = step_tensors()
    key = torch.zeros(4, 2, 64, dtype=torch.float16)
    kv_append.append_kv(FakeLibrary(), key, key.clone(), kv_cache, torch.arange(4, dtype=torch.int64))
    assert launches == [("kvt_kv_append", kernel_parameter_types("kv_append.cu", "kvt_kv_append"))]


def test_block_copy_launches_match_the_kernel_signature(launches):
    table = torch.zeros(2, 3, dtype=torch.int64)  # [source, destination] addresses of 3 ops
    prepared = block_copy.PreparedBlockCopy("kvt_block_copy", table, bytes_per_block=4096, device=torch.device("cpu"))
    prepared.launch()
    prepared.launch(1024, 512)  # one layer's slice of each block
    expected = kernel_parameter_types("block_copy.cu", "kvt_block_copy")
    assert expected == [np.uint64, np.uint64, np.int64, np.int64, np.int64]
    assert launches == [("kvt_block_copy", expected)] * 2
    with pytest.raises(ValueError, match="inside the 4096-byte block"):
        prepared.launch(4000, 512)


def test_fused_kernel_launches_match_the_kernel_signatures(launches):
    _, kv_cache, _ = step_tensors()  # 2 KV heads of 64
    x, residual = torch.zeros(3, 128, dtype=torch.float16), torch.zeros(3, 128, dtype=torch.float16)
    add_rms_norm.add_rms_norm(FakeLibrary(), x, residual, torch.ones(128, dtype=torch.float16), 1e-6)
    out = silu_mul.silu_mul(FakeLibrary(), torch.zeros(3, 256, dtype=torch.float16))
    assert out.shape == (3, 128)
    qkv = torch.zeros(3, (4 + 2 * 2) * 64, dtype=torch.float16)
    table = torch.zeros(3, 1, 64, dtype=torch.float16)
    norm = torch.ones(64, dtype=torch.float16)
    query = rope_append.rope_append(FakeLibrary(), qkv, table, table.clone(), norm, norm, 1e-6, kv_cache,
                                    torch.arange(3, dtype=torch.int64), num_heads=4, num_kv_heads=2)
    assert query.shape == (3, 4, 64)
    assert launches == [("kvt_add_rms_norm", kernel_parameter_types("add_rms_norm.cu", "kvt_add_rms_norm")),
                        ("kvt_silu_mul", kernel_parameter_types("silu_mul.cu", "kvt_silu_mul")),
                        ("kvt_rope_append", kernel_parameter_types("rope_append.cu", "kvt_rope_append"))]


def kernel_block_size(source: str, kernel: str, defines: dict[str, int]) -> int:
    """The thread count of ``kernel``'s ``__launch_bounds__``, its constants evaluated from the source's
    ``constexpr int`` lines and the specialization's defines (KVT_HEAD_DIM ...)."""
    text = re.sub(r"//[^\n]*", "", (default_source_dir() / source).read_text())
    names: dict[str, int] = dict(defines)
    for name, expression in re.findall(r"constexpr int (\w+) = ([^;]+);", text):
        try:
            names[name] = int(eval(expression.replace("/", "//"), {"__builtins__": {}}, names))  # noqa: S307
        except (NameError, SyntaxError):
            continue  # a constant the launch bound does not use (a ternary, say)
    match = re.search(rf"__launch_bounds__\(([^,)]+)[^)]*\)\s*{kernel}\s*\(", text)
    assert match, f"{kernel} in {source} declares no __launch_bounds__"
    return int(eval(match.group(1).replace("/", "//"), {"__builtins__": {}}, names))  # noqa: S307


def test_every_launch_uses_the_block_size_its_kernel_is_compiled_for(monkeypatch):
    # A block larger than the launch bound does not launch at all; a smaller one leaves the kernels'
    # block-wide reductions (warp sums per NUM_WARPS, a warp per head row) reading unwritten slots.
    launched = []

    class SpecLibrary:
        def kernel(self, spec, name, device_index, *, dynamic_smem_bytes=0):
            return spec.source, name, dict(spec.defines)

    monkeypatch.setattr(tensors, "_check_vector_aligned", lambda tensor, name, strides: None)
    monkeypatch.setattr(paged_decode_attention, "device_sm_count", lambda device: 132)
    monkeypatch.setattr(paged_context_attention, "device_sm_count", lambda device: 132)
    for module in (block_copy, kv_append, paged_context_attention, paged_decode_attention, add_rms_norm, rope_append,
                   silu_mul):
        monkeypatch.setattr(module, "device_arch", lambda device: "sm_90")
        monkeypatch.setattr(module, "launch", lambda kernel, grid, block, args, **kwargs: launched.append((kernel, block)))
    library = SpecLibrary()
    query, kv_cache, meta = step_tensors()
    out = torch.empty_like(query)
    paged_context_attention.paged_context_attention(library, query, kv_cache, **meta, num_seqs=1, max_query_len=3,
                                                    max_seq_len=1200, scale=0.125, sliding_window=None, out=out)
    paged_decode_attention.paged_decode_attention(library, query, kv_cache, **meta, seq_offset=1, num_seqs=1,
                                                  max_seq_len=1200, scale=0.125, sliding_window=None, out=out)
    key = torch.zeros(4, 2, 64, dtype=torch.float16)
    kv_append.append_kv(library, key, key.clone(), kv_cache, torch.arange(4, dtype=torch.int64))
    add_rms_norm.add_rms_norm(library, torch.zeros(3, 128, dtype=torch.float16), torch.zeros(3, 128, dtype=torch.float16),
                              torch.ones(128, dtype=torch.float16), 1e-6)
    silu_mul.silu_mul(library, torch.zeros(3, 256, dtype=torch.float16))
    table = torch.zeros(4, 1, 64, dtype=torch.float16)
    rope_append.rope_append(library, torch.zeros(4, 8 * 64, dtype=torch.float16), table, table.clone(), None, None,
                            0.0, kv_cache, torch.arange(4, dtype=torch.int64), num_heads=4, num_kv_heads=2)
    prepared = block_copy.PreparedBlockCopy(library.kernel(block_copy.block_copy_spec("sm_90"), block_copy.KERNEL, 0),
                                            torch.zeros(2, 3, dtype=torch.int64), 4096, torch.device("cpu"))
    prepared.launch()
    assert len(launched) == 9  # the context and decode kernels, each with its reduce
    for (source, name, defines), block in launched:
        assert math.prod(block) == kernel_block_size(source, name, defines), f"{name} launched with {block}"
