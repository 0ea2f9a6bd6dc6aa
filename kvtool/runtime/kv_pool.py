"""The KV cache tensors: a primary pool on the device and a lazily allocated host (secondary) pool.

The C++ cache manager decides which block lives where and emits copy operations; this module
only holds the memory and executes those copies. A block is one contiguous slab across all
layers (block-major layout), so moving a block between tiers is a single copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtool.errors import KvtoolError
from kvtool.runtime.copy_batches import copy_batches
from kvtool.runtime.device import available_host_memory_bytes

PRIMARY = 0
SECONDARY = 1
HOST_CHUNK_BYTES = 64 << 20  # the host pool grows in chunks of about this size


@dataclass(frozen=True)
class BlockShape:
    num_layers: int
    tokens_per_block: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def dims(self) -> tuple[int, ...]:
        # [num_layers, 2 (K, V), tokens_per_block, num_kv_heads, head_dim]
        return (self.num_layers, 2, self.tokens_per_block, self.num_kv_heads, self.head_dim)

    @property
    def num_bytes(self) -> int:
        elements = self.num_layers * 2 * self.tokens_per_block * self.num_kv_heads * self.head_dim
        return elements * torch.tensor([], dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.num_bytes // self.tokens_per_block


class HostBlockPool:
    """Secondary pool in host memory, allocated chunk by chunk as blocks are first offloaded.

    Start-up cost does not grow with its size; pinned memory on a GPU machine so copies are async.
    """

    def __init__(self, shape: BlockShape, num_blocks: int, pin_memory: bool) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.pin_memory = pin_memory
        self.blocks_per_chunk = max(1, HOST_CHUNK_BYTES // shape.num_bytes)
        num_chunks = -(-num_blocks // self.blocks_per_chunk) if num_blocks else 0
        self._chunks: list[torch.Tensor | None] = [None] * num_chunks

    @property
    def num_allocated_bytes(self) -> int:
        return sum(chunk.numel() * chunk.element_size() for chunk in self._chunks if chunk is not None)

    def chunk(self, chunk_index: int) -> torch.Tensor:
        """[blocks_in_chunk, num_layers, 2, tokens_per_block, num_kv_heads, head_dim]; allocated on first use."""
        chunk = self._chunks[chunk_index]
        if chunk is None:
            first = chunk_index * self.blocks_per_chunk
            size = min(self.blocks_per_chunk, self.num_blocks - first)
            # [blocks_in_chunk, num_layers, 2, tokens_per_block, num_kv_heads, head_dim]
            chunk = torch.empty((size, *self.shape.dims), dtype=self.shape.dtype, pin_memory=self.pin_memory)
            self._chunks[chunk_index] = chunk
        return chunk

    def block(self, block_id: int) -> torch.Tensor:
        """[num_layers, 2, tokens_per_block, num_kv_heads, head_dim] view of one host block."""
        chunk_index, index = divmod(block_id, self.blocks_per_chunk)
        return self.chunk(chunk_index)[index]


class KvCachePools:
    """Primary pool tensor on the device plus the optional host pool, and the copies between them."""

    def __init__(self, shape: BlockShape, num_primary_blocks: int, num_secondary_blocks: int,
                 device: torch.device, kernels=None) -> None:
        """``kernels``: a kvtool.kernels KernelLibrary for batched tier copies on a GPU, or None."""
        self.shape = shape
        self.device = device
        # [num_blocks, num_layers, 2, tokens_per_block, num_kv_heads, head_dim]
        self.primary = torch.zeros((num_primary_blocks, *shape.dims), dtype=shape.dtype, device=device)
        self.host = HostBlockPool(shape, num_secondary_blocks, pin_memory=device.type == "cuda")
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._kernels = kernels

    @property
    def num_primary_blocks(self) -> int:
        return int(self.primary.shape[0])

    def layer_caches(self) -> list[torch.Tensor]:
        """Per-layer views [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim] for attention."""
        return [self.primary[:, layer] for layer in range(self.shape.num_layers)]

    def execute_copies(self, src_pool: np.ndarray, src_block_ids: np.ndarray, dst_pool: np.ndarray,
                       dst_block_ids: np.ndarray, num_tokens: np.ndarray) -> None:
        """Runs the manager's copy operations (batched, with the result of running them in their
        order) before the forward that needs them.

        On a GPU they run on a copy stream; the compute stream waits for them (an onboard lands
        before the forward that reads it) and they wait for the previous forward (an offload
        reads the block's final contents).
        """
        if len(src_pool) == 0:
            return
        if self._copy_stream is None:
            self._run_copies(src_pool, src_block_ids, dst_pool, dst_block_ids, num_tokens)
            return
        compute_stream = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute_stream)
        with torch.cuda.stream(self._copy_stream):
            self._run_copies(src_pool, src_block_ids, dst_pool, dst_block_ids, num_tokens)
        compute_stream.wait_stream(self._copy_stream)

    def _run_copies(self, src_pool, src_block_ids, dst_pool, dst_block_ids, num_tokens) -> None:
        # Independent whole-block copies in one direction form one batch: on a GPU, one kernel
        # launch per batch instead of one copy per block.
        for batch in copy_batches(src_pool, src_block_ids, dst_pool, dst_block_ids, num_tokens):
            self._copy_batch((batch.src_pool, batch.dst_pool), batch.src_block_ids, batch.dst_block_ids,
                             batch.num_tokens)

    def _copy_batch(self, direction: tuple[int, int], src_ids, dst_ids, count: int) -> None:
        if count >= self.shape.tokens_per_block and direction != (PRIMARY, PRIMARY) and self._kernels is not None:
            from kvtool.kernels.block_copy import copy_blocks

            pools = {PRIMARY: self.primary, SECONDARY: self.host}
            copy_blocks(pools[direction[0]], pools[direction[1]], src_ids, dst_ids, self._copy_stream,
                        library=self._kernels)
            return
        non_blocking = self._copy_stream is not None
        for src_id, dst_id in zip(src_ids, dst_ids):
            src = self._block(direction[0], src_id)
            dst = self._block(direction[1], dst_id)
            if count >= self.shape.tokens_per_block:
                dst.copy_(src, non_blocking=non_blocking)
            else:
                # A partially matching block: only its first `count` token slots are valid.
                dst[:, :, :count].copy_(src[:, :, :count], non_blocking=non_blocking)

    def _block(self, pool: int, block_id: int) -> torch.Tensor:
        if pool == PRIMARY:
            return self.primary[block_id]
        return self.host.block(block_id)


def check_host_cache_size(host_cache_size: int) -> None:
    """Refuses a host cache larger than the memory this machine can give, with both numbers."""
    available = available_host_memory_bytes()
    if host_cache_size > available:
        raise KvtoolError(
            f"host_cache_size (--kv_host_cache_bytes) of {host_cache_size:,} bytes exceeds the "
            f"{available:,} bytes of host memory available: choose at most {available:,}")


CPU_PRIMARY_POOL_CAP_BYTES = 256 << 20  # on a CPU, "free device memory" is host memory: cap the default


@dataclass(frozen=True)
class PoolSizes:
    num_primary_blocks: int
    num_secondary_blocks: int


def size_pools(block_bytes: int, tokens_per_block: int, *, max_tokens: int | None,
               free_memory_fraction: float, free_memory_bytes: int, host_cache_size: int,
               on_cpu: bool) -> PoolSizes:
    """Primary blocks from max_tokens, else from a fraction of free memory; the smaller when both.

    Without max_tokens on a CPU the pool is capped at 256 MiB: the host's free memory is not a
    device budget, and an oversized pool only slows start-up.
    """
    budget = free_memory_fraction * free_memory_bytes
    if on_cpu:
        budget = min(budget, CPU_PRIMARY_POOL_CAP_BYTES)
    num_blocks = int(budget // block_bytes)
    if max_tokens is not None:
        num_blocks = min(num_blocks, -(-max_tokens // tokens_per_block))
    if num_blocks < 1:
        raise KvtoolError(
            f"the KV cache gets no block: one block takes {block_bytes:,} bytes but the budget is "
            f"{int(budget):,} bytes (free_gpu_memory_fraction={free_memory_fraction}, max_tokens={max_tokens}): "
            "raise max_tokens / free_gpu_memory_fraction")
    return PoolSizes(num_blocks, host_cache_size // block_bytes)
