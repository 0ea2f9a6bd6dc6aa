"""KV pools: sizing, the lazily allocated host pool, and executing the manager's copy operations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtool import LLM, KvCacheConfig, SamplingParams
from kvtool.errors import KvtoolError
from kvtool.runtime.device import available_host_memory_bytes
from kvtool.runtime.copy_batches import copy_batches
from kvtool._core import PoolKind
from kvtool.runtime.kv_pool import BlockShape, KvCachePools, offloads_then_onboards

# The values the cache manager's copy-op arrays hold.
PRIMARY, SECONDARY = PoolKind.PRIMARY.value, PoolKind.SECONDARY.value
SHAPE = BlockShape(num_layers=2, tokens_per_block=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def test_cpu_primary_pool_lies_layer_by_layer_each_head_after_the_other():
    # Decode attention reads a layer's blocks of a sequence a KV head at a time: on the CPU, in that order.
    pools = KvCachePools(SHAPE, num_primary_blocks=4, num_secondary_blocks=4, device=torch.device("cpu"))
    layers = pools.layer_caches()
    _, kv, tokens, heads, head_dim = SHAPE.dims
    # [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim]: block, keys to values, token, head.
    assert layers[0].stride() == (kv * tokens * heads * head_dim, tokens * heads * head_dim, head_dim,
                                  tokens * head_dim, 1)
    assert layers[1].data_ptr() == layers[0].data_ptr() + 4 * SHAPE.num_bytes // SHAPE.num_layers
    block = torch.arange(SHAPE.num_bytes // 4, dtype=torch.float32).view(SHAPE.dims)
    pools.primary[2] = block
    assert torch.equal(layers[1][2], block[1])
    offload_then_onboard = [(PRIMARY, 2, SECONDARY, 3, 4), (SECONDARY, 3, PRIMARY, 0, 4)]
    pools.execute_copies(*(np.array(column) for column in zip(*offload_then_onboard)))
    assert torch.equal(pools.host.block(3), block) and torch.equal(pools.primary[0], block)


def test_host_pool_is_allocated_only_as_blocks_are_offloaded():
    pools = KvCachePools(SHAPE, num_primary_blocks=4, num_secondary_blocks=1_000_000, device=torch.device("cpu"))
    assert pools.host.num_allocated_bytes == 0
    pools.primary[2] = 7.0
    pools.execute_copies(np.array([PRIMARY]), np.array([2]), np.array([SECONDARY]), np.array([123_456]),
                         np.array([4]))
    assert 0 < pools.host.num_allocated_bytes < 1_000_000 * SHAPE.num_bytes
    assert torch.equal(pools.host.block(123_456), pools.primary[2])


def test_copies_run_in_order_and_partial_copies_touch_only_their_tokens():
    pools = KvCachePools(SHAPE, num_primary_blocks=4, num_secondary_blocks=4, device=torch.device("cpu"))
    pools.primary[0] = 1.0
    pools.primary[1] = 2.0
    # Offload block 0, overwrite it with block 1 (an onboard into the freed block would do this),
    # then bring the offloaded copy back into block 3; finally copy 2 tokens of block 1 into block 2.
    ops = [(PRIMARY, 0, SECONDARY, 3, 4), (PRIMARY, 1, PRIMARY, 0, 4), (SECONDARY, 3, PRIMARY, 3, 4),
           (PRIMARY, 1, PRIMARY, 2, 2)]
    src_pool, src, dst_pool, dst, num_tokens = (np.array(column) for column in zip(*ops))
    pools.execute_copies(src_pool, src, dst_pool, dst, num_tokens)
    assert torch.all(pools.primary[0] == 2.0) and torch.all(pools.primary[3] == 1.0)
    assert torch.all(pools.primary[2][:, :, :2] == 2.0) and torch.all(pools.primary[2][:, :, 2:] == 0.0)


@pytest.mark.parametrize("layered", [False, True])
def test_a_steps_copies_give_the_same_blocks_whole_or_layer_by_layer(layered):
    # Layer by layer is how a large step's copies run on a GPU (each layer's attention waits only
    # for its own layer); on the CPU the same slicing runs synchronously.
    pools = KvCachePools(SHAPE, num_primary_blocks=6, num_secondary_blocks=6, device=torch.device("cpu"))
    pools.layered_copy_min_bytes = 0 if layered else None
    generator = torch.Generator().manual_seed(0)
    pools.primary.copy_(torch.randn(pools.primary.shape, generator=generator))
    for block in range(6):
        pools.host.block(block).copy_(torch.randn(SHAPE.dims, generator=generator))
    primary_before, host_before = pools.primary.clone(), torch.stack([pools.host.block(b).clone() for b in range(6)])
    # The A,B,A,B shape (offload a block, onboard into it, ...) plus a partial copy-on-write.
    ops = [(PRIMARY, 0, SECONDARY, 4, 4), (SECONDARY, 1, PRIMARY, 0, 4), (PRIMARY, 2, SECONDARY, 5, 4),
           (SECONDARY, 4, PRIMARY, 2, 4), (PRIMARY, 3, PRIMARY, 5, 3)]
    src_pool, src, dst_pool, dst, num_tokens = (np.array(column) for column in zip(*ops))
    pools.execute_copies(src_pool, src, dst_pool, dst, num_tokens)
    assert not pools.copies_pending_per_layer  # nothing is left in flight on a CPU
    assert torch.equal(pools.host.block(4), primary_before[0]) and torch.equal(pools.host.block(5), primary_before[2])
    assert torch.equal(pools.primary[0], host_before[1])
    assert torch.equal(pools.primary[2], primary_before[0])  # onboarded from host block 4, written just before
    assert torch.equal(pools.primary[5][:, :, :3], primary_before[3][:, :, :3])
    assert torch.equal(pools.primary[5][:, :, 3:], primary_before[5][:, :, 3:])


class RecordCopies(torch.overrides.TorchFunctionMode):
    """Records (destination, source) for every Tensor.copy_."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            self.calls.append((args[0], args[1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layered", [False, True])
