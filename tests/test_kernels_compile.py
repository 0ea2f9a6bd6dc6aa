"""Every CUDA kernel compiles for Hopper (sm_90) in every specialization family kvtool launches.

Runs without a GPU: only nvcc is needed (skipped when it is absent). The specializations are built
by the same functions the launchers use, so a define the launcher passes and the kernel does not
expect (or a shared-memory size they disagree on) fails here, not on the GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import pytest
import torch

from kvtool.kernels.add_rms_norm import add_rms_norm_spec
from kvtool.kernels.block_copy import block_copy_spec
from kvtool.kernels.compiler import (
    KernelCompileError,
    KernelCompiler,
    KernelSpec,
    NvccBackend,
    NvrtcBackend,
    default_source_dir,
    find_nvcc,
)
from kvtool.kernels.kv_append import kv_append_spec
from kvtool.kernels.nvrtc import NvrtcError, load_nvrtc
from kvtool.kernels.paged_context_attention import context_attention_spec, smem_bytes
from kvtool.kernels.paged_decode_attention import (decode_attention_spec, heads_per_cta, num_partitions,
                                                   partition_size_for)
from kvtool.kernels.rope_append import rope_append_spec
from kvtool.kernels.silu_mul import silu_mul_spec

ARCH = "sm_90"
NVCC = find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")


def _specializations() -> dict[str, tuple[KernelSpec, tuple[str, ...]]]:
    """label -> (spec, kernel symbols it must export)."""
    specs: list[tuple[KernelSpec, tuple[str, ...]]] = []
    context = ("kvt_paged_context_attention", "kvt_paged_context_reduce")
    decode = ("kvt_paged_decode_attention", "kvt_paged_decode_reduce")
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in (64, 128):
            specs.append((context_attention_spec(head_dim, 16, dtype, ARCH), context))
            specs.append((decode_attention_spec(head_dim, 16, dtype, 4, ARCH), decode))
    for tokens_per_block in (32, 64, 128):
        specs.append((context_attention_spec(128, tokens_per_block, torch.bfloat16, ARCH), context))
        specs.append((decode_attention_spec(64, tokens_per_block, torch.float16, 2, ARCH), decode))
    for group_size in (1, 7, 8):  # MHA, an odd GQA group (Qwen2-0.5B: 14 / 2), a wide one
        specs.append((decode_attention_spec(128, 16, torch.float16, group_size, ARCH), decode))
    # The smallest split-K partition a batch of one chooses (64 keys: 4 steps of the key groups at hd 64).
    specs.append((decode_attention_spec(64, 16, torch.bfloat16, 8, ARCH, partition_size=64), decode))
    specs.append((kv_append_spec(ARCH), ("kvt_kv_append",)))
    specs.append((block_copy_spec(ARCH), ("kvt_block_copy",)))
    # The model's fused kernels (tests/test_kernels_fused.py runs them on a GPU).
    specs.append((add_rms_norm_spec(torch.bfloat16, ARCH), ("kvt_add_rms_norm",)))
    specs.append((silu_mul_spec(torch.float16, ARCH), ("kvt_silu_mul",)))
    specs.append((rope_append_spec(64, torch.float16, ARCH), ("kvt_rope_append",)))
    specs.append((rope_append_spec(128, torch.bfloat16, ARCH), ("kvt_rope_append",)))
    return {spec.label: (spec, symbols) for spec, symbols in specs}


SPECIALIZATIONS = _specializations()


@pytest.fixture(scope="module")
def compiled_with_nvcc(tmp_path_factory):
    """Compiles every specialization once, in parallel (nvcc runs as a subprocess)."""
    compiler = KernelCompiler(cache_dir=tmp_path_factory.mktemp("kernel-cache"), backends=[NvccBackend(NVCC)])
    workers = max(2, os.cpu_count() or 2)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {label: pool.submit(compiler.compile, spec) for label, (spec, _) in SPECIALIZATIONS.items()}
        return {label: future.result() for label, future in futures.items()}


@needs_nvcc
@pytest.mark.parametrize("label", sorted(SPECIALIZATIONS))
def test_kernel_specialization_compiles_to_an_sm90_cubin_with_its_entry_points(compiled_with_nvcc, label):
    compiled = compiled_with_nvcc[label]
    cubin = compiled.cubin_path.read_bytes()
    assert cubin[:4] == b"\x7fELF"
    assert not compiled.from_cache
    for symbol in SPECIALIZATIONS[label][1]:
        assert symbol.encode() in cubin, f"{symbol} missing from {label}"
    assert 90 in _cubin_sm_candidates(cubin)


def _cubin_sm_candidates(cubin: bytes) -> set[int]:
    """SM versions an ELF cubin's e_flags may encode (the byte moved across CUDA releases)."""
    assert int.from_bytes(cubin[18:20], "little") == 190  # e_machine EM_CUDA
    flags = int.from_bytes(cubin[0x30:0x34], "little")
    return {(flags >> shift) & 0xFF for shift in (0, 8, 16)}


