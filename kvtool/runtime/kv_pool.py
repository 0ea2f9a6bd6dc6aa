"""The KV cache tensors: a primary pool on the device and a lazily allocated host (secondary) pool.

The C++ cache manager decides which block lives where and emits copy operations; this module
only holds the memory and executes those copies (docs/architecture.md#layers). Every pool is indexed
[block, layer, ...]. On a GPU and in the host tier a block is one contiguous slab across all layers
(block-major), so moving a block between tiers is a single copy; the CPU's primary pool lies layer by
layer, and head by head in a block, instead (``layer_major_zeros``): in the order decode attention reads it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvtool._core import PoolKind
from kvtool.runtime.copy_batches import CopyBatch, copy_batches
from kvtool.runtime.host_allocator import huge_page_zeros

HOST_CHUNK_BYTES = 64 << 20  # the host pool grows in chunks of about this size
# Pinned host memory is allocated this far ahead of the chunks in use, on a background thread:
# pinning costs milliseconds per chunk (the first offloads of an H200 run took 66-194 ms while the
# step pinned its chunks, results/gpu/h200-2026-11-26/README.md); ahead of need, no step waits for
# it. 1 GiB holds the offloads of a 4k-token qwen3-8b request (590 MB) with room to spare.
HOST_AHEAD_BYTES = 1 << 30
# With the copy engines a layered step issues one transfer per run of consecutive blocks per layer:
# beyond this many runs (scattered ids) the host time of issuing them outweighs what the copy engines
# gain, and the step's layers move by the copy kernel instead (one launch per layer, however scattered).
MAX_LAYERED_DMA_RUNS = 32
# Copy layer by layer from this many bytes a step: about 2.4 ms over PCIe 5, well above the host
# time of issuing two launches per layer (about 1.5 ms for 36 layers). A guess to tune on a GPU.
LAYERED_COPY_MIN_BYTES = 128 << 20
# With CUDA graphs a layered step gives up its graph (it runs eagerly, waiting per layer) to overlap
# its copies: worth it only when they take longer than an eager step's host time (14-17 ms on
# qwen3-8b, results/gpu/gpu_steps.md), about 0.75 GB at the measured 52 GB/s a direction. On the
# H100 the layered onboards of the card's 1k-token prompts (0.3 GB a step) took 36-48 ms TTFT where
# recomputing took 25.8 (results/gpu/card/offload_abab_host45GB); whole, they are a few ms of copies
# (both directions side by side, WHOLE_COPY_SLICES) before a replayed step. Still to measure on a
# GPU: the same card with this threshold.
LAYERED_COPY_MIN_BYTES_WITH_GRAPHS = 1 << 30
# A step copied whole, whose offloads free the blocks its onboards fill, moves in this many slices of
# layers on two streams: slice i's onboards wait for slice i's offloads only, so the two directions
# overlap (PCIe is full duplex; the H100's suite moved 91 GB/s on two streams, 55 on one) and the
# forward waits for the last slice. Only with at most MAX_LAYERED_DMA_RUNS transfers a slice.
WHOLE_COPY_SLICES = 4


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
    With ``ahead_chunks`` (default: HOST_AHEAD_BYTES' worth when pinned, none otherwise), the chunks
    after the highest one in use are allocated on a background thread before a step needs them (the
    cache manager hands out never-used host blocks in ascending order, so chunks fill in order).
    """

    def __init__(self, shape: BlockShape, num_blocks: int, pin_memory: bool, ahead_chunks: int | None = None,
                 chunk_bytes: int = HOST_CHUNK_BYTES) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.pin_memory = pin_memory
        self.blocks_per_chunk = max(1, chunk_bytes // shape.num_bytes)
        num_chunks = -(-num_blocks // self.blocks_per_chunk) if num_blocks else 0
        self._chunks: list[torch.Tensor | None] = [None] * num_chunks
        if ahead_chunks is None:
            ahead_chunks = -(-HOST_AHEAD_BYTES // (self.blocks_per_chunk * shape.num_bytes)) if pin_memory else 0
        self.ahead_chunks = ahead_chunks
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}  # chunk index -> its background allocation
        self._allocator: ThreadPoolExecutor | None = None
        self._ahead_from = 0  # chunks below this one have been used
        self._allocate_ahead(0)

    @property
    def num_allocated_bytes(self) -> int:
        return sum(chunk.numel() * chunk.element_size() for chunk in list(self._chunks) if chunk is not None)

    def chunk(self, chunk_index: int) -> torch.Tensor:
        """[blocks_in_chunk, num_layers, 2, tokens_per_block, num_kv_heads, head_dim]; allocated on first use
        (or taken from its background allocation, waiting for it if it is under way)."""
        chunk = self._chunks[chunk_index]
        if chunk is None:
            with self._lock:
                pending = self._pending.pop(chunk_index, None)
            if pending is not None and not pending.cancel():
                chunk = pending.result()  # running or done on the allocator thread
            else:
                chunk = self._allocate(chunk_index)
        if chunk_index >= self._ahead_from:  # the first use of a chunk this far: keep the next ones coming
            self._ahead_from = chunk_index + 1
            self._allocate_ahead(chunk_index + 1)
        return chunk

    def block(self, block_id: int) -> torch.Tensor:
        """[num_layers, 2, tokens_per_block, num_kv_heads, head_dim] view of one host block."""
        chunk_index, index = divmod(block_id, self.blocks_per_chunk)
        return self.chunk(chunk_index)[index]

    def _allocate(self, chunk_index: int) -> torch.Tensor:
        """Allocates a chunk (on any thread); the first allocation of an index wins."""
        first = chunk_index * self.blocks_per_chunk
        size = min(self.blocks_per_chunk, self.num_blocks - first)
        # [blocks_in_chunk, num_layers, 2, tokens_per_block, num_kv_heads, head_dim]
        chunk = torch.empty((size, *self.shape.dims), dtype=self.shape.dtype, pin_memory=self.pin_memory)
        with self._lock:
            if self._chunks[chunk_index] is None:
                self._chunks[chunk_index] = chunk
            return self._chunks[chunk_index]

    def _allocate_ahead(self, first_chunk: int) -> None:
        """Queues the allocation of the ahead_chunks chunks from ``first_chunk`` not yet allocated."""
        last = min(first_chunk + self.ahead_chunks, len(self._chunks))
        with self._lock:
            for index in range(first_chunk, last):
                if self._chunks[index] is None and index not in self._pending:
                    if self._allocator is None:  # one thread, made on first need; exits with the pool
                        self._allocator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtool-host-pool")
                    self._pending[index] = self._allocator.submit(self._allocate, index)


class KvCachePools:
    """Primary pool tensor on the device plus the optional host pool, and the copies between them."""

    def __init__(self, shape: BlockShape, num_primary_blocks: int, num_secondary_blocks: int,
                 device: torch.device, kernels=None, *, layered_copy_min_bytes: int | None = None,
                 copy_method: str = "memcpy", cuda_graphs: bool = False) -> None:
        """``kernels``: a kvtool.kernels KernelLibrary on a GPU with kvtool's kernels (CuPy), or None:
        whole-block copies between tiers are then batched, by ``copy_method`` "memcpy" (the copy
        engines, kvtool.kernels.block_copy) or "kernel" (the SM copy kernel).
        ``layered_copy_min_bytes``: see KvCacheConfig (None with kernels: LAYERED_COPY_MIN_BYTES, or
        LAYERED_COPY_MIN_BYTES_WITH_GRAPHS when the steps replay ``cuda_graphs``)."""
        if copy_method not in ("memcpy", "kernel"):
            raise ValueError(f"copy_method must be 'memcpy' or 'kernel', got {copy_method!r}")
        self.shape = shape
        self.device = device
        # [num_blocks, num_layers, 2, tokens_per_block, num_kv_heads, head_dim]
        self.primary = layer_major_zeros(num_primary_blocks, shape) if device.type == "cpu" else \
            torch.zeros((num_primary_blocks, *shape.dims), dtype=shape.dtype, device=device)
        self.host = HostBlockPool(shape, num_secondary_blocks, pin_memory=device.type == "cuda")
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Onboards of a layered step run here, beside the offloads of the next layer (PCIe is full duplex).
        self._onboard_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._kernels = kernels
        self.copy_method = copy_method
        # A step copying at least this many bytes copies layer by layer, each layer's copies
        # followed by an event its attention waits for: the forward starts on the first layers
        # while the later ones still move. Below it, one launch per batch costs less than the
        # per-layer launches save. None: always whole blocks (no copy kernel to launch per layer).
        if layered_copy_min_bytes is None and kernels is not None:
            layered_copy_min_bytes = LAYERED_COPY_MIN_BYTES_WITH_GRAPHS if cuda_graphs else LAYERED_COPY_MIN_BYTES
        self.layered_copy_min_bytes = layered_copy_min_bytes
        self._layer_events: list | None = None  # this step's per-layer copy events, until the forward

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

        On a GPU they run on a copy stream after the previous forward (an offload reads a block's
        final contents). A small step's copies all land before the forward starts; a large one's
        land layer by layer, and layer i's attention waits only for layer i (``wait_for_layer``).
        """
        self._layer_events = None
        if len(src_pool) == 0:
            return
        batches = copy_batches(src_pool, src_block_ids, dst_pool, dst_block_ids, num_tokens)
        layered = self.copies_layer_by_layer(batches)
        method = self.step_copy_method(batches, layered)
        if self._copy_stream is None:
            for layer in range(self.shape.num_layers) if layered else [None]:
                for batch in batches:
                    self._copy_batch(batch, layer)
            return
        compute_stream = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute_stream)
        self._copy_stream.wait_stream(self._onboard_stream)  # even if a forward left its events unawaited
        try:
            with torch.cuda.stream(self._copy_stream):
                if layered:
                    self._layer_events = self._copy_in_slices(batches, method, self.shape.num_layers)
                elif self.copies_overlap_in_slices(batches):
                    self._copy_in_slices(batches, method, WHOLE_COPY_SLICES)  # waited for below
                else:
                    for batch in batches:
                        self._copy_batch(batch, None)
        finally:
            if not layered or self._layer_events is None:  # small step, or issuing failed midway
                self.wait_for_all_copies()

    def copies_layer_by_layer(self, batches: list[CopyBatch]) -> bool:
        """Whether a step's copies land layer by layer: from layered_copy_min_bytes, when a layer's slice
        of a block is whole 16-byte vectors."""
        num_bytes = sum(len(b.src_block_ids) for b in batches) * self.shape.num_bytes
        return (self.layered_copy_min_bytes is not None and num_bytes >= self.layered_copy_min_bytes
                and self._layer_slices_are_vectors)

    def copies_overlap_in_slices(self, batches: list[CopyBatch]) -> bool:
        """Whether a step copied whole moves its offload and onboard waves side by side, in
        WHOLE_COPY_SLICES slices of layers (each slice's transfers issued once per run of blocks)."""
        return (self._is_batched_swap(batches) and self._num_transfers(batches) <= MAX_LAYERED_DMA_RUNS
                and self._layer_slices_are_vectors)

    @property
    def _layer_slices_are_vectors(self) -> bool:
        """A layer's slice of a block is whole 16-byte vectors (what the copy kernel moves)."""
        return (self.shape.num_bytes // self.shape.num_layers) % 16 == 0

    def _is_batched_swap(self, batches: list[CopyBatch]) -> bool:
        """One wave of offloads, then one of onboards into the blocks it freed, all batched copies."""
        return offloads_then_onboards(batches) and all(self._uses_batched_copy(b) for b in batches)

    def step_copy_method(self, batches: list[CopyBatch], layered: bool) -> str:
        """How the step's whole-block copies between tiers move: ``copy_method``, except that a layered
        step of more than MAX_LAYERED_DMA_RUNS copy-engine transfers per layer takes the copy kernel."""
        if (layered and self._kernels is not None and self.copy_method == "memcpy"
                and self._num_transfers(batches) > MAX_LAYERED_DMA_RUNS):
            return "kernel"
        return self.copy_method

    def wait_for_layer(self, layer: int) -> None:
        """Makes the current stream wait for this step's copies of ``layer`` (no-op without any)."""
        if self._layer_events is not None:
            torch.cuda.current_stream(self.device).wait_event(self._layer_events[layer])

    def wait_for_all_copies(self) -> None:
        """Makes the current stream wait for every copy issued so far: after a small step's copies,
        and whenever a forward will not consume the per-layer events (no forward, or it failed)."""
        self._layer_events = None
        if self._copy_stream is not None:
            compute_stream = torch.cuda.current_stream(self.device)
            compute_stream.wait_stream(self._copy_stream)
            compute_stream.wait_stream(self._onboard_stream)

    def load_copy_kernel(self) -> None:
        """Compiles / loads the block copy kernel now (warm-up), not in the first step that copies."""
        if self._kernels is not None and self.host.num_blocks > 0:  # the copy engines' scattered steps use it too
            from kvtool.kernels.block_copy import block_copy_kernel

            # The primary pool's device (e.g. cuda:0), not self.device (maybe a bare 'cuda'): the
            # kernel cache is keyed by device index, as the real launches resolve it from the tensors.
            block_copy_kernel(self._kernels, self.primary.device)

    @property
    def copies_pending_per_layer(self) -> bool:
        return self._layer_events is not None

    def _copy_in_slices(self, batches: list[CopyBatch], method: str, num_slices: int) -> list:
        """Issues the copies one slice of layers at a time (layer_slices; whole-block batches between
        tiers by ``method``); returns an event per layer that follows all of its slice's copies.
        Called with the copy stream current."""
        layer_bytes = self.shape.num_bytes // self.shape.num_layers
        slices = layer_slices(self.shape.num_layers, num_slices)
        events = []
        if self._is_batched_swap(batches):
            # The usual large step: offload wave, then onboards into the blocks it freed. Slice i's
            # onboards wait for slice i's offloads only, so they overlap slice i + 1's offloads.
            offloads = [self._prepare_batched_copy(b, method) for b in batches if b.wave == 0]
            with torch.cuda.stream(self._onboard_stream):  # a kernel's tables live on the stream that reads them
                onboards = [self._prepare_batched_copy(b, method) for b in batches if b.wave == 1]
            for first, end in slices:
                offset, num_bytes = first * layer_bytes, (end - first) * layer_bytes
                for copy in offloads:
                    copy.launch(offset, num_bytes)
                offloaded = torch.cuda.Event()
                offloaded.record(self._copy_stream)
                self._onboard_stream.wait_event(offloaded)
                with torch.cuda.stream(self._onboard_stream):
                    for copy in onboards:
                        copy.launch(offset, num_bytes)
                onboarded = torch.cuda.Event()
                onboarded.record(self._onboard_stream)
                events += [onboarded] * (end - first)
            return events
        # Anything else, one stream: whole-block batches between tiers are resolved once and issued
        # per slice; the rest (partial or primary -> primary) are torch copies of each layer's slice.
        prepared = [self._prepare_batched_copy(batch, method) for batch in batches]
        for first, end in slices:
            for batch, batched in zip(batches, prepared):
                if batched is not None:
                    batched.launch(first * layer_bytes, (end - first) * layer_bytes)
                else:
                    for layer in range(first, end):
                        self._copy_batch(batch, layer)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
            events += [event] * (end - first)
        return events

    def _uses_batched_copy(self, batch: CopyBatch) -> bool:
        """Whole blocks between the tiers, on a GPU with CuPy: one batched copy (DMA runs or a kernel)."""
        return (self._kernels is not None and batch.num_tokens >= self.shape.tokens_per_block
                and (batch.src_pool, batch.dst_pool) != (PoolKind.PRIMARY, PoolKind.PRIMARY))

    def _num_transfers(self, batches: list[CopyBatch]) -> int:
        """Copy-engine transfers per layer of a layered step: runs of consecutive ids (a host chunk
        boundary may split one more), and one per block of a batch copied another way."""
        from kvtool.kernels.block_copy import coalesce_runs

        return sum(len(coalesce_runs(b.src_block_ids, b.dst_block_ids)) if self._uses_batched_copy(b)
                   else len(b.src_block_ids) for b in batches)

    def _prepare_batched_copy(self, batch: CopyBatch, method: str):
        """A prepared batched copy (``launch(byte_offset, num_bytes)`` on the current stream), or None."""
        if not self._uses_batched_copy(batch):
            return None
        from kvtool.kernels.block_copy import prepare_block_copy, prepare_dma_copy

        pools = {PoolKind.PRIMARY: self.primary, PoolKind.SECONDARY: self.host}
        src, dst = pools[batch.src_pool], pools[batch.dst_pool]
        if method == "memcpy":
            return prepare_dma_copy(src, dst, batch.src_block_ids, batch.dst_block_ids)
        return prepare_block_copy(src, dst, batch.src_block_ids, batch.dst_block_ids, library=self._kernels)

    def _copy_batch(self, batch: CopyBatch, layer: int | None) -> None:
        """The batch's copies (of one layer's slice of each block, or of whole blocks)."""
        if layer is None and self._uses_batched_copy(batch):
            self._prepare_batched_copy(batch, self.copy_method).launch()
            return
        non_blocking = self._copy_stream is not None
        count = batch.num_tokens
        layers = range(self.shape.num_layers) if layer is None else [layer]
        for src_id, dst_id in zip(batch.src_block_ids, batch.dst_block_ids):
            src = self._block(batch.src_pool, src_id)  # [num_layers, 2, tokens_per_block, kvh, hd]
            dst = self._block(batch.dst_pool, dst_id)
            if count >= self.shape.tokens_per_block:
                src, dst = (src, dst) if layer is None else (src[layer], dst[layer])
                dst.copy_(src, non_blocking=non_blocking)  # a CPU primary block is strided: torch gathers it
                continue
            # A partially matching block: only its first `count` token slots are valid. Copied as
            # contiguous [count, kvh, hd] pieces: torch would gather a strided host view on the CPU
            # when called, before the copy stream has written that host block.
            for copy_layer in layers:
                for kv in (0, 1):
                    dst[copy_layer, kv, :count].copy_(src[copy_layer, kv, :count], non_blocking=non_blocking)

    def _block(self, pool: PoolKind, block_id: int) -> torch.Tensor:
        if pool is PoolKind.PRIMARY:
            return self.primary[block_id]
        return self.host.block(block_id)


def layer_major_zeros(num_blocks: int, shape: BlockShape) -> torch.Tensor:
    """A CPU primary pool: [num_blocks, num_layers, 2, tokens_per_block, num_kv_heads, head_dim] as every
    pool is indexed, over memory laid out [num_layers, num_blocks, 2, num_kv_heads, tokens_per_block,
    head_dim] (a permuted view) in huge pages (kvtool.runtime.host_allocator): each layer's blocks one
    after another (as vLLM and SGLang hold a tensor a layer), and in a block each head's keys (values)
    one after another (as TensorRT-LLM lays out a block).

    Decode attention reads a layer's blocks of a sequence, which the cache manager often hands out in
    order (a released sequence's blocks go back to the free list last first), and a tile of them a KV
    head at a time: so it reads them in the order they lie, which the hardware prefetcher streams.
    Block-major put a layer's blocks num_layers slabs apart; token-major blocks had a head's rows of a
    tile 3 heads' width apart (SmolLM2-135M). Decode steps after 1,056 cached tokens, layouts alternated
    in one process on the family 25 model 17 EPYC: 0.97-0.99x a step each (results/cpu_attention.md). A
    block moved between tiers is a transposing copy (torch's; ~1.6x a contiguous one's time)."""
    dims = shape.dims
    physical = huge_page_zeros((dims[0], num_blocks, dims[1], dims[3], dims[2], dims[4]), shape.dtype)
    return physical.permute(1, 0, 2, 4, 3, 5)


def layer_slices(num_layers: int, num_slices: int) -> list[tuple[int, int]]:
    """[first, end) layers of ``num_slices`` slices as even as the layers allow, in order."""
    num_slices = max(1, min(num_slices, num_layers))
    bounds = [i * num_layers // num_slices for i in range(num_slices + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def offloads_then_onboards(batches: list[CopyBatch]) -> bool:
    """True for a step whose copies are one wave of offloads followed by one wave of onboards: the
    two directions can then move on two streams, layer by layer."""
    primary, secondary = PoolKind.PRIMARY, PoolKind.SECONDARY
    return {(b.wave, b.src_pool, b.dst_pool) for b in batches} == {(0, primary, secondary), (1, secondary, primary)}
