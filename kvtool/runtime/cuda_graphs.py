"""Steps replayed from CUDA graphs: decode steps per batch-size bucket, prefill / mixed steps per
token-count bucket.

A step launches every kernel of the model once per layer; launched one by one from Python, the CPU
sets the step's time, not the GPU (an eager qwen3-8b step: ~1,000 launches, ~18 ms of host time). A
graph captured once per bucket replays them in one launch. vLLM and SGLang do the same
(``--enforce-eager`` turns it off there; ``LLM(cuda_graphs=False)`` / ``kvtool bench --enforce_eager``
here).

Decode graphs: a step replays one when every request has one new token (decode tokens, and the last
token of a fully cached prompt) and no block copy lands layer by layer during it. The batch is padded
to the next bucket with copies of its first row whose KV slot is -1 (the append skips it), so padding
reads valid blocks and writes nothing. The decode kernel's split-K grid is sized for the runtime's
``max_seq_len``: partitions past a sequence's end return at once and the reduce never reads them, so
one graph serves every sequence length.

Mixed graphs: any other step of at most MAX_GRAPH_TOKENS tokens (a prefill chunk, a prompt over a
cached prefix, context chunks beside decode rows) replays the graph of its token bucket, its
metadata padded as kvtool.runtime.step_batch describes. Attention is inside the graph: the kernels'
grids are sized for the bucket and skip the padding.

Each graph's metadata lives in one device buffer written by one host-to-device copy per step from a
pinned twin (``StaticInputs``): one small copy instead of a synchronous upload per tensor. A graph
owns every tensor its kernels were captured with (a freed one's memory goes to other tensors, and
replays would read or write theirs: the bug issue 12's GPU run found). All graphs share one memory
pool: they replay one at a time, and a step's logits (a graph output) are read before the next step.
"""

from __future__ import annotations

import contextlib
import gc
import math
from typing import Callable, Iterator, Mapping, NamedTuple

import numpy as np
import torch

from kvtool.layers.attention_metadata import AttentionMetadata
from kvtool.runtime.step_batch import GraphLayout, GraphStep, HostStep, graph_layouts, layout_for


def batch_buckets(max_batch_size: int) -> list[int]:
    """Powers of two up to ``max_batch_size``, and ``max_batch_size`` itself: a batch of n rows runs
    the smallest bucket >= n (at most twice the rows it needs)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    buckets = [1 << i for i in range(max_batch_size.bit_length()) if (1 << i) < max_batch_size]
    return buckets + [max_batch_size]


class DecodeBatch(NamedTuple):
    """A decode step's metadata on the host, one row per request (every request has one new token)."""

    input_ids: np.ndarray     # [num_seqs] int64
    positions: np.ndarray     # [num_seqs] int64
    seq_lens: np.ndarray      # [num_seqs] int32
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32, -1 padded
    slot_mapping: np.ndarray  # [num_seqs] int64


def pad_decode_batch(batch: DecodeBatch, num_rows: int, max_blocks: int) -> DecodeBatch:
    """The batch padded to ``num_rows`` rows and ``max_blocks`` block-table columns: extra rows repeat
    row 0 with slot -1 (no KV is written), extra columns are -1 (never read)."""
    num_seqs, width = batch.block_tables.shape
    if not 1 <= num_seqs <= num_rows:
        raise ValueError(f"a decode batch of {num_seqs} rows does not fit a bucket of {num_rows}")
    if width > max_blocks:
        raise ValueError(f"a decode row needs {width} blocks; the graphs hold {max_blocks} (max_seq_len)")
    rows = np.concatenate([np.arange(num_seqs), np.zeros(num_rows - num_seqs, dtype=np.int64)])
    block_tables = np.full((num_rows, max_blocks), -1, dtype=np.int32)
    block_tables[:, :width] = batch.block_tables[rows]
    slot_mapping = batch.slot_mapping[rows].copy()
    slot_mapping[num_seqs:] = -1
    return DecodeBatch(batch.input_ids[rows], batch.positions[rows], batch.seq_lens[rows], block_tables,
                       slot_mapping)


_ALIGN = 16  # bytes: every field starts 16-byte aligned in the shared buffer (the kernels' vectors)


