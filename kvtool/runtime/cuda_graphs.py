"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step launches every kernel of the model once per layer (norms, projections, RoPE, KV
append, attention, MLP: about 15 per layer, ~550 for a 36-layer model); launched one by one from
Python, the CPU sets the step's time, not the GPU. A graph captured once per batch size replays
them in one launch. vLLM and SGLang do the same (``--enforce-eager`` turns it off there;
``LLM(cuda_graphs=False)`` / ``kvtool bench --enforce_eager`` here).

A step replays a graph when every request has one new token (decode tokens, and the last token
of a fully cached prompt) and no block copy lands layer by layer during it. The batch is padded to
the next bucket with copies of its first row whose KV slot is -1 (the append kernel skips it), so
padding reads valid blocks and writes nothing. The decode kernel's split-K grid is sized for the
runtime's ``max_seq_len``: partitions past a sequence's end return at once and the reduce never
reads them, so one graph serves every sequence length.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from kvtool.layers.attention_metadata import AttentionMetadata


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


class _Graph(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: DecodeBatch   # the static device tensors the graph reads (same fields, as tensors)
    # Every tensor the kernels were captured with must live as long as the graph: a freed one's
    # memory is handed to other tensors, and replays would read (or write) theirs.
    meta: AttentionMetadata
    logits: torch.Tensor  # [bucket, vocab] float32, written by each replay


class DecodeGraphs:
    """Captures and replays the model's decode step (forward and logits) per batch-size bucket."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], tokens_per_block: int,
                 max_batch_size: int, max_seq_len: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.tokens_per_block = tokens_per_block
        self.buckets = batch_buckets(max_batch_size)
        self.max_seq_len = max_seq_len
        self.max_blocks = math.ceil(max_seq_len / tokens_per_block)
        self.device = device
        self._graphs: dict[int, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()  # the buckets share one memory pool

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
        padded = pad_decode_batch(batch, bucket, self.max_blocks)
        for static, values in zip(graph.inputs, padded):
            static.copy_(torch.from_numpy(values))  # host arrays; this step's forward follows on the stream
        graph.graph.replay()
        return graph.logits[:num_seqs]

    def _graph(self, bucket: int) -> _Graph:
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        return self._graphs[bucket]

    @torch.inference_mode()
    def _capture(self, bucket: int) -> _Graph:
        # Placeholder rows: sequence length 1 in no block (-1, never read), slot -1 (nothing written).
        host = DecodeBatch(np.zeros(bucket, np.int64), np.zeros(bucket, np.int64), np.ones(bucket, np.int32),
                           np.full((bucket, self.max_blocks), -1, np.int32), np.full(bucket, -1, np.int64))
        inputs = DecodeBatch(*(torch.from_numpy(values).to(self.device) for values in host))
        meta = AttentionMetadata(
            positions=inputs.positions, query_start_loc=torch.arange(bucket + 1, dtype=torch.int32, device=self.device),
            query_lens=torch.ones(bucket, dtype=torch.int32, device=self.device), seq_lens=inputs.seq_lens,
            block_tables=inputs.block_tables, slot_mapping=inputs.slot_mapping, tokens_per_block=self.tokens_per_block,
            num_context_seqs=0, max_query_len=1, max_seq_len=self.max_seq_len, max_decode_seq_len=self.max_seq_len)

        def step() -> torch.Tensor:
            return self.model.compute_logits(self.model(inputs.input_ids, meta, self.kv_caches))

        step()  # eager first: loads the kernels and sizes cuBLAS's workspace outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = step()
        return _Graph(graph, inputs, meta, logits)
