"""Attention over the paged KV cache: the backend protocol and its plain-torch implementation.

A layer's KV cache is ``[num_blocks, 2, tokens_per_block, num_kv_heads, head_dim]`` (index 0 = K,
1 = V), a view of the block-major primary pool: not contiguous across blocks, so it is only ever
indexed, never reshaped. Token t of a sequence lives in block ``block_tables[seq, t // T]`` at
offset ``t % T``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvtool.layers.attention_metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Writes the step's K/V into the paged cache, then attends each new token to its sequence."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, *, scale: float, sliding_window: int | None) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads, head_dim],
        kv_cache [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim].

        Stores key/value at ``meta.slot_mapping``; then each new token attends to its sequence's
        cached tokens plus the new tokens up to itself (causal, aligned bottom-right), only the
        last ``sliding_window`` tokens when set (a token at position p sees positions
        > p - sliding_window). Returns [num_tokens, num_heads, head_dim].
        """
        ...


@dataclass
class _ContextLayout:
    """How one sequence's keys are laid out for a step with several new tokens (a context chunk)."""

    query_start: int
    query_len: int
    block_ids: torch.Tensor    # [num_needed_blocks] int64, the blocks holding the visible keys
    first_position: int        # position of the first token of block_ids[0]
    num_hidden_keys: int       # leading keys of block_ids[0] before the window: never attended
    seq_len: int
    mask: torch.Tensor | None  # [query_len, num_keys] bool; for a window or a long cached prefix

    @property
    def num_cached(self) -> int:
        return self.seq_len - self.query_len


@dataclass
class _DecodeLayout:
    """How all single-token sequences of the step attend at once, padded to the longest."""

    query_rows: torch.Tensor   # [num_decode] int64, row of each decode token in the step
    block_ids: torch.Tensor    # [num_decode, max_needed_blocks] int64, padded with a valid block
    mask: torch.Tensor         # [num_decode, 1, 1, max_needed_blocks * T] bool, True = attend
    key_hidden: torch.Tensor   # [1, num_decode, 1, max_needed_blocks * T, 1] bool, = ~mask


@dataclass
class _StepLayout:
    contexts: list[_ContextLayout]
    decode: _DecodeLayout | None


class TorchPagedAttention:
    """Paged attention in plain torch (CPU or GPU): gathers each sequence's visible blocks with
    ``index_select`` and runs torch's fused attention; several decode tokens run as one batch.

    A long chunk avoids the masked kernel, which computes every score where the causal one skips
    half (a 1,000-token prompt after a 17-token partial block took 1.3x the time of the same
    prompt from position 0): with no cached prefix it attends its own keys causally, and after a
    short prefix (a partial block) the queries are padded at the front so that one causal call
    covers prefix and chunk. A chunk after a long prefix, or under a sliding window, uses a mask.

    Only blocks that hold visible keys are read, so block-table entries released by a sliding
    window (-1) are never touched. Block tables are read on the host once per step (the step
    layout is cached for the metadata object and reused by every layer).
    """

    def __init__(self) -> None:
        self._cached_meta: AttentionMetadata | None = None
        self._cached_window: int | None = None
        self._cached_layout: _StepLayout | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, *, scale: float, sliding_window: int | None) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, meta.slot_mapping, meta.tokens_per_block)
        layout = self._step_layout(meta, sliding_window, kv_cache.device)
        output = torch.empty_like(query)
        for ctx in layout.contexts:
            rows = slice(ctx.query_start, ctx.query_start + ctx.query_len)
            output[rows] = _attend_context(ctx, query[rows], key[rows], value[rows], kv_cache, scale)
        if layout.decode is not None:
            dec = layout.decode
            num_decode, max_blocks = dec.block_ids.shape
            # [num_decode * max_blocks, 2, T, Hkv, D] -> [2, num_decode, Hkv, max_blocks * T, D]
            blocks = kv_cache.index_select(0, dec.block_ids.flatten())
            blocks = blocks.view(num_decode, max_blocks, *blocks.shape[1:])
            kv = blocks.permute(2, 0, 4, 1, 3, 5).flatten(3, 4).to(query.dtype)
            # Slots past the sequence end may hold anything (a pool from torch.empty): zero them,
            # since a masked NaN key or value still poisons the softmax and the weighted sum.
            kv.masked_fill_(dec.key_hidden, 0)
            q = query.index_select(0, dec.query_rows).unsqueeze(2)  # [num_decode, H, 1, D]
            out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=dec.mask, scale=scale,
                                                 enable_gqa=query.shape[1] != kv_cache.shape[3])
            output[dec.query_rows] = out.squeeze(2)
        return output

    def _step_layout(self, meta: AttentionMetadata, sliding_window: int | None,
                     device: torch.device) -> _StepLayout:
        if meta is not self._cached_meta or sliding_window != self._cached_window:
            self._cached_layout = build_step_layout(meta, sliding_window, device)
            self._cached_meta, self._cached_window = meta, sliding_window
        assert self._cached_layout is not None
        return self._cached_layout


