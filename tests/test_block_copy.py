"""Host-side planning of batched block copies (no GPU needed): which addresses the copy kernel gets."""

from __future__ import annotations

import pytest
import torch

from kvtool.kernels import block_copy
from kvtool.kernels.block_copy import CopyRun, _Pool, coalesce_runs
from kvtool.runtime.kv_pool import BlockShape, HostBlockPool


@pytest.fixture
def host_addresses(monkeypatch):
    # The kernel path maps pinned host memory; CPU tensors stand in here, at their own addresses.
    monkeypatch.setattr(block_copy, "_device_address", lambda tensor, name: tensor.data_ptr())


def _bytes(block: torch.Tensor) -> int:
    return block.numel() * block.element_size()


@pytest.mark.parametrize("form", ["tensor", "chunks", "host_pool"])
def test_block_addresses_match_each_blocks_own_view(host_addresses, form):
    shape = BlockShape(num_layers=2, tokens_per_block=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    if form == "tensor":
        pool = torch.zeros(11, *shape.dims, dtype=shape.dtype)
    elif form == "chunks":
        pool = [torch.zeros(n, *shape.dims, dtype=shape.dtype) for n in (4, 4, 3)]
    else:
        pool = HostBlockPool(shape, num_blocks=11, pin_memory=False)
        pool.blocks_per_chunk = 4  # several chunks without allocating 64 MiB each
        pool._chunks = [None] * 3
    view = _Pool.of(pool, "pool")
    block_ids = [10, 0, 5, 4, 3, 8, 5]
    addresses = view.block_addresses(block_ids, shape.num_bytes, "pool")
    assert addresses.tolist() == [view.block(b).data_ptr() for b in block_ids]


def test_block_addresses_refuse_ids_outside_the_pool(host_addresses):
    chunks = [torch.zeros(4, 2, 8, dtype=torch.float16) for _ in range(2)]
    with pytest.raises(ValueError, match="chunk 2"):
        _Pool.of(chunks, "dst_pool").block_addresses([1, 9], _bytes(chunks[0][0]), "dst_pool")
    pool = torch.zeros(3, 2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="block id 3 is out of range"):
        _Pool.of(pool, "src_pool").block_addresses([0, 3], _bytes(pool[0]), "src_pool")
    with pytest.raises(ValueError, match="negative"):
        _Pool.of(pool, "src_pool").block_addresses([-1], _bytes(pool[0]), "src_pool")


def test_block_addresses_refuse_blocks_that_are_not_back_to_back(host_addresses):
    strided = torch.zeros(4, 2, 16, dtype=torch.float16)[:, :, :8]  # [4, 2, 8] views with gaps
    with pytest.raises(ValueError, match="contiguous"):
        _Pool.of(strided, "src_pool").block_addresses([0, 1], 32, "src_pool")


def test_block_copy_coalesces_consecutive_ids_into_runs():
    runs = coalesce_runs([4, 5, 6, 9, 2, 3], [10, 11, 12, 13, 0, 7])
    assert runs == [CopyRun(4, 10, 3), CopyRun(9, 13, 1), CopyRun(2, 0, 1), CopyRun(3, 7, 1)]
    assert coalesce_runs([], []) == []
    with pytest.raises(ValueError, match="same length"):
        coalesce_runs([1, 2], [3])


def test_copy_engine_runs_join_blocks_back_to_back_on_both_sides():
    from kvtool.kernels.block_copy import dma_runs

    size = 4096
    # Blocks 0,1,2 -> 7,8,9 (one run), then a jump on the source side, then one on the destination side.
    src = [1_000_000 + i * size for i in (0, 1, 2, 5, 6)]
    dst = [2_000_000 + i * size for i in (7, 8, 9, 10, 20)]
    assert dma_runs(src, dst, size).tolist() == [[1_000_000, 2_000_000 + 7 * size, 3],
                                                 [1_000_000 + 5 * size, 2_000_000 + 10 * size, 1],
                                                 [1_000_000 + 6 * size, 2_000_000 + 20 * size, 1]]
    assert dma_runs([], [], size).shape == (0, 3)
    with pytest.raises(ValueError, match="equal-length"):
        dma_runs([1, 2], [3], size)


def test_consecutive_ids_across_a_host_chunk_boundary_are_two_transfers():
    from kvtool.kernels.block_copy import dma_runs

    shape = BlockShape(num_layers=2, tokens_per_block=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    host = HostBlockPool(shape, num_blocks=8, pin_memory=False)
    host.blocks_per_chunk = 4
    host._chunks = [None] * 2
    view = _Pool.of(host, "dst_pool")
    raw = lambda tensor, name: tensor.data_ptr()  # noqa: E731 - the copy engines take host addresses as they are
    dst = view.block_addresses([2, 3, 4, 5], shape.num_bytes, "dst_pool", raw)
    src = [i * shape.num_bytes for i in range(4)]
    runs = dma_runs(src, dst, shape.num_bytes)
    assert runs[:, 2].tolist() == [2, 2]  # blocks 2-3 in chunk 0, blocks 4-5 in chunk 1
    assert runs[1, 1] == host.block(4).data_ptr()


def test_a_run_never_spans_two_host_chunks_even_when_they_sit_back_to_back(monkeypatch):
    # Two separately allocated chunks can be adjacent in memory; one transfer must stay inside one
    # allocation, so blocks 2-5 (chunk 0: 2, 3; chunk 1: 4, 5) are two transfers all the same.
    memory = torch.zeros(8, 2, 8, dtype=torch.float16)  # 32-byte blocks
    host_chunks = [memory[:4], memory[4:]]
    device_pool = torch.zeros(8, 2, 8, dtype=torch.float16)
    monkeypatch.setattr(block_copy, "_resolve_pools", lambda s, d, a, b: (_Pool.of(s, "src_pool"),
                                                                          _Pool.of(d, "dst_pool"), None, 32))
    offload = block_copy.prepare_dma_copy(device_pool, host_chunks, [0, 1, 2, 3], [2, 3, 4, 5])
    base, host = device_pool.data_ptr(), memory.data_ptr()
    assert offload.runs.tolist() == [[base, host + 2 * 32, 2], [base + 2 * 32, host + 4 * 32, 2]]
    onboard = block_copy.prepare_dma_copy(host_chunks, device_pool, [2, 3, 4, 5], [0, 1, 2, 3])
    assert onboard.runs[:, 2].tolist() == [2, 2]
    within = block_copy.prepare_dma_copy(device_pool, host_chunks, [0, 1, 2], [4, 5, 6])
    assert within.runs[:, 2].tolist() == [3]


def test_copies_descending_on_both_sides_join_into_one_transfer(monkeypatch):
    # Blocks freed last-in first-out come back in descending order: 7, 6, 5 -> 12, 11, 10 is one run.
    pool = torch.zeros(16, 2, 8, dtype=torch.float16)
    monkeypatch.setattr(block_copy, "_resolve_pools", lambda s, d, a, b: (_Pool.of(s, "src_pool"),
                                                                          _Pool.of(d, "dst_pool"), None, 32))
    copy = block_copy.prepare_dma_copy(pool, pool, [7, 6, 5, 1], [12, 11, 10, 3])
    base = pool.data_ptr()
    assert copy.runs.tolist() == [[base + 1 * 32, base + 3 * 32, 1], [base + 5 * 32, base + 10 * 32, 3]]