def test_partial_copies_move_contiguous_pieces_of_host_memory_only(layered):
    # A strided view of host memory would be gathered on the CPU at call time: on a GPU, before
    # an offload queued earlier in the step has written that host block. (The CPU's primary pool is
    # itself strided, and its copies synchronous.)
    pools = KvCachePools(SHAPE, num_primary_blocks=4, num_secondary_blocks=4, device=torch.device("cpu"))
    pools.layered_copy_min_bytes = 0 if layered else None
    pools.primary[3] = 5.0
    ops = [(PRIMARY, 3, SECONDARY, 0, 4), (SECONDARY, 0, PRIMARY, 1, 3)]  # offload, then a partial onboard
    with RecordCopies() as recorder:
        pools.execute_copies(*(np.array(column) for column in zip(*ops)))
    primary = pools.primary.untyped_storage().data_ptr()
    host_pieces = [t for call in recorder.calls for t in call if t.untyped_storage().data_ptr() != primary]
    assert len(host_pieces) == len(recorder.calls) > 0 and all(t.is_contiguous() for t in host_pieces)
    assert torch.all(pools.primary[1][:, :, :3] == 5.0) and torch.all(pools.primary[1][:, :, 3:] == 0.0)


def batches_of(ops):
    return copy_batches(*(np.array(column) for column in zip(*ops)))


def test_only_an_offload_wave_then_an_onboard_wave_splits_over_two_streams():
    swap = [(PRIMARY, 0, SECONDARY, 4, 4), (SECONDARY, 1, PRIMARY, 0, 4), (PRIMARY, 2, SECONDARY, 5, 4),
            (SECONDARY, 3, PRIMARY, 2, 4)]
    assert offloads_then_onboards(batches_of(swap))
    assert not offloads_then_onboards(batches_of(swap[:1]))  # offloads only: one stream does
    # An onboard that waits for nothing joins the first wave: the waves no longer split by direction.
    assert not offloads_then_onboards(batches_of(swap + [(SECONDARY, 6, PRIMARY, 7, 4)]))
    # A host block read by an onboard and then overwritten by an offload: a third wave.
    assert not offloads_then_onboards(batches_of(swap + [(PRIMARY, 7, SECONDARY, 1, 4)]))


