"""copy_batches: a step's copy ops regrouped into launches give what running them one by one gives."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool._core import PoolKind
from kvtool.runtime.copy_batches import CopyBatch, copy_batches

TOKENS_PER_BLOCK = 4
NUM_POOLS, NUM_BLOCKS = 2, 5


def as_arrays(ops):
    columns = list(zip(*ops)) if ops else [[]] * 5
    return [np.asarray(c, dtype=np.int64) for c in columns]


def fresh_store():
    # [pool, block, token slot]: every slot holds a distinct value, so any misplaced copy shows.
    return np.arange(NUM_POOLS * NUM_BLOCKS * TOKENS_PER_BLOCK).reshape(NUM_POOLS, NUM_BLOCKS, TOKENS_PER_BLOCK)


def run_one_by_one(ops):
    store = fresh_store()
    for src_pool, src_block, dst_pool, dst_block, count in ops:
        store[dst_pool, dst_block, :count] = store[src_pool, src_block, :count]
    return store


def run_batches(batches: list[CopyBatch], *, reverse: bool):
    # A batch is one launch: its copies run in any order or all at once. Here: every source of the
    # batch is read before any destination is written, then written in forward or reverse order.
    store = fresh_store()
    for batch in batches:
        pairs = list(zip(batch.src_block_ids, batch.dst_block_ids))
        values = [store[batch.src_pool.value, s, :batch.num_tokens].copy() for s, _ in pairs]
        for (_, dst), value in (reversed if reverse else iter)(list(zip(pairs, values))):
            store[batch.dst_pool.value, dst, :batch.num_tokens] = value
    return store


op = st.tuples(st.integers(0, NUM_POOLS - 1), st.integers(0, NUM_BLOCKS - 1), st.integers(0, NUM_POOLS - 1),
               st.integers(0, NUM_BLOCKS - 1), st.sampled_from([TOKENS_PER_BLOCK, TOKENS_PER_BLOCK, 1, 3]))


@settings(max_examples=400, deadline=None)
@given(st.lists(op, max_size=14))
def test_batched_copies_give_the_same_blocks_as_copies_one_by_one(ops):
    batches = copy_batches(*as_arrays(ops))
    expected = run_one_by_one(ops)
    assert sum(len(b.src_block_ids) for b in batches) == len(ops)
    for reverse in (False, True):
        np.testing.assert_array_equal(run_batches(batches, reverse=reverse), expected)


def test_alternating_offloads_and_onboards_become_two_launches():
    # What the manager emits when request A comes back from the host while B fills the primary
    # pool: for each block, offload one of B's (primary -> host), then onboard one of A's into it.
    ops = []
    for i in range(4):
        ops.append((0, 10 + i, 1, 20 + i, TOKENS_PER_BLOCK))  # offload B's block 10+i to host 20+i
        ops.append((1, 30 + i, 0, 10 + i, TOKENS_PER_BLOCK))  # onboard A's host block 30+i into it
    batches = copy_batches(*as_arrays(ops))
    primary, host = PoolKind.PRIMARY, PoolKind.SECONDARY
    assert batches == [CopyBatch(primary, host, TOKENS_PER_BLOCK, [10, 11, 12, 13], [20, 21, 22, 23], wave=0),
                       CopyBatch(host, primary, TOKENS_PER_BLOCK, [30, 31, 32, 33], [10, 11, 12, 13], wave=1)]


def test_an_offload_into_a_host_block_an_onboard_just_read_waits_for_it():
    ops = [(1, 7, 0, 2, TOKENS_PER_BLOCK), (0, 3, 1, 7, TOKENS_PER_BLOCK)]  # onboard 7, then overwrite 7
    assert [b.src_pool for b in copy_batches(*as_arrays(ops))] == [PoolKind.SECONDARY, PoolKind.PRIMARY]