# A cached prefix up to this fraction of the chunk is attended by padding the queries in front
# (wasted work about prefix² / 2, a few percent); a longer one through a mask, which costs little
# there: the masked kernel computes every score, but the chunk's own triangle is then the small part.
_PAD_PREFIX_FRACTION = 0.25


def _attend_context(ctx: _ContextLayout, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """query [q, H, D] and the chunk's own key/value [q, Hkv, D] -> [q, H, D]."""
    enable_gqa = query.shape[1] != kv_cache.shape[3]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, q, D]; 3-D inputs fall back to the slow math kernel
    if ctx.mask is not None or ctx.query_len == 1:  # one token sees every gathered key: no mask needed
        kv = _gather_keys(ctx, kv_cache, query.dtype)  # [2, Hkv, keys, D]
        out = F.scaled_dot_product_attention(q, kv[0].unsqueeze(0), kv[1].unsqueeze(0), attn_mask=ctx.mask,
                                             scale=scale, enable_gqa=enable_gqa)
        return out[0].transpose(0, 1)
    if ctx.num_cached == 0:
        # The chunk's own keys, rounded as the cache stores them, need no gather.
        k, v = (x.to(kv_cache.dtype).to(query.dtype).transpose(0, 1).unsqueeze(0) for x in (key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        return out[0].transpose(0, 1)
    # Short prefix: zero queries in front make the causal mask line up with the last query row.
    kv = _gather_keys(ctx, kv_cache, query.dtype)
    padded = torch.cat([q.new_zeros(1, q.shape[1], ctx.num_cached, q.shape[3]), q], dim=2)
    out = F.scaled_dot_product_attention(padded, kv[0].unsqueeze(0), kv[1].unsqueeze(0), is_causal=True,
                                         scale=scale, enable_gqa=enable_gqa)
    return out[0, :, ctx.num_cached:].transpose(0, 1)


def _gather_keys(ctx: _ContextLayout, kv_cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sequence's visible keys and values, [2, num_kv_heads, seq_len - first_position, head_dim]."""
    blocks = kv_cache.index_select(0, ctx.block_ids)  # [num_needed_blocks, 2, T, Hkv, D]
    num_keys = ctx.seq_len - ctx.first_position
    kv = blocks.transpose(0, 1).flatten(1, 2)[:, :num_keys].transpose(1, 2).to(dtype)
    if ctx.num_hidden_keys:
        # Masked keys still enter the products: zero them so stale non-finite data can't leak.
        kv[:, :, :ctx.num_hidden_keys] = 0
    return kv


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   tokens_per_block: int) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots of kv_cache."""
    block_ids = torch.div(slot_mapping, tokens_per_block, rounding_mode="floor")
    offsets = slot_mapping % tokens_per_block
    kv_cache[block_ids, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[block_ids, 1, offsets] = value.to(kv_cache.dtype)


def first_visible_position(seq_len: int, query_len: int, sliding_window: int | None) -> int:
    """The earliest position any of the step's new tokens can see."""
    first_query_position = seq_len - query_len
    if sliding_window is None:
        return 0
    return max(0, first_query_position - sliding_window + 1)


def build_step_layout(meta: AttentionMetadata, sliding_window: int | None, device: torch.device) -> _StepLayout:
    """Host-side bookkeeping shared by all layers of one step: which blocks and which mask."""
    T = meta.tokens_per_block
    query_lens = meta.query_lens.tolist()
    seq_lens = meta.seq_lens.tolist()
    starts = meta.query_start_loc.tolist()
    block_tables = meta.block_tables.tolist()
    contexts: list[_ContextLayout] = []
    decode_seqs: list[int] = []
    num_decode = sum(1 for i, q in enumerate(query_lens) if q == 1 and i >= meta.num_context_seqs)
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        windowed = sliding_window is not None and sliding_window < seq_len  # else the window hides nothing
        # A lone decode token attends exactly its keys, like a chunk: the padded decode batch would
        # mask and zero the slots past its end (on SmolLM2 a tenth of a decode step).
        if query_len == 1 and i >= meta.num_context_seqs and (num_decode > 1 or windowed):
            decode_seqs.append(i)
            continue
        first_block = first_visible_position(seq_len, query_len, sliding_window) // T
        last_block = (seq_len - 1) // T
        needed = block_tables[i][first_block:last_block + 1]
        _check_blocks(needed, i, first_block)
        first_position = first_block * T
        num_hidden_keys = first_visible_position(seq_len, query_len, sliding_window) - first_position
        mask = None
        if windowed or (query_len > 1 and seq_len - query_len > _PAD_PREFIX_FRACTION * query_len):
            query_positions = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
            key_positions = torch.arange(first_position, seq_len).unsqueeze(0)
            mask = _visible(query_positions, key_positions, sliding_window).to(device)
        contexts.append(_ContextLayout(starts[i], query_len, torch.tensor(needed, dtype=torch.int64, device=device),
                                       first_position, num_hidden_keys, seq_len, mask))
    decode = _decode_layout(decode_seqs, starts, seq_lens, block_tables, T, sliding_window, device) \
        if decode_seqs else None
    return _StepLayout(contexts, decode)


def _decode_layout(seqs: list[int], starts: list[int], seq_lens: list[int], block_tables: list[list[int]], T: int,
                   sliding_window: int | None, device: torch.device) -> _DecodeLayout:
    rows, block_rows, first_positions = [], [], []
    for i in seqs:
        first_block = first_visible_position(seq_lens[i], 1, sliding_window) // T
        needed = block_tables[i][first_block:(seq_lens[i] - 1) // T + 1]
        _check_blocks(needed, i, first_block)
        rows.append(starts[i])
        block_rows.append(needed)
        first_positions.append(first_block * T)
    max_blocks = max(len(row) for row in block_rows)
    # Pad with the sequence's own last block: a valid id whose keys the mask hides.
    padded = [row + [row[-1]] * (max_blocks - len(row)) for row in block_rows]
    key_positions = torch.tensor(first_positions).unsqueeze(1) + torch.arange(max_blocks * T).unsqueeze(0)
    query_positions = torch.tensor([seq_lens[i] - 1 for i in seqs]).unsqueeze(1)
    mask = _visible(query_positions, key_positions, sliding_window).to(device)
    return _DecodeLayout(torch.tensor(rows, dtype=torch.int64, device=device),
                       torch.tensor(padded, dtype=torch.int64, device=device),
                       mask[:, None, None, :], ~mask[None, :, None, :, None])


def _visible(query_positions: torch.Tensor, key_positions: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Bool mask: True where the query at position p may attend the key at position j."""
    mask = key_positions <= query_positions
    if sliding_window is not None:
        mask &= key_positions > query_positions - sliding_window
    return mask


def _check_blocks(block_ids: list[int], seq_index: int, first_block: int) -> None:
    if any(block_id < 0 for block_id in block_ids):
        raise ValueError(f"AttentionMetadata.block_tables row {seq_index} has a released block (-1) inside "
                         f"the attention window (block indices from {first_block}): {block_ids}")
