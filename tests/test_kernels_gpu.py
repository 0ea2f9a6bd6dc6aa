"""kvtool's CUDA kernels against plain-torch references on fresh random inputs (needs a GPU + CuPy).

Every test poisons what the kernel must not rely on: outputs start NaN-filled (a row left
unwritten stays NaN), and every pool slot that holds no real token (blocks nobody owns, slots past
a sequence's end, blocks released by a sliding window) is NaN, so a stray read shows up as a NaN
in the result. References are computed in float64 from the same fp16/bf16 inputs, straight from
each sequence's logical K/V (no paging), and compared with per-dtype error bounds.

The scenario builder and the reference (tests/attention_scenarios.py) are checked on the CPU too:
tests/test_attention_oracle.py runs kvtool.layers.attention.TorchPagedAttention against them.
"""

from __future__ import annotations

import attention_scenarios as scenarios
import pytest
import torch
from attention_scenarios import (CONTEXT_SEQS, DTYPES, Scenario, assert_rows_match, decode_seqs, poisoned_like,
                                 reference_attention)

pytestmark = pytest.mark.gpu  # skipped, saying what is missing, without a CUDA GPU and CuPy (conftest.py)

DEVICE = "cuda"


@pytest.fixture(scope="module")
def library():
    from kvtool.kernels.loader import KernelLibrary

    return KernelLibrary()


# ---- random paged scenarios ----

def build_scenario(seqs: list[tuple[int, int]], **kwargs) -> Scenario:
    """attention_scenarios.build_scenario on the GPU."""
    return scenarios.build_scenario(seqs, device=DEVICE, **kwargs)


# ---- KV append ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens_per_block", [16, 32, 64, 128])
def test_kv_append_stores_each_token_at_its_slot_and_nothing_else(library, dtype, head_dim, tokens_per_block):
    from kvtool.kernels.kv_append import append_kv

    sc = build_scenario([(37, 90), (0, 5), (200, 1)], num_context=2, num_heads=8, num_kv_heads=2,
                        head_dim=head_dim, tokens_per_block=tokens_per_block, dtype=dtype, seed=11,
                        new_tokens_in_cache=False, strided_activations=True)
    slots = sc.meta.slot_mapping.clone()
    slots[3] = -1  # a padding token: must be skipped
    before = sc.pool.clone()
    append_kv(library, sc.new_key, sc.new_value, sc.kv_cache, slots)
    torch.cuda.synchronize()

    expected = before
    keep = slots >= 0
    blocks, offsets = slots[keep] // tokens_per_block, slots[keep] % tokens_per_block
    expected[blocks, sc.layer, 0, offsets] = sc.new_key[keep]
    expected[blocks, sc.layer, 1, offsets] = sc.new_value[keep]
    # Exact copy, NaNs where nothing was written: compare bit patterns.
    assert torch.equal(sc.pool.view(torch.int16), expected.view(torch.int16))


# ---- paged context attention ----

def _run_context(library, sc: Scenario, num_context: int) -> torch.Tensor:
    from kvtool.kernels.paged_context_attention import paged_context_attention

    out = poisoned_like(sc.query)
    paged_context_attention(library, sc.query, sc.kv_cache, sc.meta.block_tables, sc.meta.query_start_loc,
                            sc.meta.seq_lens, num_seqs=num_context, max_query_len=sc.meta.max_query_len,
                            max_seq_len=sc.meta.max_seq_len, scale=sc.scale, sliding_window=sc.window, out=out)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens_per_block", [16, 32, 64, 128])
def test_context_attention_over_cached_prefix_matches_reference(library, dtype, head_dim, tokens_per_block):
    seqs = CONTEXT_SEQS + [(50, 1), (7, 1)]  # two decode sequences the context kernel must not touch
    sc = build_scenario(seqs, num_context=len(CONTEXT_SEQS), num_heads=8, num_kv_heads=2, head_dim=head_dim,
                        tokens_per_block=tokens_per_block, dtype=dtype, seed=100 + head_dim + tokens_per_block)
    out = _run_context(library, sc, len(CONTEXT_SEQS))
    assert_rows_match(out, reference_attention(sc), sc.rows(0, len(CONTEXT_SEQS)), dtype)
    assert torch.isnan(out[sc.rows(len(CONTEXT_SEQS), len(seqs))]).all(), "decode rows were written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (14, 2), (16, 2), (8, 1)])
def test_context_attention_supports_gqa_groups(library, dtype, num_heads, num_kv_heads):
    sc = build_scenario([(64, 96), (0, 33), (250, 17)], num_context=3, num_heads=num_heads,
                        num_kv_heads=num_kv_heads, head_dim=128, tokens_per_block=16, dtype=dtype,
                        seed=7 * num_heads + num_kv_heads)
    out = _run_context(library, sc, 3)
    assert_rows_match(out, reference_attention(sc), sc.rows(0, 3), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 16, 50, 200, 4096])
