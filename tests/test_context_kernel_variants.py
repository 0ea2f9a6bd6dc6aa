"""The 32-rows-per-warp variant of the paged context kernel (``rows_per_warp=32``, define
KVT_CTX_ROWS_PER_WARP=32) against the float64 reference, over the scenarios the default variant is
tested on in tests/test_kernels_gpu.py (cached prefix, sliding window with released -1 blocks,
several tokens_per_block, fp16/bf16, head_dim 64/128, GQA, strided activations); plus CPU checks
that every specialization of the variant compiles with nvcc, spill-free, at <= 255 registers, and
that the launcher's shared-memory size is the kernel's.
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvtool.kernels.compiler import KernelCompileError, KernelCompiler, KernelSpec, NvccBackend, default_source_dir
from kvtool.kernels.paged_context_attention import context_attention_spec, keys_per_tile, smem_bytes

ARCH = "sm_90"
ROWS = 32


def _nvcc():
    from kvtool.kernels.compiler import find_nvcc

    return find_nvcc()


needs_nvcc = pytest.mark.skipif(_nvcc() is None, reason="nvcc is not installed")


def _variant_specs() -> dict[str, KernelSpec]:
    specs = []
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in (64, 128):
            for tokens_per_block in (16, 32, 64, 128):
                specs.append(context_attention_spec(head_dim, tokens_per_block, dtype, ARCH, rows_per_warp=ROWS))
    return {spec.label: spec for spec in specs}


VARIANT_SPECS = _variant_specs()


# ---- CPU: compiles, fits, agrees with the launcher ----

def test_variant_launcher_parameters():
    assert keys_per_tile(128, 32) == 32 and keys_per_tile(64, 32) == 64 and keys_per_tile(128) == 64
    # Q tile of 128 rows + double-buffered K and V + flags, rows padded by 8 elements.
    assert smem_bytes(128, rows_per_warp=32) == (128 + 4 * 32) * 136 * 2 + 2 * 32 * 4
    assert smem_bytes(64, rows_per_warp=32) == (128 + 4 * 64) * 72 * 2 + 2 * 64 * 4
    default = context_attention_spec(128, 16, torch.bfloat16, ARCH)
    assert "KVT_CTX_ROWS_PER_WARP" not in dict(default.defines)  # the default's cache key is unchanged
    assert dict(context_attention_spec(128, 16, torch.bfloat16, ARCH, rows_per_warp=32).defines)[
        "KVT_CTX_ROWS_PER_WARP"] == 32
    with pytest.raises(ValueError, match="4 warps"):
        context_attention_spec(128, 16, torch.bfloat16, ARCH, num_warps=8, rows_per_warp=32)
    with pytest.raises(ValueError, match="16 or 32"):
        context_attention_spec(128, 16, torch.bfloat16, ARCH, rows_per_warp=64)


def _ptxas(spec: KernelSpec, tmp_path) -> str:
    command = NvccBackend(_nvcc()).command(spec, default_source_dir(), tmp_path / f"{abs(hash(spec.label))}.cubin")
    return subprocess.run([*command, "-Xptxas=-v"], capture_output=True, text=True, check=True).stderr


@needs_nvcc
def test_every_variant_specialization_compiles_without_spills(tmp_path):
    specs = list(VARIANT_SPECS.values())
    with ThreadPoolExecutor(max_workers=8) as pool:
        logs = list(pool.map(lambda s: _ptxas(s, tmp_path), specs))
    for spec, log in zip(specs, logs):
        registers = int(re.search(r"Used (\d+) registers", log).group(1))
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        assert registers <= 255, f"{spec.label}: {registers} registers"
        assert spills.groups() == ("0", "0"), f"{spec.label} spills: {spills.group(0)}"
        # 2 CTAs of 128 threads per SM: registers (allocated per 8) and shared memory both fit.
        head_dim = dict(spec.defines)["KVT_HEAD_DIM"]
        assert 2 * (-(-registers // 8) * 8) * 128 <= 64 * 1024
        assert 2 * (smem_bytes(head_dim, rows_per_warp=32) + 1024) <= 228 * 1024


@needs_nvcc
def test_variant_compiles_to_a_cubin_with_the_entry_point(tmp_path):
    compiler = KernelCompiler(cache_dir=tmp_path, backends=[NvccBackend(_nvcc())])
    for spec in (context_attention_spec(128, 16, torch.bfloat16, ARCH, rows_per_warp=32),
                 context_attention_spec(64, 32, torch.float16, ARCH, rows_per_warp=32)):
        cubin = compiler.compile(spec).cubin_path.read_bytes()
        assert cubin[:4] == b"\x7fELF" and b"kvt_paged_context_attention" in cubin


@needs_nvcc
def test_variant_refuses_a_shared_memory_size_it_does_not_use(tmp_path):
    good = context_attention_spec(128, 16, torch.float16, ARCH, rows_per_warp=32)
    defines = dict(good.defines)
    defines["KVT_CTX_SMEM_BYTES"] = smem_bytes(128)  # the default variant's size: wrong here
    compiler = KernelCompiler(cache_dir=tmp_path, backends=[NvccBackend(_nvcc())])
    with pytest.raises(KernelCompileError, match="shared memory"):
        compiler.compile(KernelSpec.create(good.source, ARCH, **defines))


# ---- GPU: the variant against the float64 reference ----

gpu_test = pytest.mark.gpu  # as tests/test_kernels_gpu.py: skipped without a CUDA GPU and CuPy (conftest.py)


DTYPES = [torch.float16, torch.bfloat16]


def _helpers():
    import test_kernels_gpu as base  # tests/ is on sys.path (rootdir-relative imports, as bench_fakes)

    return base


@pytest.fixture(scope="module")
def library():
    from kvtool.kernels.loader import KernelLibrary

    return KernelLibrary()


def _run(library, sc, num_seqs: int):
    from kvtool.kernels.paged_context_attention import paged_context_attention

    base = _helpers()
    out = base.poisoned_like(sc.query)
    paged_context_attention(library, sc.query, sc.kv_cache, sc.meta.block_tables, sc.meta.query_start_loc,
                            sc.meta.seq_lens, num_seqs=num_seqs, max_query_len=sc.meta.max_query_len,
                            scale=sc.scale, sliding_window=sc.window, out=out, rows_per_warp=ROWS)
    torch.cuda.synchronize()
    return out


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens_per_block", [16, 32, 64, 128])
def test_variant_over_cached_prefix_matches_reference(library, dtype, head_dim, tokens_per_block):
    base = _helpers()
    seqs = base.CONTEXT_SEQS + [(50, 1), (7, 1)]  # decode sequences the context kernel must not touch
    num_context = len(base.CONTEXT_SEQS)
    sc = base.build_scenario(seqs, num_context=num_context, num_heads=8, num_kv_heads=2, head_dim=head_dim,
                             tokens_per_block=tokens_per_block, dtype=dtype, seed=100 + head_dim + tokens_per_block)
    out = _run(library, sc, num_context)
    base.assert_rows_match(out, base.reference_attention(sc), sc.rows(0, num_context), dtype)
    assert torch.isnan(out[sc.rows(num_context, len(seqs))]).all(), "decode rows were written"


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [1, 16, 50, 90, 200, 4096])
@pytest.mark.parametrize("tokens_per_block", [16, 64])
def test_variant_with_sliding_window_never_reads_released_blocks(library, dtype, head_dim, window,
                                                                 tokens_per_block):
    base = _helpers()
    sc = base.build_scenario([(700, 150), (0, 90), (333, 64), (40, 3), (0, 300)], num_context=5, num_heads=8,
                             num_kv_heads=2, head_dim=head_dim, tokens_per_block=tokens_per_block, dtype=dtype,
                             seed=window + head_dim, window=window)
    if window < 700:
        assert (sc.meta.block_tables[0] == -1).sum() > 1, "the scenario should release blocks"
    out = _run(library, sc, 5)
    base.assert_rows_match(out, base.reference_attention(sc), sc.rows(0, 5), dtype)


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (14, 2), (32, 8), (8, 1)])
def test_variant_supports_gqa_groups(library, dtype, num_heads, num_kv_heads):
    base = _helpers()
    sc = base.build_scenario([(64, 96), (0, 33), (250, 17), (0, 257)], num_context=4, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, head_dim=128, tokens_per_block=16, dtype=dtype,
                             seed=7 * num_heads + num_kv_heads)
    out = _run(library, sc, 4)
    base.assert_rows_match(out, base.reference_attention(sc), sc.rows(0, 4), dtype)


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_variant_reads_strided_query_and_writes_strided_output(library, dtype, head_dim):
    from kvtool.kernels.paged_context_attention import paged_context_attention

    base = _helpers()
    sc = base.build_scenario([(90, 70), (0, 130)], num_context=2, num_heads=8, num_kv_heads=4, head_dim=head_dim,
                             tokens_per_block=32, dtype=dtype, seed=5, strided_activations=True)
    assert not sc.query.is_contiguous()
    wide = torch.full((sc.query.shape[0], 2, 8, head_dim), float("nan"), dtype=dtype, device="cuda")
    out = wide[:, 1]
    paged_context_attention(library, sc.query, sc.kv_cache, sc.meta.block_tables, sc.meta.query_start_loc,
                            sc.meta.seq_lens, num_seqs=2, max_query_len=sc.meta.max_query_len, scale=sc.scale,
                            sliding_window=None, out=out, rows_per_warp=ROWS)
    torch.cuda.synchronize()
    base.assert_rows_match(out, base.reference_attention(sc), sc.rows(0, 2), dtype)
    assert torch.isnan(wide[:, 0]).all()


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_variant_agrees_with_the_default_variant(library, dtype):
    from kvtool.kernels.paged_context_attention import paged_context_attention

    base = _helpers()
    sc = base.build_scenario([(0, 600), (1000, 333)], num_context=2, num_heads=16, num_kv_heads=4, head_dim=128,
                             tokens_per_block=16, dtype=dtype, seed=77)
    default = base.poisoned_like(sc.query)
    paged_context_attention(library, sc.query, sc.kv_cache, sc.meta.block_tables, sc.meta.query_start_loc,
                            sc.meta.seq_lens, num_seqs=2, max_query_len=sc.meta.max_query_len, scale=sc.scale,
                            sliding_window=None, out=default)
    variant = _run(library, sc, 2)
    rows = sc.rows(0, 2)
    base.assert_rows_match(variant, default.float(), rows, dtype, slack=2.0)