@needs_nvcc
def test_second_compile_of_a_specialization_comes_from_the_cache(tmp_path):
    calls = []

    class CountingNvcc(NvccBackend):
        def compile(self, spec, source_dir):
            calls.append(spec.label)
            return super().compile(spec, source_dir)

    compiler = KernelCompiler(cache_dir=tmp_path, backends=[CountingNvcc(NVCC)])
    spec = kv_append_spec(ARCH)
    first = compiler.compile(spec)
    second = compiler.compile(spec)
    # A fresh compiler (another process) finds the same file.
    third = KernelCompiler(cache_dir=tmp_path, backends=[CountingNvcc(NVCC)]).compile(spec)
    assert calls == [spec.label]
    assert (first.from_cache, second.from_cache, third.from_cache) == (False, True, True)
    assert first.cubin_path == second.cubin_path == third.cubin_path


@needs_nvcc
def test_editing_a_shared_header_recompiles_instead_of_reusing_a_stale_cubin(tmp_path):
    sources = tmp_path / "kernels"
    shutil.copytree(default_source_dir(), sources)
    compiler = KernelCompiler(cache_dir=tmp_path / "cache", source_dir=sources, backends=[NvccBackend(NVCC)])
    spec = kv_append_spec(ARCH)
    before = compiler.compile(spec)
    with open(sources / "common.cuh", "a") as header:
        header.write("\n// an edit\n")
    after = compiler.compile(spec)
    assert not after.from_cache
    assert after.cubin_path != before.cubin_path


@needs_nvcc
def test_context_kernel_refuses_a_shared_memory_size_it_does_not_use(tmp_path):
    # The launcher passes its dynamic shared-memory size; the kernel static_asserts its own layout.
    good = context_attention_spec(64, 16, torch.float16, ARCH)
    defines = dict(good.defines)
    defines["KVT_CTX_SMEM_BYTES"] = smem_bytes(64) + 16
    bad = KernelSpec.create(good.source, ARCH, **defines)
    compiler = KernelCompiler(cache_dir=tmp_path, backends=[NvccBackend(NVCC)])
    with pytest.raises(KernelCompileError, match="shared memory"):
        compiler.compile(bad)


@needs_nvcc
def test_compile_error_carries_the_compiler_log(tmp_path):
    sources = tmp_path / "kernels"
    shutil.copytree(default_source_dir(), sources)
    (sources / "broken.cu").write_text('extern "C" __global__ void k() { undeclared_name = 1; }\n')
    compiler = KernelCompiler(cache_dir=tmp_path / "cache", source_dir=sources, backends=[NvccBackend(NVCC)])
    with pytest.raises(KernelCompileError, match="undeclared_name"):
        compiler.compile(KernelSpec.create("broken.cu", ARCH))


# ---- resources per kernel (ptxas -v): what decides whether and how well a launch fits an SM ----

SM90_REGISTERS_PER_SM = 64 * 1024
SM90_SMEM_PER_SM = 228 * 1024  # of which at most 227 KiB per CTA; 1 KiB per CTA is reserved


class KernelResources(NamedTuple):
    registers: int
    spill_bytes: int  # spill stores + spill loads
    static_smem: int


def _ptxas_resources(spec: KernelSpec, tmp_path) -> dict[str, KernelResources]:
    command = NvccBackend(NVCC).command(spec, default_source_dir(), tmp_path / f"{spec.stem}.cubin")
    result = subprocess.run([*command, "-Xptxas=-v"], capture_output=True, text=True, check=True)
    report: dict[str, KernelResources] = {}
    for entry in re.split(r"Compiling entry function ", result.stderr)[1:]:
        name = re.match(r"'(\w+)'", entry).group(1)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", entry)
        smem = re.search(r"(\d+) bytes smem", entry)
        report[name] = KernelResources(int(re.search(r"Used (\d+) registers", entry).group(1)),
                                       int(spills.group(1)) + int(spills.group(2)), int(smem.group(1)) if smem else 0)
    return report


