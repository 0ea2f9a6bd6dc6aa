"""TorchPagedAttention equals dense attention built from the full K/V with an explicit mask.

The reference knows nothing about blocks: it keeps each sequence's K/V as plain tensors and loops
over query positions. The paged side gets a pool filled with NaN except where the sequence's
tokens were written, so reading any slot outside a sequence's visible range shows up as NaN.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
from paged_driver import StepEntry, build_metadata

from kvtool.layers.attention import TorchPagedAttention

HEAD_DIM = 8


@dataclass
class SeqCase:
    num_cached: int
    num_new: int


def dense_attention(q, k, v, query_positions, scale, window):
    """q [n, H, D]; k, v [L, Hkv, D] of positions 0..L-1; loops over queries, explicit softmax."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, D]
    out = torch.empty_like(q)
    for row, p in enumerate(query_positions):
        lo = 0 if window is None else max(0, p - window + 1)
        scores = torch.einsum("hd,lhd->hl", q[row].double(), k[lo:p + 1].double()) * scale
        out[row] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v[lo:p + 1].double()).float()
    return out


def run_case(cases: list[SeqCase], *, num_heads: int, num_kv_heads: int, tokens_per_block: int,
             window: int | None, release_outside_window: bool, seed: int):
    """Returns (paged output, dense reference output, kv_cache, per-sequence (k, v, block_ids))."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    T = tokens_per_block
    num_blocks = sum(math.ceil((c.num_cached + c.num_new) / T) for c in cases) + 3
    # Block-major pool with several layers, so the layer view is not contiguous across blocks.
    pool = torch.full((num_blocks, 3, 2, T, num_kv_heads, HEAD_DIM), float("nan"))
    kv_cache = pool[:, 1]
    free = list(range(num_blocks))
    rng.shuffle(free)
    entries, queries, keys, values, full_kv, positions = [], [], [], [], [], []
    for c in cases:
        seq_len = c.num_cached + c.num_new
        k_all = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        v_all = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        block_ids = [free.pop() for _ in range(math.ceil(seq_len / T))]
        for p in range(c.num_cached):  # what earlier steps left in the cache
            kv_cache[block_ids[p // T], 0, p % T] = k_all[p]
            kv_cache[block_ids[p // T], 1, p % T] = v_all[p]
        if window is not None and release_outside_window:
            # Keys no new token can see turn to garbage: whole blocks are released (-1), and the
            # slots before the window in the first kept block hold NaN.
            first_visible = max(0, c.num_cached - window + 1)
            for p in range(first_visible):
                kv_cache[block_ids[p // T], :, p % T] = float("nan")
            for index in range(first_visible // T):
                block_ids[index] = -1
        entries.append(StepEntry(block_ids, c.num_cached, c.num_new))
        queries.append(torch.randn(c.num_new, num_heads, HEAD_DIM, generator=gen))
        keys.append(k_all[c.num_cached:])
        values.append(v_all[c.num_cached:])
        full_kv.append((k_all, v_all, block_ids))
        positions.append(list(range(c.num_cached, seq_len)))
    num_context = sum(1 for c in cases if c.num_new > 1)
    meta = build_metadata(entries, num_context_seqs=num_context, tokens_per_block=T)
    scale = HEAD_DIM ** -0.5
    out = TorchPagedAttention().forward(torch.cat(queries), torch.cat(keys), torch.cat(values), kv_cache, meta,
                                        scale=scale, sliding_window=window)
    reference = torch.cat([dense_attention(q, k, v, pos, scale, window)
                           for q, (k, v, _), pos in zip(queries, full_kv, positions)])
    return out, reference, kv_cache, full_kv


# Context chunks first (no prefix; a long prefix, attended through a mask; a short prefix,
# attended by padding the queries; partial blocks), then decode tokens of sequences with very
# different lengths (the decode batch is padded to the longest).
MIXED = [SeqCase(0, 13), SeqCase(8, 16), SeqCase(21, 3), SeqCase(2, 19), SeqCase(0, 1), SeqCase(30, 1),
         SeqCase(5, 1), SeqCase(63, 1)]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("tokens_per_block", [4, 16])
def test_paged_attention_matches_dense_attention(num_heads, num_kv_heads, tokens_per_block):
    out, reference, _, _ = run_case(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                    tokens_per_block=tokens_per_block, window=None, release_outside_window=False,
                                    seed=tokens_per_block)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 8, 17, 100])
@pytest.mark.parametrize("release", [False, True], ids=["kept", "released"])
def test_sliding_window_sees_only_the_last_window_tokens(window, release):
    out, reference, _, _ = run_case(MIXED, num_heads=4, num_kv_heads=2, tokens_per_block=4, window=window,
                                    release_outside_window=release, seed=window)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_released_blocks_inside_the_window_are_refused():
    T = 4
    kv_cache = torch.zeros(8, 2, T, 1, HEAD_DIM)
    meta = build_metadata([StepEntry([-1, 3, 5], 9, 1)], num_context_seqs=0, tokens_per_block=T)
    q, kv = torch.randn(1, 1, HEAD_DIM), torch.randn(1, 1, HEAD_DIM)
    with pytest.raises(ValueError, match="released block"):
        TorchPagedAttention().forward(q, kv, kv, kv_cache, meta, scale=1.0, sliding_window=8)


def test_new_keys_and_values_land_at_their_slots():
    cases = [SeqCase(6, 7), SeqCase(3, 1)]
    _, _, kv_cache, full_kv = run_case(cases, num_heads=2, num_kv_heads=2, tokens_per_block=4, window=None,
                                       release_outside_window=False, seed=0)
    for c, (k_all, v_all, block_ids) in zip(cases, full_kv):
        for p in range(c.num_cached + c.num_new):
            torch.testing.assert_close(kv_cache[block_ids[p // 4], 0, p % 4], k_all[p])
            torch.testing.assert_close(kv_cache[block_ids[p // 4], 1, p % 4], v_all[p])


def test_half_precision_cache_with_float32_queries():
    torch.manual_seed(0)
    T = 4
    kv_cache = torch.full((4, 2, T, 2, HEAD_DIM), float("nan"), dtype=torch.bfloat16)
    q = torch.randn(7, 4, HEAD_DIM)
    k, v = torch.randn(7, 2, HEAD_DIM), torch.randn(7, 2, HEAD_DIM)
    meta = build_metadata([StepEntry([2, 0], 0, 7)], num_context_seqs=1, tokens_per_block=T)
    out = TorchPagedAttention().forward(q, k, v, kv_cache, meta, scale=HEAD_DIM ** -0.5, sliding_window=None)
    reference = dense_attention(q, k.bfloat16().float(), v.bfloat16().float(), list(range(7)), HEAD_DIM ** -0.5, None)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_cached", [0, 3, 40], ids=["no-prefix", "short-prefix", "long-prefix"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_chunks_after_a_cached_prefix(num_cached, dtype):
    gen = torch.Generator().manual_seed(num_cached)
    T, num_new = 8, 21
    seq_len = num_cached + num_new
    k_all = torch.randn(seq_len, 2, HEAD_DIM, generator=gen).to(dtype)
    v_all = torch.randn(seq_len, 2, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(num_new, 4, HEAD_DIM, generator=gen).to(dtype)
    block_ids = list(range(math.ceil(seq_len / T)))
    kv_cache = torch.full((len(block_ids) + 1, 2, T, 2, HEAD_DIM), float("nan"), dtype=dtype)
    for p in range(num_cached):
        kv_cache[p // T, 0, p % T], kv_cache[p // T, 1, p % T] = k_all[p], v_all[p]
    meta = build_metadata([StepEntry(block_ids, num_cached, num_new)], num_context_seqs=1, tokens_per_block=T)
    out = TorchPagedAttention().forward(q, k_all[num_cached:], v_all[num_cached:], kv_cache, meta,
                                        scale=HEAD_DIM ** -0.5, sliding_window=None)
    reference = dense_attention(q.float(), k_all.float(), v_all.float(), list(range(num_cached, seq_len)),
                                HEAD_DIM ** -0.5, None)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("cases", [[SeqCase(29, 1)], [SeqCase(0, 13), SeqCase(29, 1)], [SeqCase(31, 1)]],
                         ids=["alone", "beside-a-chunk", "block-boundary"])
@pytest.mark.parametrize("tokens_per_block", [4, 16])
def test_a_lone_decode_token_attends_exactly_its_keys(cases, tokens_per_block):
    # The pool is NaN past each sequence's end: a lone decode token gathers only its own keys.
    out, reference, _, _ = run_case(cases, num_heads=4, num_kv_heads=2, tokens_per_block=tokens_per_block,
                                    window=None, release_outside_window=False, seed=len(cases))
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