def test_host_cache_larger_than_available_memory_is_refused_with_both_numbers():
    too_big = available_host_memory_bytes() * 4
    with pytest.raises(KvtoolError, match=f"{too_big:,}") as error:
        LLM(model="preset:tiny-llama", kv_cache_config=KvCacheConfig(host_cache_size=too_big))
    assert "available" in str(error.value)


def test_start_up_does_not_grow_with_host_cache_size():
    llm = LLM(model="preset:tiny-llama", kv_cache_config=KvCacheConfig(host_cache_size=2 << 30))
    assert llm.engine.executor.pools.host.num_allocated_bytes == 0
    llm.generate([5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
    assert llm.engine.executor.pools.host.num_allocated_bytes == 0  # nothing was evicted


def test_host_chunks_are_allocated_ahead_of_the_chunk_in_use_on_a_background_thread():
    from kvtool.runtime.kv_pool import HostBlockPool

    pool = HostBlockPool(SHAPE, num_blocks=10, pin_memory=False, ahead_chunks=2, chunk_bytes=2 * SHAPE.num_bytes)
    for future in list(pool._pending.values()):
        future.result()
    assert [c is not None for c in pool._chunks] == [True, True, False, False, False]
    ahead = pool._chunks[1]
    assert pool.block(3).data_ptr() == ahead[1].data_ptr()  # the chunk allocated ahead, not a new one
    for future in list(pool._pending.values()):
        future.result()
    assert [c is not None for c in pool._chunks] == [True, True, True, True, False]  # two after chunk 1
    pool.block(9)  # the last chunk: nothing lies beyond it
    assert all(c is not None for c in pool._chunks) and not any(f.running() for f in pool._pending.values())
    assert pool.num_allocated_bytes == 10 * SHAPE.num_bytes


def test_only_a_pinned_host_pool_allocates_ahead():
    from kvtool.runtime.kv_pool import HOST_AHEAD_BYTES, HostBlockPool

    assert HostBlockPool(SHAPE, num_blocks=100, pin_memory=False).ahead_chunks == 0
    # A pinned pool (a GPU machine) of qwen3-8b blocks: chunks of 13 blocks of 4.7 MB, 1 GiB ahead.
    big = BlockShape(num_layers=36, tokens_per_block=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    chunk_bytes = (64 << 20) // big.num_bytes * big.num_bytes
    assert -(-HOST_AHEAD_BYTES // chunk_bytes) == 17


class FakeKernels:
    """Stands in for a KernelLibrary: marks the pools as a GPU's (batched copies between tiers)."""


def test_a_large_step_with_few_runs_moves_on_the_copy_engines_and_a_scattered_one_by_the_copy_kernel():
    pools = KvCachePools(SHAPE, num_primary_blocks=200, num_secondary_blocks=200, device=torch.device("cpu"),
                         layered_copy_min_bytes=1)
    pools._kernels = FakeKernels()  # decide as on a GPU with the copy engines
    consecutive = copy_batches(np.full(64, PRIMARY), np.arange(64), np.full(64, SECONDARY), np.arange(100, 164),
                               np.full(64, 4))
    scattered = copy_batches(np.full(64, PRIMARY), np.arange(0, 128, 2), np.full(64, SECONDARY), np.arange(64),
                             np.full(64, 4))
    assert pools.copies_layer_by_layer(consecutive) and pools.copies_layer_by_layer(scattered)
    assert pools.step_copy_method(consecutive, layered=True) == "memcpy"  # one transfer per layer
    assert pools.step_copy_method(scattered, layered=True) == "kernel"  # 64 per layer: one launch instead
    assert pools.step_copy_method(scattered, layered=False) == "memcpy"  # whole blocks: 64 transfers once
    pools._kernels = None  # the CPU: torch copies, as before
    assert pools.step_copy_method(scattered, layered=True) == "memcpy"


def test_with_cuda_graphs_a_step_copies_layer_by_layer_only_from_a_gigabyte():
    # A layered step runs eagerly: with graphs it pays only when its copies outlast an eager step's
    # host time. qwen3-8b blocks (4.7 MB): the card's 1k-token onboard + offload (60 blocks) moves
    # whole; a 4k-token A,B,A,B swap (250 blocks, 1.2 GB) still layer by layer.
    from kvtool.runtime.kv_pool import LAYERED_COPY_MIN_BYTES, LAYERED_COPY_MIN_BYTES_WITH_GRAPHS

    big = BlockShape(num_layers=36, tokens_per_block=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)

    def swap(num_blocks):
        return copy_batches(np.full(num_blocks, PRIMARY), np.arange(num_blocks), np.full(num_blocks, SECONDARY),
                            np.arange(num_blocks), np.full(num_blocks, 32))

    for graphs, expected in ((True, LAYERED_COPY_MIN_BYTES_WITH_GRAPHS), (False, LAYERED_COPY_MIN_BYTES)):
        pools = KvCachePools(big, num_primary_blocks=1, num_secondary_blocks=0, device=torch.device("cpu"),
                             kernels=FakeKernels(), cuda_graphs=graphs)
        assert pools.layered_copy_min_bytes == expected
        assert pools.copies_layer_by_layer(swap(250))
        assert pools.copies_layer_by_layer(swap(60)) is not graphs
    explicit = KvCachePools(big, 1, 0, torch.device("cpu"), kernels=FakeKernels(), cuda_graphs=True,
                            layered_copy_min_bytes=0)
    assert explicit.copies_layer_by_layer(swap(1))  # the user's setting wins


def test_layer_slices_cover_every_layer_once_in_order():
    from kvtool.runtime.kv_pool import layer_slices

    assert layer_slices(36, 4) == [(0, 9), (9, 18), (18, 27), (27, 36)]
    assert layer_slices(30, 4) == [(0, 7), (7, 15), (15, 22), (22, 30)]
    assert layer_slices(2, 4) == [(0, 1), (1, 2)]  # no empty slice
    assert layer_slices(36, 36) == [(layer, layer + 1) for layer in range(36)]


def test_a_whole_swap_with_few_runs_moves_both_directions_side_by_side():
    # Offloads that free the blocks the onboards fill: in 4 slices of layers on two streams (the
    # H100 moved 91 GB/s so, 55 on one stream). Scattered ids (one transfer per block, 64 a slice)
    # stay one wave after the other, issued once; so do a lone wave and partial blocks.
    from kvtool.runtime.kv_pool import MAX_LAYERED_DMA_RUNS

    pools = KvCachePools(SHAPE, num_primary_blocks=200, num_secondary_blocks=200, device=torch.device("cpu"),
                         kernels=FakeKernels())

    def swap(primary_ids, num_tokens=4):
        n = len(primary_ids)
        return copy_batches(np.concatenate([np.full(n, PRIMARY), np.full(n, SECONDARY)]),
                            np.concatenate([primary_ids, np.arange(100, 100 + n)]),
                            np.concatenate([np.full(n, SECONDARY), np.full(n, PRIMARY)]),
                            np.concatenate([np.arange(n), primary_ids]), np.full(2 * n, num_tokens))

    consecutive, scattered = swap(np.arange(40)), swap(np.arange(0, 2 * (MAX_LAYERED_DMA_RUNS + 1), 2))
    assert pools.copies_overlap_in_slices(consecutive)
    assert not pools.copies_overlap_in_slices(scattered)
    assert not pools.copies_overlap_in_slices(swap(np.arange(40), num_tokens=2))  # partial blocks
    offload_only = copy_batches(np.full(4, PRIMARY), np.arange(4), np.full(4, SECONDARY), np.arange(4),
                                np.full(4, 4))
    assert not pools.copies_overlap_in_slices(offload_only)
