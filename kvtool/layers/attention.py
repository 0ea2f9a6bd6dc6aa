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
class _ContextPlan:
    """How to attend one sequence whose step has several new tokens (a context chunk)."""

    query_start: int
    query_len: int
    block_ids: torch.Tensor    # [num_needed_blocks] int64, the blocks holding the visible keys
    first_position: int        # position of the first token of block_ids[0]
    num_hidden_keys: int       # leading keys of block_ids[0] before the window: never attended
    seq_len: int
    mask: torch.Tensor | None  # [query_len, num_keys] bool, None when plain causal from position 0


@dataclass
class _DecodePlan:
    """How to attend all single-token sequences of the step at once, padded to the longest."""

    query_rows: torch.Tensor   # [num_decode] int64, row of each decode token in the step
    block_ids: torch.Tensor    # [num_decode, max_needed_blocks] int64, padded with a valid block
    mask: torch.Tensor         # [num_decode, 1, 1, max_needed_blocks * T] bool, True = attend
    key_hidden: torch.Tensor   # [1, num_decode, 1, max_needed_blocks * T, 1] bool, = ~mask


@dataclass
class _StepPlan:
    contexts: list[_ContextPlan]
    decode: _DecodePlan | None


class TorchPagedAttention:
    """Paged attention in plain torch (CPU or GPU): gathers each sequence's visible blocks with
    ``index_select`` and runs ``scaled_dot_product_attention``; decode tokens run as one batch.

    Only blocks that hold visible keys are read, so block-table entries released by a sliding
    window (-1) are never touched. Block tables are read on the host once per step (the step
    plan is cached for the metadata object and reused by every layer).
    """

    def __init__(self) -> None:
        self._cached_meta: AttentionMetadata | None = None
        self._cached_window: int | None = None
        self._cached_plan: _StepPlan | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, *, scale: float, sliding_window: int | None) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, meta.slot_mapping, meta.tokens_per_block)
        plan = self._step_plan(meta, sliding_window, kv_cache.device)
        output = torch.empty_like(query)
        num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
        enable_gqa = num_heads != num_kv_heads
        for ctx in plan.contexts:
            # [num_blocks_needed, 2, T, num_kv_heads, head_dim] -> [2, num_kv_heads, keys, head_dim]
            blocks = kv_cache.index_select(0, ctx.block_ids)
            num_keys = ctx.seq_len - ctx.first_position
            kv = blocks.transpose(0, 1).flatten(1, 2)[:, :num_keys].transpose(1, 2).to(query.dtype)
            if ctx.num_hidden_keys:
                # Masked keys still enter the products: zero them so stale non-finite data can't leak.
                kv[:, :, :ctx.num_hidden_keys] = 0
            # 4-D inputs: with 3-D ones torch's CPU SDPA falls back to its slow math kernel.
            q = query[ctx.query_start:ctx.query_start + ctx.query_len].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            out = F.scaled_dot_product_attention(
                q, kv[0].unsqueeze(0), kv[1].unsqueeze(0), attn_mask=ctx.mask, is_causal=ctx.mask is None,
                scale=scale, enable_gqa=enable_gqa)
            output[ctx.query_start:ctx.query_start + ctx.query_len] = out[0].transpose(0, 1)
        if plan.decode is not None:
            dec = plan.decode
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
                                                 enable_gqa=enable_gqa)
            output[dec.query_rows] = out.squeeze(2)
        return output

    def _step_plan(self, meta: AttentionMetadata, sliding_window: int | None, device: torch.device) -> _StepPlan:
        if meta is not self._cached_meta or sliding_window != self._cached_window:
            self._cached_plan = build_step_plan(meta, sliding_window, device)
            self._cached_meta, self._cached_window = meta, sliding_window
        assert self._cached_plan is not None
        return self._cached_plan


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


def build_step_plan(meta: AttentionMetadata, sliding_window: int | None, device: torch.device) -> _StepPlan:
    """Host-side bookkeeping shared by all layers of one step: which blocks and which mask."""
    T = meta.tokens_per_block
    query_lens = meta.query_lens.tolist()
    seq_lens = meta.seq_lens.tolist()
    starts = meta.query_start_loc.tolist()
    block_tables = meta.block_tables.tolist()
    contexts: list[_ContextPlan] = []
    decode_seqs: list[int] = []
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        if query_len == 1 and i >= meta.num_context_seqs:
            decode_seqs.append(i)
            continue
        first_block = first_visible_position(seq_len, query_len, sliding_window) // T
        last_block = (seq_len - 1) // T
        needed = block_tables[i][first_block:last_block + 1]
        _check_blocks(needed, i, first_block)
        first_position = first_block * T
        num_hidden_keys = first_visible_position(seq_len, query_len, sliding_window) - first_position
        mask = None
        if first_position != 0 or query_len != seq_len or sliding_window is not None:
            query_positions = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
            key_positions = torch.arange(first_position, seq_len).unsqueeze(0)
            mask = _visible(query_positions, key_positions, sliding_window).to(device)
        contexts.append(_ContextPlan(starts[i], query_len, torch.tensor(needed, dtype=torch.int64, device=device),
                                     first_position, num_hidden_keys, seq_len, mask))
    decode = _decode_plan(decode_seqs, starts, seq_lens, block_tables, T, sliding_window, device) \
        if decode_seqs else None
    return _StepPlan(contexts, decode)


def _decode_plan(seqs: list[int], starts: list[int], seq_lens: list[int], block_tables: list[list[int]], T: int,
                 sliding_window: int | None, device: torch.device) -> _DecodePlan:
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
    return _DecodePlan(torch.tensor(rows, dtype=torch.int64, device=device),
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
