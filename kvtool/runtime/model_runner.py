"""Runs a scheduled batch: its block copies, then the forward of its requests; returns logits."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np
import torch

from kvtool.cpu_kernels import decoder as cpu_decoder
from kvtool.layers.attention_metadata import AttentionMetadata
from kvtool.runtime.cuda_graphs import DecodeBatch, DecodeGraphs
from kvtool.runtime.kv_pool import KvCachePools


class StepRequest(NamedTuple):
    """The fields of a scheduled request that prepare() reads (the scheduler's ScheduledRequest has
    them too); for driving a runner directly: warm-up, tests."""

    token_ids: np.ndarray
    block_ids: np.ndarray
    num_cached_tokens: int
    is_context: bool
    samples: bool


class ModelRunner:
    """Owns the model and the KV pools of one engine; executes scheduled batches."""

    def __init__(self, model: torch.nn.Module, pools: KvCachePools, tokens_per_block: int,
                 device: torch.device) -> None:
        self.model = model
        self.pools = pools
        self.tokens_per_block = tokens_per_block
        self.device = device
        self.kv_caches = pools.layer_caches()
        self.decode_graphs: DecodeGraphs | None = None  # set by enable_cuda_graphs
        # On the CPU the model runs through kvtool's fused kernels where they apply (the ISA they
        # use, e.g. 'avx512'; None: the torch path).
        self.cpu_kernels_isa = cpu_decoder.enable(model) if device.type == "cpu" else None

    def enable_cuda_graphs(self, max_batch_size: int, max_seq_len: int) -> None:
        """Replays decode steps from CUDA graphs (kvtool.runtime.cuda_graphs), captured now for every
        batch-size bucket up to ``max_batch_size``."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this runner is on {self.device}")
        graphs = DecodeGraphs(self.model, self.kv_caches, self.tokens_per_block, max_batch_size, max_seq_len,
                              self.device)
        graphs.capture_all()
        torch.cuda.synchronize(self.device)
        self.decode_graphs = graphs

    def prepare(self, requests) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flattens the step's requests: multi-token context chunks first, then every request with
        one new token (decode tokens, and context chunks of one token such as the last token of a
        fully cached prompt, which attention treats exactly like a decode token: on a GPU the
        split-K decode kernel serves it instead of a mostly idle context-kernel tile).

        Returns input_ids [num_tokens], the attention metadata, and the row of the last token of
        each sampling request [num_sampling] (whose logits are needed), in the order of ``requests``.
        """
        tpb = self.tokens_per_block
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].token_ids) == 1)  # stable
        sampling = [i for i, r in enumerate(requests) if r.samples]
        requests = [requests[i] for i in order]
        token_ids = [np.asarray(r.token_ids, dtype=np.int64) for r in requests]
        query_lens = np.array([len(t) for t in token_ids], dtype=np.int32)
        num_cached = np.array([r.num_cached_tokens for r in requests], dtype=np.int32)
        seq_lens = num_cached + query_lens
        query_start_loc = np.zeros(len(requests) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])

        positions = np.concatenate([np.arange(c, c + q, dtype=np.int64) for c, q in zip(num_cached, query_lens)])
        max_blocks = max(len(r.block_ids) for r in requests)
        block_tables = np.full((len(requests), max_blocks), -1, dtype=np.int32)
        for i, r in enumerate(requests):
            block_tables[i, : len(r.block_ids)] = r.block_ids
        # Each new token's KV goes to slot block_id * tokens_per_block + offset of its position.
        seq_index = np.repeat(np.arange(len(requests)), query_lens)
        slot_blocks = block_tables[seq_index, positions // tpb].astype(np.int64)
        slot_mapping = slot_blocks * tpb + positions % tpb

        # The last row of each sampling request, in the caller's order (logits come back in it).
        last_rows = query_start_loc[1:].astype(np.int64) - 1
        row_of = dict(zip(order, last_rows.tolist()))
        sample_rows = np.array([row_of[i] for i in sampling], dtype=np.int64)
        device = self.device
        meta = AttentionMetadata(
            positions=torch.from_numpy(positions).to(device),
            query_start_loc=torch.from_numpy(query_start_loc).to(device),
            query_lens=torch.from_numpy(query_lens).to(device),
            seq_lens=torch.from_numpy(seq_lens).to(device),
            block_tables=torch.from_numpy(block_tables).to(device),
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            tokens_per_block=tpb,
            num_context_seqs=int((query_lens > 1).sum()),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            max_decode_seq_len=int(seq_lens[query_lens == 1].max(initial=0)),
        )
        input_ids = torch.from_numpy(np.concatenate(token_ids)).to(device)
        return input_ids, meta, torch.from_numpy(sample_rows).to(device)

    def warm_up(self, num_tokens: int) -> None:
        """One context step and one decode step on scratch blocks, so the first measured request
        does not pay one-time costs (allocator growth, kernel loading / compilation, thread pools).

        The blocks it writes are free: every block is written before it is read, so the scratch
        KV is never seen by a request.
        """
        tpb = self.tokens_per_block
        num_tokens = max(1, min(num_tokens, self.pools.num_primary_blocks * tpb - 1))
        block_ids = np.arange(-(-(num_tokens + 1) // tpb), dtype=np.int32)
        context = StepRequest(np.zeros(num_tokens, np.int32), block_ids, 0, True, True)
        decode = StepRequest(np.zeros(1, np.int32), block_ids, num_tokens, False, True)
        self.execute([context])
        self.execute([decode])
        self.pools.load_copy_kernel()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def execute_batch(self, batch) -> torch.Tensor | None:
        """Runs a kvtool._core.ScheduledBatch: its block copies, then the forward of its requests;
        returns what execute does, or None when no request was scheduled."""
        copies = batch.copy_ops
        self.pools.execute_copies(copies.src_pool, copies.src_block_ids, copies.dst_pool, copies.dst_block_ids,
                                  copies.num_tokens)
        if len(batch.requests) == 0:
            self.pools.wait_for_all_copies()  # no forward will wait for them layer by layer
            return None
        return self.execute(batch.requests)

    @torch.inference_mode()
    def execute(self, requests) -> torch.Tensor:
        """Runs the forward for the step; returns logits [num_sampling_requests, vocab] float32."""
        batch = self._graph_batch(requests)
        if batch is not None:
            logits = self.decode_graphs.run(batch)
            sampling = [i for i, r in enumerate(requests) if r.samples]
            if len(sampling) == len(requests):
                return logits
            return logits[torch.tensor(sampling, dtype=torch.int64, device=self.device)]
        try:
            input_ids, meta, sample_rows = self.prepare(requests)
            with self._layers_wait_for_their_copies():
                hidden = self.model(input_ids, meta, self.kv_caches)  # [num_tokens, hidden_size]
        except BaseException:
            self.pools.wait_for_all_copies()  # no copy may outlive a forward that stopped early
            raise
        return self.model.compute_logits(hidden[sample_rows])

    def _graph_batch(self, requests) -> DecodeBatch | None:
        """The step as a DecodeBatch when a captured graph can run it: one new token per request, no
        copy landing layer by layer, a batch and block tables within the graphs' sizes. Else None."""
        graphs = self.decode_graphs
        if (graphs is None or self.pools.copies_pending_per_layer or len(requests) > graphs.max_batch_size
                or any(len(r.token_ids) != 1 for r in requests)):
            return None
        max_blocks = max(len(r.block_ids) for r in requests)
        if max_blocks > graphs.max_blocks:
            return None
        tpb = self.tokens_per_block
        positions = np.array([r.num_cached_tokens for r in requests], dtype=np.int64)
        block_tables = np.full((len(requests), max_blocks), -1, dtype=np.int32)
        for i, r in enumerate(requests):
            block_tables[i, : len(r.block_ids)] = r.block_ids
        slot_blocks = block_tables[np.arange(len(requests)), positions // tpb].astype(np.int64)
        return DecodeBatch(input_ids=np.array([r.token_ids[0] for r in requests], dtype=np.int64),
                           positions=positions, seq_lens=(positions + 1).astype(np.int32),
                           block_tables=block_tables, slot_mapping=slot_blocks * tpb + positions % tpb)

    @contextlib.contextmanager
    def _layers_wait_for_their_copies(self):
        """While a step's copies land layer by layer, each decoder layer first waits for its own."""
        if not self.pools.copies_pending_per_layer:
            yield
            return
        handles = [layer.register_forward_pre_hook(lambda *_, index=index: self.pools.wait_for_layer(index))
                   for index, layer in enumerate(self.model.layers)]
        # The CPU kernels' forward calls no layer module, so no hook: such a step takes the torch path
        # (copies land layer by layer only on a GPU; this keeps the rule wherever the runner is).
        cpu_decoder, self.model.cpu_decoder = self.model.cpu_decoder, None
        try:
            yield
        finally:
            self.model.cpu_decoder = cpu_decoder
            for handle in handles:
                handle.remove()
