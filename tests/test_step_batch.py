"""A prefill / mixed step padded for a CUDA graph (kvtool.runtime.step_batch): the padded metadata must
make the attention kernels read and write exactly what the eager step's metadata makes them.

``kernel_view`` reads a layout the way the kernels do (their contract, from csrc/kernels): the
context kernel walks slots [0, C) and rows query_start_loc[s]..query_start_loc[s+1], skipping empty
slots; the decode kernel walks slots [C, C + D), one row query_start_loc[s] each, skipping seq_len
0; the KV append stores every row with a slot >= 0. The replay itself needs a GPU
(tests/test_cuda_graphs_gpu.py); this is the part that runs anywhere.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.runtime.model_runner import StepRequest
from kvtool.runtime.step_batch import GraphLayout, flatten_step, graph_layouts, layout_for, token_buckets

TPB = 4
MAX_BLOCKS = 64


def request(num_new: int, num_cached: int, first_block: int, samples: bool = True) -> StepRequest:
    num_blocks = -(-(num_new + num_cached) // TPB)
    return StepRequest(np.arange(100, 100 + num_new, dtype=np.int32),
                       np.arange(first_block, first_block + num_blocks, dtype=np.int32), num_cached, num_new > 1,
                       samples)


def kernel_view(input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables, num_context: int,
                num_slots: int):
    """{row: (token id, position, slot, seq_len, block table)} of every row attention computes, and the
    rows the append stores."""
    attended = {}
    for s in range(num_slots):
        if s < num_context:
            rows = range(query_start_loc[s], query_start_loc[s + 1])  # empty: the kernel returns
        else:
            rows = [query_start_loc[s]] if seq_lens[s] > 0 else []
        for row in rows:
            table = tuple(b for b in block_tables[s] if b >= 0)
            attended[int(row)] = (int(input_ids[row]), int(positions[row]), int(slot_mapping[row]), int(seq_lens[s]),
                                  table)
    stored = {int(row): int(slot_mapping[row]) for row in range(len(slot_mapping)) if slot_mapping[row] >= 0}
    return attended, stored


def eager_view(step):
    return kernel_view(step.input_ids, step.positions, step.slot_mapping, step.query_start_loc, step.seq_lens,
                       step.block_tables, step.num_context_seqs, step.num_seqs)


def padded_view(layout, packed):
    return kernel_view(packed.input_ids, packed.positions, packed.slot_mapping, packed.query_start_loc,
                       packed.seq_lens, packed.block_tables, layout.num_context_slots, layout.num_slots)


def test_token_buckets_step_by_at_most_one_and_a_half_up_to_the_limit():
    assert token_buckets(8192) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert token_buckets(100) == [16, 24, 32, 48, 64, 96, 100]
    assert token_buckets(10) == [10]
    buckets = token_buckets(4096)
    assert all(b / a <= 1.5 for a, b in zip(buckets, buckets[1:]))
    with pytest.raises(ValueError, match="max_num_tokens"):
        token_buckets(0)


def test_a_prompt_over_a_cached_prefix_pads_to_its_bucket_and_attends_the_same_rows():
    # The issue-21 step: 128 new tokens after a cached 2,048-token prefix, batch 1.
    step = flatten_step([request(128, 2048, 0)], TPB)
    layouts = [GraphLayout.for_tokens(t, 1, 1024) for t in token_buckets(512)]
    layout = layout_for(layouts, step)
    assert (layout.num_tokens, layout.num_context_slots, layout.num_decode_slots) == (128, 1, 1)
    packed = layout.pack(step)
    assert padded_view(layout, packed) == eager_view(step)
    assert packed.seq_lens.tolist() == [2176, 0]  # the decode slot is padding


def test_mixed_step_keeps_context_rows_in_their_slots_and_one_token_rows_after_the_context_slots():
    requests = [request(1, 11, 0), request(5, 0, 3), request(3, 4, 5, samples=False), request(1, 6, 7),
                request(9, 0, 20)]
    step = flatten_step(requests, TPB)
    layout = GraphLayout.for_tokens(32, max_batch_size=8, max_blocks=MAX_BLOCKS)
    packed = layout.pack(step)
    assert (layout.num_context_slots, layout.num_decode_slots) == (8, 8)
    assert padded_view(layout, packed) == eager_view(step)
    # 17 context tokens in slots 0-2, empty slots 3-7, the two one-token rows in slots 8 and 9.
    assert packed.query_start_loc[:9].tolist() == [0, 5, 8, 17, 17, 17, 17, 17, 17]
    assert packed.query_start_loc[8:10].tolist() == [17, 18] and packed.query_start_loc[-1] == 19
    assert packed.query_lens.tolist() == [5, 3, 9] + [0] * 5 + [1, 1] + [0] * 6
    assert packed.slot_mapping[19:].tolist() == [-1] * 13  # padding tokens store nothing
    assert packed.sample_rows[:4].tolist() == step.sample_rows.tolist()


def test_a_lone_prompt_over_a_cached_prefix_gets_a_layout_of_one_context_slot():
    # The context kernel splits the keys of a launch with few CTAs; in the full layout of a 64-row
    # batch the question's one query tile would count 64 context slots and never split.
    layouts = graph_layouts(512, 64, 1024)
    alone = flatten_step([request(128, 2048, 0)], TPB)
    beside_decodes = flatten_step([request(128, 2048, 0), request(1, 40, 600), request(1, 90, 700)], TPB)
    two_prompts = flatten_step([request(60, 2048, 0), request(60, 100, 600)], TPB)
    for step in (alone, beside_decodes):
        layout = layout_for(layouts, step)
        assert (layout.num_tokens, layout.num_context_slots) == (192 if step is beside_decodes else 128, 1)
        assert padded_view(layout, layout.pack(step)) == eager_view(step)
    layout = layout_for(layouts, two_prompts)
    assert (layout.num_tokens, layout.num_context_slots) == (128, 64)
    assert graph_layouts(512, 1, 1024) == [GraphLayout.for_tokens(t, 1, 1024) for t in token_buckets(512)]


def test_a_step_larger_than_a_layout_does_not_fit_and_is_refused():
    layout = GraphLayout.for_tokens(16, max_batch_size=4, max_blocks=8)
    too_many_tokens = flatten_step([request(17, 0, 0)], TPB)
    too_long = flatten_step([request(2, 40, 0)], TPB)  # 11 blocks
    too_many_rows = flatten_step([request(1, 3, 4 * i) for i in range(5)], TPB)
    for step in (too_many_tokens, too_long, too_many_rows):
        assert not layout.fits(step)
        with pytest.raises(ValueError, match="does not fit"):
            layout.pack(step)
    assert layout_for([layout], too_many_tokens) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 60), st.booleans()), min_size=1, max_size=8),
       st.integers(1, 8))
def test_every_step_that_fits_a_bucket_attends_exactly_its_eager_rows(shapes, max_batch_size):
    shapes = shapes[:max_batch_size]
    first_block, requests = 0, []
    for num_new, num_cached, samples in shapes:
        requests.append(request(num_new, num_cached, first_block, samples))
        first_block += len(requests[-1].block_ids)
    step = flatten_step(requests, TPB)
    layouts = graph_layouts(512, max_batch_size, MAX_BLOCKS)
    layout = layout_for(layouts, step)
    assert layout is not None and layout.num_tokens >= step.num_tokens  # every step of <= 512 tokens fits
    smaller = [candidate for candidate in layouts if candidate.num_tokens < layout.num_tokens]
    assert all(candidate.num_tokens < step.num_tokens for candidate in smaller)  # the smallest bucket
    packed = layout.pack(step)
    assert padded_view(layout, packed) == eager_view(step)
    assert np.all(np.diff(packed.query_start_loc) >= 0)
    assert packed.query_start_loc[-1] == step.num_tokens
    assert packed.sample_rows[:len(step.sample_rows)].tolist() == step.sample_rows.tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.booleans()), min_size=1, max_size=8), st.integers(2, 9))
def test_a_decode_step_flattens_as_its_rows_do_after_a_context_chunk(shapes, context_len):
    # A step of one-token rows only takes flatten_step's own path; the same rows behind a context
    # chunk take the general one. Both must give each row the same token, position, slot, table.
    first_block, rows = 1000, []
    for num_cached, samples in shapes:
        rows.append(request(1, num_cached, first_block, samples))
        first_block += len(rows[-1].block_ids)
    decode = flatten_step(rows, TPB)
    mixed = flatten_step([request(context_len, 0, 0)] + rows, TPB)
    n = len(rows)
    assert decode.num_tokens == decode.num_seqs == n and decode.num_context_seqs == 0
    assert decode.query_start_loc.tolist() == list(range(n + 1)) and decode.query_lens.tolist() == [1] * n
    for name in ("input_ids", "positions", "slot_mapping"):
        assert getattr(decode, name).tolist() == getattr(mixed, name)[context_len:].tolist(), name
        assert getattr(decode, name).dtype == getattr(mixed, name).dtype, name
    assert decode.seq_lens.tolist() == mixed.seq_lens[1:].tolist()
    width = decode.block_tables.shape[1]
    assert decode.block_tables.tolist() == mixed.block_tables[1:, :width].tolist()
    assert (mixed.block_tables[1:, width:] == -1).all()
    # Sampled rows in the caller's order: the chunk's last row, then each sampling row's own.
    assert decode.sample_rows.tolist() == [i for i, (_, samples) in enumerate(shapes) if samples]
    assert (mixed.sample_rows[1:] - context_len).tolist() == decode.sample_rows.tolist()


def test_a_step_samples_every_row_only_when_its_sampled_rows_are_all_rows_in_order():
    decode = flatten_step([request(1, 11, 0), request(1, 6, 7)], TPB)
    assert decode.samples_every_row
    assert not flatten_step([request(1, 11, 0), request(1, 6, 7, samples=False)], TPB).samples_every_row
    assert not flatten_step([request(5, 0, 0)], TPB).samples_every_row  # a prompt samples its last row only
    assert not decode._replace(sample_rows=decode.sample_rows[::-1].copy()).samples_every_row