class StaticInputs:
    """Fixed-size tensors a graph reads, as views into one device buffer, and their pinned host twin.

    ``fields``: name -> (shape, dtype). ``tensors[name]`` is the device view the graph is captured
    with; ``upload`` writes host arrays into the pinned buffer and copies it to the device in one
    asynchronous copy on the current stream. Before the pinned buffer is rewritten, the previous copy
    is waited for (an event), so a step never overwrites bytes still in flight.
    """

    def __init__(self, fields: Mapping[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        self.device = device
        offsets, total = {}, 0
        for name, (shape, dtype) in fields.items():
            offsets[name] = total
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            total += -(-nbytes // _ALIGN) * _ALIGN
        on_gpu = device.type == "cuda"
        self.device_buffer = torch.zeros(max(total, _ALIGN), dtype=torch.uint8, device=device)
        self.host_buffer = torch.zeros(max(total, _ALIGN), dtype=torch.uint8, pin_memory=on_gpu)
        self.tensors: dict[str, torch.Tensor] = {}
        self._host: dict[str, np.ndarray] = {}
        for name, (shape, dtype) in fields.items():
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            start = offsets[name]
            self.tensors[name] = self.device_buffer[start:start + nbytes].view(dtype).view(shape)
            self._host[name] = self.host_buffer[start:start + nbytes].view(dtype).view(shape).numpy()
        self._copied = torch.cuda.Event() if on_gpu else None
        self._pending = False

    def upload(self, values: Mapping[str, np.ndarray]) -> None:
        """Sets every field to ``values[name]`` (each the field's shape) on the device, asynchronously."""
        if set(values) != set(self._host):
            raise ValueError(f"upload needs exactly the fields {sorted(self._host)}, got {sorted(values)}")
        if self._pending:
            self._copied.synchronize()  # the last step's copy has read the pinned bytes
        for name, array in values.items():
            self._host[name][...] = array
        self.device_buffer.copy_(self.host_buffer, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()
            self._pending = True


class _Graph(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: StaticInputs  # the device tensors the graph reads, and their pinned twin
    # Every tensor the kernels were captured with must live as long as the graph: a freed one's
    # memory is handed to other tensors, and replays would read (or write) theirs.
    meta: AttentionMetadata
    extra: tuple          # further tensors the capture read (decode's fixed query_start_loc / query_lens)
    logits: torch.Tensor  # [rows, vocab] float32, written by each replay


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (as it was before, after it).

    A collection inside a capture runs the finalizers of whatever it frees on the capturing thread: an
    earlier LLM's graphs (cudaGraphExecDestroy), streams or events. Those calls are refused while the
    thread captures, and the refusal invalidates the capture (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED:
    two of the H100 run's GPU tests, each building a second LLM in one process). vLLM freezes the
    collector during its captures for the same reason."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _capture(step: Callable[[], torch.Tensor], pool, device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Runs ``step`` eagerly once (loads the kernels, sizes cuBLAS's workspace outside the capture),
    then captures it; returns the graph and the output tensor its replays write."""
    step()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = step()
    return graph, output


class DecodeGraphs:
    """Captures and replays the model's decode step (forward and logits) per batch-size bucket."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], tokens_per_block: int,
                 max_batch_size: int, max_seq_len: int, device: torch.device, pool=None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.tokens_per_block = tokens_per_block
        self.buckets = batch_buckets(max_batch_size)
        self.max_seq_len = max_seq_len
        self.max_blocks = math.ceil(max_seq_len / tokens_per_block)
        self.device = device
        self._graphs: dict[int, _Graph] = {}
        self._pool = pool if pool is not None else torch.cuda.graph_pool_handle()  # the buckets share one pool

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def bucket(self, num_seqs: int) -> int | None:
        """The graph's batch size for ``num_seqs`` rows; None when the batch is too large."""
        return next((b for b in self.buckets if b >= num_seqs), None)

    def capture_all(self) -> None:
        """Captures every bucket now (start-up), so no measured step pays for a capture."""
        for bucket in self.buckets:
            self._graph(bucket)

    @torch.inference_mode()
    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """Replays the step: logits [num_seqs, vocab] float32 (a view valid until the next replay)."""
        num_seqs = len(batch.input_ids)
        bucket = self.bucket(num_seqs)
        if bucket is None:
            raise ValueError(f"a decode batch of {num_seqs} rows is larger than the graphs' {self.max_batch_size}")
        graph = self._graph(bucket)
        graph.inputs.upload(pad_decode_batch(batch, bucket, self.max_blocks)._asdict())
        graph.graph.replay()  # on the current stream, after the upload
        return graph.logits[:num_seqs]

    def _graph(self, bucket: int) -> _Graph:
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        return self._graphs[bucket]

    @torch.inference_mode()
    def _capture(self, bucket: int) -> _Graph:
        fields = {"input_ids": ((bucket,), torch.int64), "positions": ((bucket,), torch.int64),
                  "seq_lens": ((bucket,), torch.int32), "block_tables": ((bucket, self.max_blocks), torch.int32),
                  "slot_mapping": ((bucket,), torch.int64)}
        inputs = StaticInputs(fields, self.device)
        # Placeholder rows: sequence length 1 in no block (-1, never read), slot -1 (nothing written).
        inputs.upload(DecodeBatch(np.zeros(bucket, np.int64), np.zeros(bucket, np.int64), np.ones(bucket, np.int32),
                                  np.full((bucket, self.max_blocks), -1, np.int32),
                                  np.full(bucket, -1, np.int64))._asdict())
        t = inputs.tensors
        query_start_loc = torch.arange(bucket + 1, dtype=torch.int32, device=self.device)
        query_lens = torch.ones(bucket, dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            positions=t["positions"], query_start_loc=query_start_loc, query_lens=query_lens,
            seq_lens=t["seq_lens"], block_tables=t["block_tables"], slot_mapping=t["slot_mapping"],
            tokens_per_block=self.tokens_per_block, num_context_seqs=0, max_query_len=1,
            max_seq_len=self.max_seq_len, max_decode_seq_len=self.max_seq_len)

        def step() -> torch.Tensor:
            return self.model.compute_logits(self.model(t["input_ids"], meta, self.kv_caches))

        graph, logits = _capture(step, self._pool, self.device)
        return _Graph(graph, inputs, meta, (query_start_loc, query_lens), logits)


class MixedGraphs:
    """Captures and replays prefill / mixed steps (forward and the sampled rows' logits) per
    token-count bucket up to MAX_GRAPH_TOKENS, in two layouts each: one context slot, and as many as
    the bucket and batch allow (kvtool.runtime.step_batch.graph_layouts)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], tokens_per_block: int,
                 max_batch_size: int, max_seq_len: int, max_num_tokens: int, device: torch.device,
                 pool=None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.tokens_per_block = tokens_per_block
        self.max_seq_len = max_seq_len
        max_blocks = math.ceil(max_seq_len / tokens_per_block)
        self.layouts = graph_layouts(max_num_tokens, max_batch_size, max_blocks)
        self.device = device
        self._graphs: dict[GraphLayout, _Graph] = {}
        self._pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    def layout(self, step: HostStep) -> GraphLayout | None:
        """The layout whose graph runs ``step``; None when the step is too large for every graph."""
        return layout_for(self.layouts, step)

    def capture_all(self) -> None:
        for layout in self.layouts:
            self._graph(layout)

    @torch.inference_mode()
    def run(self, step: HostStep, layout: GraphLayout) -> torch.Tensor:
        """Replays the step: logits [num_sampling, vocab] float32 in the step's sampling order (a view
        valid until the next replay)."""
        graph = self._graph(layout)
        graph.inputs.upload(layout.pack(step)._asdict())
        graph.graph.replay()
        return graph.logits[:len(step.sample_rows)]

    def _graph(self, layout: GraphLayout) -> _Graph:
        if layout not in self._graphs:
            self._graphs[layout] = self._capture(layout)
        return self._graphs[layout]

    @torch.inference_mode()
    def _capture(self, layout: GraphLayout) -> _Graph:
        t, s = layout.num_tokens, layout.num_slots
        fields = {"input_ids": ((t,), torch.int64), "positions": ((t,), torch.int64),
                  "slot_mapping": ((t,), torch.int64), "query_start_loc": ((s + 1,), torch.int32),
                  "query_lens": ((s,), torch.int32), "seq_lens": ((s,), torch.int32),
                  "block_tables": ((s, layout.max_blocks), torch.int32),
                  "sample_rows": ((layout.num_sample_slots,), torch.int64)}
        assert list(fields) == list(GraphStep._fields)
        inputs = StaticInputs(fields, self.device)
        # Placeholder: every slot padding (no query rows, seq_len 0), every token slot -1.
        inputs.upload(GraphStep(np.zeros(t, np.int64), np.zeros(t, np.int64), np.full(t, -1, np.int64),
                                np.zeros(s + 1, np.int32), np.zeros(s, np.int32), np.zeros(s, np.int32),
                                np.full((s, layout.max_blocks), -1, np.int32),
                                np.zeros(layout.num_sample_slots, np.int64))._asdict())
        x = inputs.tensors
        meta = AttentionMetadata(
            positions=x["positions"], query_start_loc=x["query_start_loc"], query_lens=x["query_lens"],
            seq_lens=x["seq_lens"], block_tables=x["block_tables"], slot_mapping=x["slot_mapping"],
            tokens_per_block=self.tokens_per_block, num_context_seqs=layout.num_context_slots,
            max_query_len=t, max_seq_len=self.max_seq_len, max_decode_seq_len=self.max_seq_len)

        def step() -> torch.Tensor:
            hidden = self.model(x["input_ids"], meta, self.kv_caches)  # [T, hidden_size]
            return self.model.compute_logits(hidden[x["sample_rows"]])

        graph, logits = _capture(step, self._pool, self.device)
        return _Graph(graph, inputs, meta, (), logits)
