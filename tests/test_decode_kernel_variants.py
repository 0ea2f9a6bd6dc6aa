"""The decode kernel's tuning knobs keep its results: partition sizes (down to the 64 keys a batch of one
chooses) and loads in flight per thread (``partition_size``, ``unroll``) against the float64
reference, a split-K grid sized for a far longer sequence than any in the batch (what a CUDA graph
captured for ``max_seq_len`` launches), and a graph's padding slots (seq_len 0) left unwritten."""

from __future__ import annotations

import pytest
import torch
from attention_scenarios import DTYPES, assert_rows_match, decode_seqs, poisoned_like, reference_attention
from test_kernels_gpu import build_scenario
from test_kernels_gpu import library  # noqa: F401 - the fixture

from kvtool.kernels.compiler import KernelCompiler, find_nvcc
from kvtool.kernels.paged_decode_attention import decode_attention_spec


def _run(library, sc, *, max_seq_len: int, **knobs) -> torch.Tensor:  # noqa: F811 - library is the fixture
    from kvtool.kernels.paged_decode_attention import paged_decode_attention

    out = poisoned_like(sc.query)
    paged_decode_attention(library, sc.query, sc.kv_cache, sc.meta.block_tables, sc.meta.query_start_loc,
                           sc.meta.seq_lens, seq_offset=0, num_seqs=sc.meta.num_seqs, max_seq_len=max_seq_len,
                           scale=sc.scale, sliding_window=sc.window, out=out, **knobs)
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu  # the kernels load and launch through CuPy: skipped without a GPU or CuPy
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partition_size", [64, 128, 256, 512, 1024])
@pytest.mark.parametrize("unroll", [2, 8])
def test_decode_partition_size_and_unroll_keep_the_result(library, dtype, partition_size, unroll):  # noqa: F811
    seqs = decode_seqs(seed=partition_size + unroll, count=11, max_cached=3000)
    sc = build_scenario(seqs, num_context=0, num_heads=32, num_kv_heads=8, head_dim=128, tokens_per_block=16,
                        dtype=dtype, seed=unroll)
    out = _run(library, sc, max_seq_len=sc.meta.max_seq_len, partition_size=partition_size, unroll=unroll)
    assert_rows_match(out, reference_attention(sc), sc.rows(0, len(seqs)), dtype)


@pytest.mark.gpu  # the kernels load and launch through CuPy: skipped without a GPU or CuPy
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_grid_sized_for_a_longer_sequence_than_any_in_the_batch_gives_the_same_result(library, dtype):  # noqa: F811
    seqs = [(c, 1) for c in (0, 5, 700, 1500)]
    sc = build_scenario(seqs, num_context=0, num_heads=8, num_kv_heads=2, head_dim=128, tokens_per_block=32,
                        dtype=dtype, seed=4)
    out = _run(library, sc, max_seq_len=40960)  # 80 partitions; the longest sequence fills 3
    assert_rows_match(out, reference_attention(sc), sc.rows(0, len(seqs)), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partition_size", [64, 512])
def test_padding_slots_with_no_tokens_are_skipped_and_their_rows_left_unwritten(library, dtype, partition_size):  # noqa: F811
    # Slots 1 and 3 are a mixed graph's padding: seq_len 0, their query_start_loc pointing at a row
    # that is not theirs (here row 0, a real row: it must keep its own result).
    seqs = [(700, 1), (0, 1), (1500, 1), (0, 1)]
    sc = build_scenario(seqs, num_context=0, num_heads=8, num_kv_heads=2, head_dim=128, tokens_per_block=32,
                        dtype=dtype, seed=partition_size)
    expected = reference_attention(sc)
    sc.meta.seq_lens[[1, 3]] = 0
    sc.meta.query_start_loc[[1, 3]] = 0
    out = _run(library, sc, max_seq_len=4096, partition_size=partition_size)
    assert_rows_match(out, expected, torch.tensor([0, 2], device="cuda"), dtype)
    assert torch.isnan(out[[1, 3]]).all(), "a padding slot wrote a row"


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc is not installed")
@pytest.mark.parametrize("unroll", [2, 8])
def test_decode_unroll_variants_compile(tmp_path, unroll):
    compiler = KernelCompiler(cache_dir=tmp_path)
    for partition_size in (256, 1024):
        compiler.compile(decode_attention_spec(128, 16, torch.bfloat16, 4, "sm_90", partition_size, unroll))


def test_decode_unroll_outside_the_compiled_choices_is_refused():
    with pytest.raises(ValueError, match="unroll"):
        decode_attention_spec(128, 16, torch.bfloat16, 4, "sm_90", 512, 3)
