"""The paged context kernel's specializations, its key splits and the launch shapes a CUDA graph gives it.

CPU: every (dtype, head_dim) specialization compiles with nvcc spill-free at <= 255 registers, two
CTAs fit an SM, and the launcher's shared-memory size is the kernel's; the key splits' schedule (which
CTA reads which key tiles, which partials the reduce combines), replayed in NumPy, gives softmax
attention for any split count, window and chunk. GPU (against the float64
reference of tests/test_kernels_gpu.py): a sliding window at head_dim 64, and a grid sized for a
graph's bucket (more query rows and more sequence slots than the step has, padding slots with no
query rows) that computes the real rows and writes nothing else. The scenarios at head_dim 128,
every tokens_per_block, GQA groups and strided activations are in tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import math
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.kernels.compiler import KernelCompileError, KernelCompiler, KernelSpec, NvccBackend, default_source_dir
from kvtool.kernels.paged_context_attention import (BLOCK_M, MAX_KEY_SPLITS, MIN_KEYS_PER_SPLIT, REFERENCE_KEYS,
                                                    TARGET_CTAS_PER_SM, context_attention_spec, key_splits,
                                                    keys_per_tile, smem_bytes)

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


def test_a_question_over_a_long_prefix_splits_its_keys_and_a_full_launch_does_not():
    # The e2e hit: 1 query tile x 32 heads over 2,176 keys on 132 SMs: 9 splits of 8 tiles (256 keys).
    assert key_splits(32, 2176, 128, 132) == (9, 8)
    # In a graph sized for a 4,096-token max_seq_len the splits keep their size: the hit uses 9 of 16.
    assert key_splits(32, 4096, 128, 132) == (16, 8)
    assert key_splits(32, 40960, 128, 132) == (MAX_KEY_SPLITS, 40)  # 1,280 tiles: at most 32 splits
    assert key_splits(32, 40960, 128, 132, max_splits=7) == (7, 183)  # the launcher bounds the partials' bytes
    assert key_splits(32, 4096, 128, 132, max_splits=1).num_splits == 1
    assert key_splits(4 * 32 * 32, 4096, 128, 132).num_splits == 1  # 4 x 4k prompts: 4,096 CTAs
    assert key_splits(32, 300, 128, 132).num_splits == 1            # too few keys to be worth a reduce
    with pytest.raises(ValueError):
        key_splits(0, 100, 128, 132)


@settings(max_examples=200, deadline=None)
@given(num_ctas=st.integers(1, 5000), max_seq_len=st.integers(1, 200_000), head_dim=st.sampled_from([64, 128]),
       num_sms=st.integers(1, 200), max_splits=st.integers(1, MAX_KEY_SPLITS))
def test_key_splits_cover_every_key_tile_in_runs_no_shorter_than_the_minimum(num_ctas, max_seq_len, head_dim,
                                                                             num_sms, max_splits):
    splits = key_splits(num_ctas, max_seq_len, head_dim, num_sms, max_splits)
    num_tiles = math.ceil(max_seq_len / keys_per_tile(head_dim))
    if splits.num_splits == 1:
        return
    assert splits.num_splits * splits.tiles_per_split >= num_tiles > (splits.num_splits - 1) * splits.tiles_per_split
    assert splits.tiles_per_split * keys_per_tile(head_dim) >= MIN_KEYS_PER_SPLIT
    assert splits.num_splits <= max_splits
    if max_seq_len <= REFERENCE_KEYS:  # no more splits than a full wave needs
        assert num_ctas * (splits.num_splits - 1) < TARGET_CTAS_PER_SM * num_sms


def _split_attention(q, k, v, ctx_len, window, tiles_per_split, num_splits, block_n):
    """The kernels' schedule in NumPy: each (query tile, split) CTA reads the key tiles of its split that
    the tile can see and keeps (unnormalized output, max, sum) per row, as kvt_paged_context_attention
    does; each row combines the splits kvt_paged_context_reduce reads for it."""
    q_len = q.shape[0]
    out = np.zeros_like(q)
    for m0 in range(0, q_len, BLOCK_M):
        rows = min(BLOCK_M, q_len - m0)
        key_end, key_begin = ctx_len + m0 + rows, max(0, ctx_len + m0 - window + 1) if window else 0
        tile_begin, tile_end = key_begin // block_n, -(-key_end // block_n)
        partials = {}
        for split in range(num_splits):  # the main kernel's CTAs
            begin, end = max(tile_begin, split * tiles_per_split), tile_end
            if split < num_splits - 1:
                end = min(end, (split + 1) * tiles_per_split)
            if begin >= end:
                continue  # writes nothing
            keys = np.arange(begin * block_n, min(end * block_n, key_end))
            pos = ctx_len + m0 + np.arange(rows)[:, None]
            visible = (keys[None] <= pos) & ((keys[None] > pos - window) if window else True)
            s = np.where(visible, q[m0:m0 + rows] @ k[keys].T, -np.inf)
            row_max = s.max(axis=1)
            p = np.where(visible, np.exp(s - np.where(np.isinf(row_max), 0, row_max)[:, None]), 0)
            partials[split] = (p @ v[keys], row_max, p.sum(axis=1))
        split_of = lambda tile: min(tile // tiles_per_split, num_splits - 1)  # noqa: E731
        read = range(split_of(tile_begin), split_of(tile_end - 1) + 1)  # the reduce's splits
        assert set(read) == set(partials), "the reduce must read exactly the splits written for the tile"
        row_max = np.max([partials[s][1] for s in read], axis=0)
        weights = [np.where(partials[s][2] > 0, np.exp(partials[s][1] - row_max), 0) for s in read]
        total = sum(w * partials[s][2] for w, s in zip(weights, read))
        out[m0:m0 + rows] = sum(w[:, None] * partials[s][0] for w, s in zip(weights, read)) / total[:, None]
    return out


@settings(max_examples=60, deadline=None)
@given(ctx_len=st.integers(0, 700), q_len=st.integers(1, 300), window=st.sampled_from([0, 1, 40, 333]),
       num_splits=st.integers(1, 12), block_n=st.sampled_from([32, 64]), seed=st.integers(0, 2**16))
def test_the_key_split_schedule_gives_softmax_attention(ctx_len, q_len, window, num_splits, block_n, seed):
    rng = np.random.default_rng(seed)
    seq_len = ctx_len + q_len
    q, k, v = (rng.standard_normal((n, 8)) for n in (q_len, seq_len, seq_len))
    tiles_per_split = max(1, math.ceil(math.ceil(seq_len / block_n) / num_splits))
    ours = _split_attention(q, k, v, ctx_len, window, tiles_per_split, num_splits, block_n)
    pos = ctx_len + np.arange(q_len)[:, None]
    keys = np.arange(seq_len)[None]
    visible = (keys <= pos) & ((keys > pos - window) if window else True)
    s = np.where(visible, q @ k.T, -np.inf)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    np.testing.assert_allclose(ours, (p / p.sum(axis=1, keepdims=True)) @ v, rtol=1e-9, atol=1e-9)


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


def _run(library, sc, num_seqs: int, max_query_len: int | None = None, num_splits: int | None = None, **tensors):
    from kvtool.kernels.paged_context_attention import paged_context_attention

    base = _helpers()
    out = base.poisoned_like(sc.query)
    meta = {"block_tables": sc.meta.block_tables, "query_start_loc": sc.meta.query_start_loc,
            "seq_lens": sc.meta.seq_lens, **tensors}
    paged_context_attention(library, sc.query, sc.kv_cache, meta["block_tables"], meta["query_start_loc"],
                            meta["seq_lens"], num_seqs=num_seqs, max_query_len=max_query_len or sc.meta.max_query_len,
                            max_seq_len=sc.meta.max_seq_len, scale=sc.scale, sliding_window=sc.window, out=out,
                            num_splits=num_splits)
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


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("num_splits", [1, 2, 7, 40])
def test_key_splits_give_the_unsplit_rows(library, dtype, window, num_splits):
    # A 128-token question over a 2,048-token prefix (the e2e hit's shape), a 300-token prompt whose
    # causal tiles see fewer splits than the grid has, and a 1-token chunk: every row equals the
    # reference however the keys are split (40 splits: most CTAs of the short requests have no keys).
    base = _helpers()
    sc = base.build_scenario([(2048, 128), (0, 300), (77, 1)], num_context=3, num_heads=32, num_kv_heads=8,
                             head_dim=128, tokens_per_block=32, dtype=dtype, seed=num_splits, window=window)
    out = _run(library, sc, 3, num_splits=num_splits)
    base.assert_rows_match(out, base.reference_attention(sc), sc.rows(0, 3), dtype)


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_padded_graph_launch_with_key_splits_skips_padding_slots(library, dtype):
    # As the padded-bucket test above, with the keys split: padding slots (no query rows, seq_len 0)
    # and rows past the real tokens are never written by the reduce either.
    base = _helpers()
    sc = base.build_scenario([(2048, 100)], num_context=1, num_heads=32, num_kv_heads=8, head_dim=128,
                             tokens_per_block=32, dtype=dtype, seed=3)
    num_tokens = sc.query.shape[0]
    padded_query = torch.nn.functional.pad(sc.query, (0, 0, 0, 0, 0, 128 - num_tokens))
    sc_padded = type(sc)(**{**sc.__dict__, "query": padded_query})
    query_start_loc = torch.tensor([0, num_tokens, num_tokens], dtype=torch.int32, device="cuda")
    seq_lens = torch.cat([sc.meta.seq_lens, torch.zeros(1, dtype=torch.int32, device="cuda")])
    block_tables = torch.cat([sc.meta.block_tables,
                              torch.full((1, sc.meta.block_tables.shape[1]), -1, dtype=torch.int32, device="cuda")])
    out = _run(library, sc_padded, 2, max_query_len=128, num_splits=9, query_start_loc=query_start_loc,
               seq_lens=seq_lens, block_tables=block_tables)
    base.assert_rows_match(out[:num_tokens], base.reference_attention(sc), sc.rows(0, 1), dtype)
    assert torch.isnan(out[num_tokens:]).all(), "padding rows were written"