def _ctas_per_sm(resources: KernelResources, num_threads: int, dynamic_smem: int = 0) -> int:
    registers = -(-resources.registers // 8) * 8 * num_threads  # allocated in units of 8 per thread
    smem = resources.static_smem + dynamic_smem + 1024
    return min(SM90_REGISTERS_PER_SM // registers, SM90_SMEM_PER_SM // smem, 2048 // num_threads)


@needs_nvcc
def test_the_heaviest_specializations_fit_an_sm_without_register_spills(tmp_path):
    context_4 = context_attention_spec(128, 16, torch.bfloat16, ARCH)
    decode_8 = decode_attention_spec(128, 16, torch.bfloat16, 8, ARCH)
    specs = [context_4, decode_8, kv_append_spec(ARCH), block_copy_spec(ARCH)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports = dict(zip([s.label for s in specs], pool.map(lambda s: _ptxas_resources(s, tmp_path), specs)))
    for label, report in reports.items():
        for name, resources in report.items():
            assert resources.spill_bytes == 0, f"{name} of {label} spills registers: {resources}"
    # Two context CTAs per SM (load of one tile overlaps the math of the other).
    context = reports[context_4.label]["kvt_paged_context_attention"]
    assert _ctas_per_sm(context, 128, smem_bytes(128)) >= 2
    # Decode is memory-bound: with 8 query heads per CTA (the most registers), 4 CTAs per SM still
    # keep 4 x 128 threads x 4 x 16 B = 32 KiB of loads in flight per SM (HBM3 needs about 15).
    assert _ctas_per_sm(reports[decode_8.label]["kvt_paged_decode_attention"], 128) >= 4


def _nvrtc_backend():
    try:
        return NvrtcBackend(load_nvrtc())
    except NvrtcError:
        return None


@pytest.mark.skipif(_nvrtc_backend() is None, reason="NVRTC (libnvrtc) is not installed")
def test_every_kernel_source_also_compiles_with_nvrtc(tmp_path):
    # The sources are header-free so that a GPU machine without a toolkit (pip NVRTC only) works.
    compiler = KernelCompiler(cache_dir=tmp_path, backends=[_nvrtc_backend()])
    one_per_source = {}
    for spec, symbols in SPECIALIZATIONS.values():
        one_per_source.setdefault(spec.source, (spec, symbols))
    for spec, symbols in one_per_source.values():
        cubin = compiler.compile(spec).cubin_path.read_bytes()
        assert cubin[:4] == b"\x7fELF"
        for symbol in symbols:
            assert symbol.encode() in cubin


def test_kernel_spec_rejects_a_virtual_architecture():
    with pytest.raises(ValueError, match="sm_90"):
        KernelSpec.create("kv_append.cu", "compute_90")


# ---- host-side launch planning (no GPU needed) ----

def test_decode_heads_per_cta_divides_the_gqa_group_and_stays_within_eight():
    assert [heads_per_cta(g) for g in (1, 2, 4, 7, 8, 12, 16, 32)] == [1, 2, 4, 7, 8, 6, 8, 8]


def test_decode_splits_sequences_longer_than_a_partition():
    assert num_partitions(1, 512) == 1
    assert num_partitions(512, 512) == 1
    assert num_partitions(513, 512) == 2
    assert num_partitions(4096, 512) == 8


def test_small_decode_batches_split_into_smaller_partitions_until_every_sm_has_a_cta():
    # qwen3-8b (8 KV heads, one chunk each) on 132 SMs: batch 1 gets 128-key partitions (8 x 32 = 256
    # CTAs for a 4k sequence: the H100's best batch-1 size, results/gpu/gpu_suite.md), batch 2 256,
    # batch 4 and more the full 512.
    assert [partition_size_for(8 * batch, 132) for batch in (1, 2, 4, 8, 64)] == [128, 256, 512, 512, 512]
    assert partition_size_for(1, 1000) == 64  # nothing fills a huge GPU: the smallest partitions
    with pytest.raises(ValueError, match="num_row_ctas"):
        partition_size_for(0, 132)


@needs_nvcc
def test_precompile_builds_every_kernel_a_model_needs_into_a_plan_directory(tmp_path):
    from kvtool.kernels.precompile import precompile, specs_for_model

    # qwen3-8b shapes: 32 query heads over 8 KV heads of 128 dims.
    specs = specs_for_model(head_dim=128, num_heads=32, num_kv_heads=8, tokens_per_block=16,
                            dtype=torch.bfloat16)
    compiler = KernelCompiler(cache_dir=tmp_path / "plan" / "kernels", backends=[NvccBackend(NVCC)])
    compiled = precompile(specs, compiler)
    assert [c.spec for c in compiled] == specs
    assert all(c.cubin_path.parent.parent == tmp_path / "plan" / "kernels" for c in compiled)
    assert all(c.from_cache for c in precompile(specs, compiler))
