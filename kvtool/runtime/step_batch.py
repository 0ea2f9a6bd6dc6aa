"""A step's flattened metadata on the host, and its padded form for a CUDA graph of prefill / mixed steps.

``flatten_step`` turns the scheduled requests into the arrays every forward reads (context chunks
first, then the one-token rows; kvtool.layers.attention_metadata says what each means).

A captured graph replays fixed shapes, so a prefill or mixed step of up to MAX_GRAPH_TOKENS tokens
runs the graph of the smallest token bucket that holds it (``token_buckets``), its arrays padded to
that bucket's ``GraphLayout``: T token rows, C context slots, D decode slots. The attention kernels
size their grids for the layout (the context grid for T query rows in each of C slots, the decode
grid for D slots and ``max_seq_len``) and skip what padding adds:
  - padding token rows have slot -1 (nothing is stored) and belong to no sequence (their attention
    output is never written; every other op is row-wise, so they touch no real row);
  - padding context slots have no query rows (the context kernel returns at once);
  - padding decode slots have seq_len 0 (the decode and reduce kernels return at once);
  - padding sampled rows repeat row 0 (their logits are computed and dropped).
Real context chunks sit in slots [0, num_context), real one-token rows in slots [C, C + num_decode),
so the decode kernel's first slot is the constant C a graph can bake in. vLLM calls this a FULL
CUDA graph for mixed batches (with attention backends whose metadata is sized for a maximum, as
FlashAttention 3's is); kvtool's kernels are, so attention needs no piecewise split.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

MAX_GRAPH_TOKENS = 512  # prefill / mixed steps up to this many tokens replay a graph
MIN_GRAPH_TOKENS = 16


class HostStep(NamedTuple):
    """A step's flattened metadata on the host (what ModelRunner.prepare uploads)."""

    input_ids: np.ndarray        # [num_tokens] int64
    positions: np.ndarray        # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    query_lens: np.ndarray       # [num_seqs] int32
    seq_lens: np.ndarray         # [num_seqs] int32
    block_tables: np.ndarray     # [num_seqs, max_blocks] int32, -1 padded
    slot_mapping: np.ndarray     # [num_tokens] int64
    sample_rows: np.ndarray      # [num_sampling] int64: the last row of each sampling request, caller's order
    num_context_seqs: int        # these first sequences have more than one new token

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def samples_every_row(self) -> bool:
        """Whether sample_rows is every row in order (a decode step whose requests all sample): the
        sampled rows' logits are then the whole step's."""
        rows = self.sample_rows
        return len(rows) == self.num_tokens and bool((rows[1:] > rows[:-1]).all())


def flatten_step(requests: Sequence, tokens_per_block: int) -> HostStep:
    """Flattens the step's requests (anything with token_ids, block_ids, num_cached_tokens, samples):
    multi-token context chunks first, then every request with one new token (decode tokens, and
    context chunks of one token such as the last token of a fully cached prompt, which attention
    treats exactly like a decode token)."""
    # Read once: a ScheduledRequest copies its token and block ids into a new array at every read.
    new_tokens = [r.token_ids for r in requests]
    if all(len(t) == 1 for t in new_tokens):
        return _flatten_one_token_rows(requests, new_tokens, tokens_per_block)
    tpb = tokens_per_block
    order = sorted(range(len(requests)), key=lambda i: len(new_tokens[i]) == 1)  # stable
    sampling = [i for i, r in enumerate(requests) if r.samples]
    requests = [requests[i] for i in order]
    token_ids = [np.asarray(new_tokens[i], dtype=np.int64) for i in order]
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
    return HostStep(np.concatenate(token_ids), positions, query_start_loc, query_lens, seq_lens, block_tables,
                    slot_mapping, sample_rows, int((query_lens > 1).sum()))