@pytest.mark.parametrize("tokens_per_block", [16, 64])
def test_context_attention_with_sliding_window_never_reads_released_blocks(library, dtype, window,
                                                                           tokens_per_block):
    sc = build_scenario([(700, 150), (0, 90), (333, 64), (40, 3)], num_context=4, num_heads=8, num_kv_heads=2,
                        head_dim=128, tokens_per_block=tokens_per_block, dtype=dtype, seed=window, window=window)
    if window < 700:
        assert (sc.meta.block_tables[0] == -1).sum() > 1, "the scenario should release blocks"
    out = _run_context(library, sc, 4)
    assert_rows_match(out, reference_attention(sc), sc.rows(0, 4), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_context_attention_reads_strided_query_and_writes_strided_output(library, dtype):
    from kvtool.kernels.paged_context_attention import paged_context_attention

    sc = build_scenario([(90, 70), (0, 130)], num_context=2, num_heads=8, num_kv_heads=4, head_dim=64,
                        tokens_per_block=32, dtype=dtype, seed=5, strided_activations=True)
    assert not sc.query.is_contiguous()
    wide = torch.full((sc.query.shape[0], 2, 8, 64), float("nan"), dtype=dtype, device=DEVICE)
    out = wide[:, 1]  # [num_tokens, 8, 64] with a token stride of 2 * 8 * 64
    paged_context_attention(library, sc.query, sc.kv_cache, sc.meta.block_tables, sc.meta.query_start_loc,
                            sc.meta.seq_lens, num_seqs=2, max_query_len=sc.meta.max_query_len,
                            max_seq_len=sc.meta.max_seq_len, scale=sc.scale, sliding_window=None, out=out)
    torch.cuda.synchronize()
    assert_rows_match(out, reference_attention(sc), sc.rows(0, 2), dtype)
    assert torch.isnan(wide[:, 0]).all()


# ---- paged decode attention ----

def _run_decode(library, sc: Scenario, num_context: int, partition_size: int | None = None) -> torch.Tensor:
    from kvtool.kernels.paged_decode_attention import PARTITION_SIZE, paged_decode_attention

    out = poisoned_like(sc.query)
    paged_decode_attention(library, sc.query, sc.kv_cache, sc.meta.block_tables, sc.meta.query_start_loc,
                           sc.meta.seq_lens, seq_offset=num_context, num_seqs=sc.meta.num_seqs - num_context,
                           max_seq_len=sc.meta.max_seq_len, scale=sc.scale, sliding_window=sc.window, out=out,
                           partition_size=partition_size or PARTITION_SIZE)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens_per_block", [16, 32, 64, 128])
def test_decode_attention_matches_reference_across_split_k_partitions(library, dtype, head_dim, tokens_per_block):
    context = [(10, 20)]  # a context sequence first: the decode kernel must skip its rows
    seqs = context + decode_seqs(seed=head_dim + tokens_per_block, count=13, max_cached=3000)
    sc = build_scenario(seqs, num_context=1, num_heads=8, num_kv_heads=2, head_dim=head_dim,
                        tokens_per_block=tokens_per_block, dtype=dtype, seed=tokens_per_block)
    out = _run_decode(library, sc, num_context=1)
    assert_rows_match(out, reference_attention(sc), sc.rows(1, len(seqs)), dtype)
    assert torch.isnan(out[sc.rows(0, 1)]).all(), "context rows were written"


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_without_split_k_writes_the_output_directly(library, dtype):
    seqs = [(c, 1) for c in (0, 1, 17, 200, 511)]  # every sequence fits one partition
    sc = build_scenario(seqs, num_context=0, num_heads=8, num_kv_heads=2, head_dim=128, tokens_per_block=16,
                        dtype=dtype, seed=3)
    out = _run_decode(library, sc, num_context=0)
    assert_rows_match(out, reference_attention(sc), sc.rows(0, len(seqs)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_over_a_long_sequence_with_many_partitions(library, dtype):
    sc = build_scenario([(20000, 1), (3, 1)], num_context=0, num_heads=16, num_kv_heads=4, head_dim=128,
                        tokens_per_block=64, dtype=dtype, seed=9)
    out = _run_decode(library, sc, num_context=0)
    assert_rows_match(out, reference_attention(sc), sc.rows(0, 2), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (14, 2), (32, 8), (16, 1), (12, 1)])
def test_decode_attention_supports_gqa_groups(library, dtype, num_heads, num_kv_heads):
    sc = build_scenario(decode_seqs(seed=num_heads, count=6, max_cached=1500), num_context=0,
                        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=128, tokens_per_block=16,
                        dtype=dtype, seed=num_heads * 31 + num_kv_heads)
    out = _run_decode(library, sc, num_context=0)
    assert_rows_match(out, reference_attention(sc), sc.rows(0, sc.meta.num_seqs), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 16, 100, 700, 5000])
@pytest.mark.parametrize("tokens_per_block", [16, 128])
def test_decode_attention_with_sliding_window_never_reads_released_blocks(library, dtype, window,
                                                                          tokens_per_block):
    seqs = decode_seqs(seed=window, count=8, max_cached=2500)
    sc = build_scenario(seqs, num_context=0, num_heads=8, num_kv_heads=2, head_dim=64,
                        tokens_per_block=tokens_per_block, dtype=dtype, seed=window + 1, window=window)
    out = _run_decode(library, sc, num_context=0)
    assert_rows_match(out, reference_attention(sc), sc.rows(0, len(seqs)), dtype)


# ---- the backend: append + context + decode in one step ----

def _mixed_step(dtype, head_dim, tokens_per_block, window, seed):
    seqs = [(0, 150), (260, 40), (33, 1), (900, 1), (0, 1), (1500, 1)]
    return build_scenario(seqs, num_context=2, num_heads=16, num_kv_heads=4, head_dim=head_dim,
                          tokens_per_block=tokens_per_block, dtype=dtype, seed=seed, window=window,
                          new_tokens_in_cache=False, strided_activations=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,tokens_per_block,window", [(128, 16, None), (64, 32, None), (128, 64, 128)])
def test_cuda_backend_step_matches_reference(library, dtype, head_dim, tokens_per_block, window):
    from kvtool.layers.cuda_attention import CudaPagedAttention

    sc = _mixed_step(dtype, head_dim, tokens_per_block, window, seed=head_dim + tokens_per_block)
    out = CudaPagedAttention(library).forward(sc.query, sc.new_key, sc.new_value, sc.kv_cache, sc.meta,
                                              scale=sc.scale, sliding_window=window)
    torch.cuda.synchronize()
    assert_rows_match(out, reference_attention(sc), sc.rows(0, sc.meta.num_seqs), dtype)
    # The step's K/V landed in the cache at their slots.
    T = tokens_per_block
    slots = sc.meta.slot_mapping
    assert torch.equal(sc.kv_cache[slots // T, 0, slots % T], sc.new_key)
    assert torch.equal(sc.kv_cache[slots // T, 1, slots % T], sc.new_value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_backend_agrees_with_torch_backend(library, dtype):
    from kvtool.layers.attention import TorchPagedAttention
    from kvtool.layers.cuda_attention import CudaPagedAttention

    cuda_case = _mixed_step(dtype, 128, 16, None, seed=42)
    torch_case = _mixed_step(dtype, 128, 16, None, seed=42)
    cuda_out = CudaPagedAttention(library).forward(cuda_case.query, cuda_case.new_key, cuda_case.new_value,
                                                   cuda_case.kv_cache, cuda_case.meta, scale=cuda_case.scale,
                                                   sliding_window=None)
    torch_out = TorchPagedAttention().forward(torch_case.query, torch_case.new_key, torch_case.new_value,
                                              torch_case.kv_cache, torch_case.meta, scale=torch_case.scale,
                                              sliding_window=None)
    torch.cuda.synchronize()
    rows = cuda_case.rows(0, cuda_case.meta.num_seqs)
    # Both sides round to 16 bits: allow the sum of two kernels' errors.
    assert_rows_match(cuda_out, torch_out.float(), rows, dtype, slack=2.0)
    written = torch.isfinite(torch_case.pool)
    assert torch.equal(torch.isfinite(cuda_case.pool), written)
    assert torch.equal(cuda_case.pool[written], torch_case.pool[written])


def test_kernels_run_on_torch_current_stream(library):
    from kvtool.layers.cuda_attention import CudaPagedAttention

    sc = _mixed_step(torch.float16, 128, 16, None, seed=1)
    expected = reference_attention(sc)
    backend = CudaPagedAttention(library)
    # Compile and load the kernels first: a launch delayed by compilation would run after the
    # sleep below and read the real query whatever stream it ran on.
    backend.forward(sc.query, sc.new_key, sc.new_value, sc.kv_cache, sc.meta, scale=sc.scale, sliding_window=None)
    torch.cuda.synchronize()
    real_query = sc.query.clone()
    sc.query.zero_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the real query lands late on this stream...
        sc.query.copy_(real_query)
        # ...so a kernel launched anywhere but on `side` would read zeros.
        out = backend.forward(sc.query, sc.new_key, sc.new_value, sc.kv_cache, sc.meta, scale=sc.scale,
                              sliding_window=None)
    side.synchronize()
    assert_rows_match(out, expected, sc.rows(0, sc.meta.num_seqs), torch.float16)


# ---- block copy between the device pool and the pinned host pool ----

def _random_pool(num_blocks, dtype, *, device, seed, pinned=False):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_blocks, 3, 2, 16, 4, 64, generator=gen).to(dtype)  # [blocks, L, 2, T, KVH, D]
    return pool.pin_memory() if pinned else pool.to(device)


@pytest.mark.parametrize("method", ["kernel", "memcpy"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_copy_offloads_and_onboards_through_host_chunks(library, method, dtype):
    from kvtool.kernels.block_copy import copy_blocks

    device_pool = _random_pool(24, dtype, device=DEVICE, seed=1)
    # Host pool: 3 pinned chunks of 5 blocks (the last one shorter), NaN until written.
    host_chunks = [torch.full((n, 3, 2, 16, 4, 64), float("nan"), dtype=dtype).pin_memory() for n in (5, 5, 3)]
    # A run inside chunk 0, a single block into chunk 2, and a run across the chunk 0/1 boundary.
    offload_src, offload_dst = [3, 4, 5, 17, 8, 9], [0, 1, 2, 12, 4, 5]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    copy_blocks(device_pool, host_chunks, offload_src, offload_dst, stream, method=method, library=library)
    stream.synchronize()
    host_flat = torch.cat(host_chunks)
    for s, d in zip(offload_src, offload_dst):
        assert torch.equal(host_flat[d], device_pool[s].cpu())
    untouched = [b for b in range(13) if b not in offload_dst]
    assert torch.isnan(host_flat[untouched].float()).all()

    onboard_src, onboard_dst = [12, 0, 1, 2], [20, 7, 8, 9]
    target = torch.full_like(device_pool, float("nan"))
    stream.wait_stream(torch.cuda.current_stream())  # the fill runs on the default stream
    copy_blocks(host_chunks, target, onboard_src, onboard_dst, stream, method=method, library=library)
    stream.synchronize()
    for s, d in zip(onboard_src, onboard_dst):
        assert torch.equal(target[d].cpu(), host_flat[s])
    others = [b for b in range(24) if b not in onboard_dst]
    assert torch.isnan(target[others].float()).all()


@pytest.mark.parametrize("method", ["kernel", "memcpy"])
def test_block_copy_serves_the_runtime_host_pool(library, method):
    from kvtool.kernels.block_copy import copy_blocks
    from kvtool.runtime.kv_pool import BlockShape, HostBlockPool

    shape = BlockShape(num_layers=3, tokens_per_block=16, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    host = HostBlockPool(shape, num_blocks=40, pin_memory=True)
    device_pool = _random_pool(10, torch.bfloat16, device=DEVICE, seed=2)
    copy_blocks(device_pool, host, [1, 2, 9], [39, 0, 17], method=method, library=library)
    torch.cuda.synchronize()
    for s, d in zip([1, 2, 9], [39, 0, 17]):
        assert torch.equal(host.block(d), device_pool[s].cpu())


def test_block_copy_kernel_moves_more_blocks_than_one_grid_dimension_holds(library):
    from kvtool.kernels.block_copy import copy_blocks

    # 70,000 ops of 32-byte blocks: more than the 65,535 a grid's y or z dimension allows.
    num_blocks = 70_000
    src = torch.arange(num_blocks * 16, dtype=torch.int16, device=DEVICE).view(torch.float16).view(num_blocks, 16)
    dst = torch.zeros_like(src)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(4))
    copy_blocks(src, dst, list(range(num_blocks)), order.tolist(), method="kernel", library=library)
    torch.cuda.synchronize()
    assert torch.equal(dst[order.to(DEVICE)].view(torch.int16), src.view(torch.int16))


def test_block_copy_kernel_refuses_pageable_host_memory(library):
    from kvtool.kernels.block_copy import copy_blocks

    device_pool = _random_pool(4, torch.float16, device=DEVICE, seed=3)
    pageable = torch.zeros_like(device_pool, device="cpu")
    with pytest.raises(ValueError, match="pin"):
        copy_blocks(device_pool, pageable, [0], [0], method="kernel", library=library)


def test_cuda_backend_hands_shapes_without_a_kernel_to_the_torch_backend(library):
    from kvtool.layers.cuda_attention import CudaPagedAttention

    sc = build_scenario([(20, 30), (9, 1)], num_context=1, num_heads=4, num_kv_heads=2, head_dim=32,
                        tokens_per_block=16, dtype=torch.float32, seed=4, new_tokens_in_cache=False)
    backend = CudaPagedAttention(library)
    assert not backend.supports(sc.kv_cache)
    out = backend.forward(sc.query, sc.new_key, sc.new_value, sc.kv_cache, sc.meta, scale=sc.scale,
                          sliding_window=None)
    torch.testing.assert_close(out.float(), reference_attention(sc), atol=1e-4, rtol=1e-4)
