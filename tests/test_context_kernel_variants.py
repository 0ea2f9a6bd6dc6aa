"""The paged context kernel's specializations and the launch shapes a CUDA graph gives it.

CPU: every (dtype, head_dim) specialization compiles with nvcc spill-free at <= 255 registers, two
CTAs fit an SM, and the launcher's shared-memory size is the kernel's. GPU (against the float64
reference of tests/test_kernels_gpu.py): a sliding window at head_dim 64, and a grid sized for a
graph's bucket (more query rows and more sequence slots than the step has, padding slots with no
query rows) that computes the real rows and writes nothing else. The scenarios at head_dim 128,
every tokens_per_block, GQA groups and strided activations are in tests/test_kernels_gpu.py.
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


def _nvcc():
    from kvtool.kernels.compiler import find_nvcc

    return find_nvcc()


needs_nvcc = pytest.mark.skipif(_nvcc() is None, reason="nvcc is not installed")


def _specs() -> dict[str, KernelSpec]:
    # tokens_per_block only turns divisions into shifts: one per (dtype, head_dim) says what registers need.
    specs = [context_attention_spec(head_dim, 16, dtype, ARCH)
             for dtype in (torch.float16, torch.bfloat16) for head_dim in (64, 128)]
    return {spec.label: spec for spec in specs}


SPECS = _specs()


# ---- CPU: compiles, fits, agrees with the launcher ----

def test_launcher_parameters():
    assert keys_per_tile(128) == 32 and keys_per_tile(64) == 64
    # Q tile of 128 rows + double-buffered K and V + flags, rows padded by 8 elements.
    assert smem_bytes(128) == (128 + 4 * 32) * 136 * 2 + 2 * 32 * 4
    assert smem_bytes(64) == (128 + 4 * 64) * 72 * 2 + 2 * 64 * 4
    assert dict(context_attention_spec(128, 16, torch.bfloat16, ARCH).defines)["KVT_CTX_BLOCK_N"] == 32


def _ptxas(spec: KernelSpec, tmp_path) -> str:
    command = NvccBackend(_nvcc()).command(spec, default_source_dir(), tmp_path / f"{abs(hash(spec.label))}.cubin")
    return subprocess.run([*command, "-Xptxas=-v"], capture_output=True, text=True, check=True).stderr


@needs_nvcc
def test_every_specialization_compiles_without_spills_two_ctas_per_sm(tmp_path):
    specs = list(SPECS.values())
    with ThreadPoolExecutor(max_workers=4) as pool:
        logs = list(pool.map(lambda s: _ptxas(s, tmp_path), specs))
    for spec, log in zip(specs, logs):
        registers = int(re.search(r"Used (\d+) registers", log).group(1))
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        assert registers <= 255, f"{spec.label}: {registers} registers"
        assert spills.groups() == ("0", "0"), f"{spec.label} spills: {spills.group(0)}"
        # 2 CTAs of 128 threads per SM: registers (allocated per 8) and shared memory both fit.
        head_dim = dict(spec.defines)["KVT_HEAD_DIM"]
        assert 2 * (-(-registers // 8) * 8) * 128 <= 64 * 1024
        assert 2 * (smem_bytes(head_dim) + 1024) <= 228 * 1024


@needs_nvcc
def test_kernel_refuses_a_shared_memory_size_it_does_not_use(tmp_path):
    good = context_attention_spec(128, 16, torch.float16, ARCH)
    defines = dict(good.defines)
    defines["KVT_CTX_SMEM_BYTES"] = smem_bytes(64)
    compiler = KernelCompiler(cache_dir=tmp_path, backends=[NvccBackend(_nvcc())])
    with pytest.raises(KernelCompileError, match="shared memory"):
        compiler.compile(KernelSpec.create(good.source, ARCH, **defines))


# ---- GPU: against the float64 reference ----

gpu_test = pytest.mark.gpu  # as tests/test_kernels_gpu.py: skipped without a CUDA GPU and CuPy (conftest.py)


DTYPES = [torch.float16, torch.bfloat16]


def _helpers():
    import test_kernels_gpu as base  # tests/ is on sys.path (rootdir-relative imports, as bench_fakes)

    return base


@pytest.fixture(scope="module")
def library():
    from kvtool.kernels.loader import KernelLibrary

    return KernelLibrary()


def _run(library, sc, num_seqs: int, max_query_len: int | None = None, **tensors):
    from kvtool.kernels.paged_context_attention import paged_context_attention

    base = _helpers()
    out = base.poisoned_like(sc.query)
    meta = {"block_tables": sc.meta.block_tables, "query_start_loc": sc.meta.query_start_loc,
            "seq_lens": sc.meta.seq_lens, **tensors}
    paged_context_attention(library, sc.query, sc.kv_cache, meta["block_tables"], meta["query_start_loc"],
                            meta["seq_lens"], num_seqs=num_seqs, max_query_len=max_query_len or sc.meta.max_query_len,
                            scale=sc.scale, sliding_window=sc.window, out=out)
    torch.cuda.synchronize()
    return out


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 16, 50, 90, 200, 4096])
def test_sliding_window_at_head_dim_64_never_reads_released_blocks(library, dtype, window):
    base = _helpers()
    sc = base.build_scenario([(700, 150), (0, 90), (333, 64), (40, 3), (0, 300)], num_context=5, num_heads=8,
                             num_kv_heads=2, head_dim=64, tokens_per_block=16, dtype=dtype, seed=window, window=window)
    if window < 700:
        assert (sc.meta.block_tables[0] == -1).sum() > 1, "the scenario should release blocks"
    out = _run(library, sc, 5)
    base.assert_rows_match(out, base.reference_attention(sc), sc.rows(0, 5), dtype)


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_grid_sized_for_a_graph_bucket_computes_the_real_rows_and_skips_padding_slots(library, dtype):
    # Two real context sequences, then three padding slots with no query rows (query_start_loc stays at
    # the real tokens' end, seq_len 0, block table -1), and a grid for 512 query rows: as a mixed
    # graph of the 512-token bucket launches it. Rows past the real tokens must stay unwritten.
    base = _helpers()
    sc = base.build_scenario([(90, 70), (2048, 128)], num_context=2, num_heads=32, num_kv_heads=8, head_dim=128,
                             tokens_per_block=32, dtype=dtype, seed=21)
    num_tokens = sc.query.shape[0]
    padded_query = torch.nn.functional.pad(sc.query, (0, 0, 0, 0, 0, 512 - num_tokens))
    sc_padded = type(sc)(**{**sc.__dict__, "query": padded_query})
    pad = 3
    query_start_loc = torch.cat([sc.meta.query_start_loc,
                                 torch.full((pad,), num_tokens, dtype=torch.int32, device="cuda")])
    seq_lens = torch.cat([sc.meta.seq_lens, torch.zeros(pad, dtype=torch.int32, device="cuda")])
    block_tables = torch.cat([sc.meta.block_tables,
                              torch.full((pad, sc.meta.block_tables.shape[1]), -1, dtype=torch.int32, device="cuda")])
    out = _run(library, sc_padded, 2 + pad, max_query_len=512, query_start_loc=query_start_loc, seq_lens=seq_lens,
               block_tables=block_tables)
    base.assert_rows_match(out[:num_tokens], base.reference_attention(sc), sc.rows(0, 2), dtype)
    assert torch.isnan(out[num_tokens:]).all(), "padding rows were written"
