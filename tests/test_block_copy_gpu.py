"""Block copies on the copy engines (cudaMemcpyAsync / cudaMemcpy2DAsync per run of blocks) between the
device pool and the pinned host pool, on a GPU (marked gpu; skipped without one): one layer's slice of
every block, a step's offloads and onboards layer by layer on two streams, the same blocks as the SM
copy kernel moves. Which runs and transfers are planned is checked on any machine in
tests/test_block_copy.py and tests/test_kv_pool.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtool._core import PoolKind
from kvtool.runtime.kv_pool import BlockShape, HostBlockPool, KvCachePools


pytestmark = pytest.mark.gpu  # skipped, saying what is missing, without a CUDA GPU and CuPy (conftest.py)
SHAPE = BlockShape(num_layers=3, tokens_per_block=16, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
PRIMARY, SECONDARY = PoolKind.PRIMARY.value, PoolKind.SECONDARY.value


@pytest.fixture(scope="module")
def library():
    from kvtool.kernels.loader import KernelLibrary

    return KernelLibrary()


def test_one_layers_slice_of_every_block_moves_and_nothing_else(library):
    from kvtool.kernels.block_copy import prepare_dma_copy

    gen = torch.Generator().manual_seed(0)
    device_pool = torch.randn(12, *SHAPE.dims, generator=gen).to(SHAPE.dtype).cuda()
    # Chunks of 4 blocks: the ids below make runs inside a chunk and across a chunk boundary.
    host = HostBlockPool(SHAPE, num_blocks=12, pin_memory=True, chunk_bytes=4 * SHAPE.num_bytes)
    for chunk in range(3):
        host.chunk(chunk).fill_(float("nan"))
    src, dst = [0, 1, 2, 3, 7, 9], [2, 3, 4, 5, 0, 11]
    copy = prepare_dma_copy(device_pool, host, src, dst)
    assert copy.runs[:, 2].tolist() == [2, 2, 1, 1]  # 0-1 -> 2-3, 2-3 -> 4-5 (next chunk), 7, 9
    layer_bytes = SHAPE.num_bytes // SHAPE.num_layers
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        copy.launch(layer_bytes, layer_bytes)  # layer 1 only: a 2-D copy per run
    stream.synchronize()
    for s, d in zip(src, dst):
        block = host.block(d)
        assert torch.equal(block[1], device_pool[s, 1].cpu())
        assert torch.isnan(block[0].float()).all() and torch.isnan(block[2].float()).all()
    with pytest.raises(ValueError, match="inside the"):
        copy.launch(layer_bytes, 3 * layer_bytes)


@pytest.mark.parametrize("copy_method", ["memcpy", "kernel"])
def test_a_step_of_offloads_and_onboards_lands_layer_by_layer_with_either_method(library, copy_method):
    # 8 blocks offloaded from the device, then 8 onboarded into the blocks they freed: the A,B,A,B step.
    pools = KvCachePools(SHAPE, num_primary_blocks=16, num_secondary_blocks=32, device=torch.device("cuda"),
                         kernels=library, layered_copy_min_bytes=1, copy_method=copy_method)
    gen = torch.Generator().manual_seed(1)
    pools.primary.copy_(torch.randn(pools.primary.shape, generator=gen).to(SHAPE.dtype))
    for block in range(16, 24):
        pools.host.block(block).copy_(torch.randn(SHAPE.dims, generator=gen).to(SHAPE.dtype))
    expected_host = {h: pools.primary[p].cpu() for p, h in zip(range(8), range(8))}
    expected_device = {p: pools.host.block(h).clone() for p, h in zip(range(8), range(16, 24))}
    ops = [(PRIMARY, p, SECONDARY, p, 16) for p in range(8)] + [(SECONDARY, 16 + p, PRIMARY, p, 16) for p in range(8)]
    src_pool, src, dst_pool, dst, tokens = (np.array(column) for column in zip(*ops))
    pools.execute_copies(src_pool, src, dst_pool, dst, tokens)
    assert pools.copies_pending_per_layer  # one run each way: layered
    for layer in range(SHAPE.num_layers):
        pools.wait_for_layer(layer)
    pools.wait_for_all_copies()
    torch.cuda.synchronize()
    for h, block in expected_host.items():
        assert torch.equal(pools.host.block(h), block)
    for p, block in expected_device.items():
        assert torch.equal(pools.primary[p].cpu(), block)