def _flatten_one_token_rows(requests: Sequence, new_tokens: list, tokens_per_block: int) -> HostStep:
    """flatten_step of a step whose every request has one new token (a decode step; ``new_tokens``: each
    request's token_ids): rows in the caller's order, built with a few array operations. A decode step
    runs right after the previous step streamed the model's weights through the caches, so each
    operation here runs from cold caches, some ten times slower than warm (flatten_step's general path
    took 0.13-0.2 ms of a 7 ms bfloat16 SmolLM2-135M step on the CPU, this one 0.06)."""
    num_seqs = len(requests)
    positions = np.fromiter((r.num_cached_tokens for r in requests), dtype=np.int64, count=num_seqs)
    block_ids = [r.block_ids for r in requests]
    if num_seqs == 1:
        block_tables = np.asarray(block_ids[0], dtype=np.int32)[None]
    else:
        block_tables = np.full((num_seqs, max(len(b) for b in block_ids)), -1, dtype=np.int32)
        for row, blocks in zip(block_tables, block_ids):
            row[:len(blocks)] = blocks
    # Each new token's KV goes to slot block_id * tokens_per_block + offset of its position.
    slot_blocks = block_tables[np.arange(num_seqs), positions // tokens_per_block].astype(np.int64)
    return HostStep(np.fromiter((t[0] for t in new_tokens), dtype=np.int64, count=num_seqs), positions,
                    np.arange(num_seqs + 1, dtype=np.int32), np.ones(num_seqs, dtype=np.int32),
                    (positions + 1).astype(np.int32), block_tables,
                    slot_blocks * tokens_per_block + positions % tokens_per_block,
                    np.array([i for i, r in enumerate(requests) if r.samples], dtype=np.int64), 0)


def token_buckets(max_num_tokens: int, largest: int = MAX_GRAPH_TOKENS) -> list[int]:
    """The graphs' token counts: 16, 24, 32, 48, 64, 96, ... (powers of two and 1.5x between: a step
    pads at most 1.5x its tokens, 2x below 16) up to min(largest, max_num_tokens), which is itself one."""
    if max_num_tokens < 1:
        raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
    limit = min(largest, max_num_tokens)
    buckets = []
    size = MIN_GRAPH_TOKENS
    while size < limit:
        buckets.append(size)
        if size + size // 2 < limit:
            buckets.append(size + size // 2)
        size *= 2
    return buckets + [limit]


class GraphStep(NamedTuple):
    """A step's metadata padded to a GraphLayout (the arrays a graph's static tensors receive)."""

    input_ids: np.ndarray        # [T] int64, padding 0
    positions: np.ndarray        # [T] int64, padding 0
    slot_mapping: np.ndarray     # [T] int64, padding -1
    query_start_loc: np.ndarray  # [C + D + 1] int32
    query_lens: np.ndarray       # [C + D] int32, padding 0
    seq_lens: np.ndarray         # [C + D] int32, padding 0
    block_tables: np.ndarray     # [C + D, max_blocks] int32, padding -1
    sample_rows: np.ndarray      # [R] int64, padding 0


class GraphLayout(NamedTuple):
    """The fixed shapes of one prefill / mixed graph: T token rows, C context slots, D decode slots,
    R sampled rows, block tables of max_blocks columns."""

    num_tokens: int
    num_context_slots: int
    num_decode_slots: int
    num_sample_slots: int
    max_blocks: int

    @classmethod
    def for_tokens(cls, num_tokens: int, max_batch_size: int, max_blocks: int) -> GraphLayout:
        """The layout of the bucket of ``num_tokens``: a context chunk has at least 2 tokens, so at most
        T // 2 of them fit, and at most T one-token rows; neither more than max_batch_size. Every
        step of at most T tokens (and max_batch_size requests) therefore fits."""
        context = max(1, min(max_batch_size, num_tokens // 2))
        decode = min(max_batch_size, num_tokens)
        return cls(num_tokens, context, decode, min(max_batch_size, context + decode), max_blocks)

    @property
    def num_slots(self) -> int:
        return self.num_context_slots + self.num_decode_slots

    def fits(self, step: HostStep) -> bool:
        num_decode = step.num_seqs - step.num_context_seqs
        return (step.num_tokens <= self.num_tokens and step.num_context_seqs <= self.num_context_slots
                and num_decode <= self.num_decode_slots and len(step.sample_rows) <= self.num_sample_slots
                and step.block_tables.shape[1] <= self.max_blocks)

    def pack(self, step: HostStep) -> GraphStep:
        """``step`` padded to this layout (module docstring); ValueError when it does not fit."""
        if not self.fits(step):
            raise ValueError(f"a step of {step.num_tokens} tokens, {step.num_context_seqs} context chunks, "
                             f"{step.num_seqs - step.num_context_seqs} one-token rows, {len(step.sample_rows)} "
                             f"sampled rows and {step.block_tables.shape[1]} blocks per row does not fit {self}")
        n, t = step.num_tokens, self.num_tokens
        num_context, num_decode = step.num_context_seqs, step.num_seqs - step.num_context_seqs
        context_tokens = int(step.query_start_loc[num_context])
        input_ids = np.zeros(t, np.int64)
        input_ids[:n] = step.input_ids
        positions = np.zeros(t, np.int64)
        positions[:n] = step.positions
        slot_mapping = np.full(t, -1, np.int64)
        slot_mapping[:n] = step.slot_mapping

        # Slot s of the layout holds sequence seq_of[s] of the step, or padding (-1).
        seq_of = np.full(self.num_slots, -1, np.int64)
        seq_of[:num_context] = np.arange(num_context)
        seq_of[self.num_context_slots:self.num_context_slots + num_decode] = np.arange(num_context, step.num_seqs)
        real = seq_of >= 0
        query_lens = np.zeros(self.num_slots, np.int32)
        query_lens[real] = step.query_lens[seq_of[real]]
        seq_lens = np.zeros(self.num_slots, np.int32)
        seq_lens[real] = step.seq_lens[seq_of[real]]
        block_tables = np.full((self.num_slots, self.max_blocks), -1, np.int32)
        block_tables[real, :step.block_tables.shape[1]] = step.block_tables[seq_of[real]]
        # A padding context slot starts where the real context tokens end (no rows); decode slot j
        # starts at its token's row; query_start_loc[C + D] is the number of real tokens.
        query_start_loc = np.full(self.num_slots + 1, n, np.int32)
        query_start_loc[:num_context + 1] = step.query_start_loc[:num_context + 1]
        query_start_loc[num_context:self.num_context_slots + 1] = context_tokens
        decode_rows = self.num_context_slots + np.arange(num_decode)
        query_start_loc[decode_rows] = step.query_start_loc[num_context:step.num_seqs]
        sample_rows = np.zeros(self.num_sample_slots, np.int64)
        sample_rows[:len(step.sample_rows)] = step.sample_rows
        return GraphStep(input_ids, positions, slot_mapping, query_start_loc, query_lens, seq_lens, block_tables,
                         sample_rows)


def graph_layouts(max_num_tokens: int, max_batch_size: int, max_blocks: int) -> list[GraphLayout]:
    """The prefill / mixed graphs' layouts, smallest first: per token bucket, one of a single context
    slot (a prompt over a cached prefix, alone or beside decode rows: the common step at low load)
    before the full one. The context kernel sizes its grid, and so its key splits, by the layout's
    context slots (kvtool/kernels/paged_context_attention.py): in the full layout a lone question's
    few CTAs would hide among the padding slots' and never split."""
    layouts = []
    for num_tokens in token_buckets(max_num_tokens):
        full = GraphLayout.for_tokens(num_tokens, max_batch_size, max_blocks)
        if full.num_context_slots > 1:
            layouts.append(full._replace(num_context_slots=1,
                                         num_sample_slots=min(max_batch_size, 1 + full.num_decode_slots)))
        layouts.append(full)
    return layouts


def layout_for(layouts: Sequence[GraphLayout], step: HostStep) -> GraphLayout | None:
    """The smallest of ``layouts`` (ordered by num_tokens) that fits the step; None when none does."""
    return next((layout for layout in layouts if layout.fits(step)), None)
