"""KV cache manager rules (docs/architecture.md#kv-cache-rules), one test per rule, through Python."""

import numpy as np
import pytest
from reference_kv_cache import KvStore

from kvtool._core import CacheConfig, KVCacheManager, KvCacheEventKind, PoolKind

T = 4  # tokens per block in most tests: small numbers keep the scenarios readable


def make(**kwargs):
    kwargs.setdefault("tokens_per_block", T)
    kwargs.setdefault("num_primary_blocks", 16)
    return KVCacheManager(CacheConfig(**kwargs))


def run_context(manager, seq_id, tokens, *, release=True, **kwargs):
    """A request's context phase: add, compute every prompt token, optionally release."""
    result = manager.add_sequence(seq_id, np.asarray(tokens, dtype=np.int32), len(tokens), **kwargs)
    manager.mark_computed(seq_id, len(tokens))
    if release:
        manager.release(seq_id)
    return result


def prompt(start, n):
    return list(range(start, start + n))


def matched_blocks(manager, tokens, **kwargs):
    return manager.match_prefix(tokens, **kwargs).num_matched_blocks


# ---- reuse ----------------------------------------------------------------------------------

def test_second_sequence_reuses_full_prefix_blocks():
    m = make()
    system = prompt(100, 3 * T)
    run_context(m, 1, system + [1, 2])
    r = m.add_sequence(2, system + [7, 8, 9], 3 * T + 3)
    assert (r.num_reused_blocks, r.num_reused_tokens, r.num_new_blocks) == (3, 3 * T, 1)
    assert m.num_computed_tokens(2) == 3 * T
    assert m.check_invariants() == []


def test_released_blocks_stay_matchable_until_evicted():
    m = make(num_primary_blocks=4)
    run_context(m, 1, prompt(0, 2 * T + 1))
    assert matched_blocks(m, prompt(0, 2 * T + 1)) == 2
    run_context(m, 2, prompt(50, 4 * T))  # needs every block: both cached blocks are evicted
    assert matched_blocks(m, prompt(0, 2 * T + 1)) == 0
    assert m.stats().evicted_blocks == 2


def test_last_prompt_token_is_always_computed():
    tokens = prompt(0, 4 * 32)  # exactly 4 blocks of 32, all cached below
    with_partial = make(tokens_per_block=32, enable_partial_reuse=True)
    run_context(with_partial, 1, tokens)
    r = with_partial.add_sequence(2, tokens, len(tokens))
    assert (r.num_reused_blocks, r.num_partial_tokens, r.num_reused_tokens) == (3, 31, 127)

    without_partial = make(tokens_per_block=32, enable_partial_reuse=False)
    run_context(without_partial, 1, tokens)
    r = without_partial.add_sequence(2, tokens, len(tokens))
    assert (r.num_reused_blocks, r.num_partial_tokens, r.num_reused_tokens) == (3, 0, 96)
    assert len(tokens) - r.num_reused_tokens == 32


def test_single_token_prompt_reuses_nothing():
    m = make()
    run_context(m, 1, [5])
    assert m.add_sequence(2, [5], 1).num_reused_tokens == 0


def test_partial_block_reused_by_copy():
    m = make()
    run_context(m, 1, prompt(0, 2 * T + 1), release=False)  # blocks [0..3] [4..7] cached, still in use
    owner_table = m.block_ids(1)
    m.take_copy_ops()
    r = m.add_sequence(2, prompt(0, T + 2) + [99, 98], 2 * T)  # 2nd block starts like the cached one
    assert (r.num_reused_blocks, r.num_partial_tokens, r.num_reused_tokens) == (1, 2, T + 2)
    table = m.block_ids(2)
    assert table[0] == owner_table[0]  # the full block is shared
    assert table[1] != owner_table[1]  # the partial one is copied, never shared
    ops = m.take_copy_ops().to_list()
    assert [(op.src_pool, op.src_block_id, op.dst_pool, op.dst_block_id, op.num_tokens) for op in ops] == [
        (PoolKind.PRIMARY, owner_table[1], PoolKind.PRIMARY, table[1], 2)]
    assert m.stats().partial_reused_blocks == 1


def test_partial_reuse_disabled_computes_the_block():
    m = make(enable_partial_reuse=False)
    run_context(m, 1, prompt(0, 2 * T + 1))
    r = m.add_sequence(2, prompt(0, T + 2) + [99, 98], 2 * T)
    assert (r.num_reused_blocks, r.num_partial_tokens) == (1, 0)
    assert len(m.take_copy_ops()) == 0


def test_block_reusable_before_owner_finishes():
    m = make()
    shared = prompt(0, 2 * T)
    m.add_sequence(1, shared + [1, 2, 3], 2 * T + 3)
    m.mark_computed(1, T)  # first context chunk landed: block 0 is computed, block 1 not yet
    r = m.add_sequence(2, shared + [9], 2 * T + 1)
    assert (r.num_reused_blocks, r.num_early_reused_blocks) == (1, 1)
    assert m.block_ids(2)[0] == m.block_ids(1)[0]
    assert m.stats().early_reused_blocks == 1
    m.release(1)
    r = m.add_sequence(3, shared + [9], 2 * T + 1)  # owner gone: a plain (not early) reuse
    assert (r.num_reused_blocks, r.num_early_reused_blocks) == (1, 0)
    assert m.stats().early_reused_blocks == 1


def test_refcount_counts_sharing_sequences():
    m = make()
    tokens = prompt(0, 2 * T + 1)
    run_context(m, 1, tokens, release=False)
    m.add_sequence(2, tokens, len(tokens))
    m.add_sequence(3, tokens, len(tokens))
    shared = set(m.block_ids(1)[:2])
    assert shared == set(m.block_ids(2)[:2]) == set(m.block_ids(3)[:2])
    assert m.stats().primary.num_used_blocks == 2 + 3  # 2 shared + one own last block each
    for seq_id, used in ((1, 4), (2, 3)):
        m.release(seq_id)
        assert m.stats().primary.num_used_blocks == used  # shared blocks still referenced
        assert m.check_invariants() == []  # includes: refcount == number of sequences holding it
    m.release(3)
    stats = m.stats().primary
    assert (stats.num_used_blocks, stats.num_cached_blocks) == (0, 2)


def test_duplicate_computation_keeps_one_cached_copy():
    m = make()
    tokens = prompt(0, 2 * T + 1)
    m.add_sequence(1, tokens, len(tokens))
    m.add_sequence(2, tokens, len(tokens))  # nothing cached yet: both compute the same blocks
    m.mark_computed(1, len(tokens))
    m.mark_computed(2, len(tokens))
    m.release(1)
    m.release(2)
    assert m.stats().primary.num_cached_blocks == 2
    assert matched_blocks(m, tokens) == 2
    assert m.check_invariants() == []


def test_reuse_disabled_never_matches():
    m = make(enable_block_reuse=False)
    tokens = prompt(0, 3 * T + 1)
    run_context(m, 1, tokens)
    assert m.match_prefix(tokens).num_matched_tokens == 0
    assert m.add_sequence(2, tokens, len(tokens)).num_reused_tokens == 0
    assert m.stats().primary.num_cached_blocks == 0  # released blocks are simply free
    assert m.check_invariants() == []


# ---- block identity -------------------------------------------------------------------------

def test_salted_requests_never_share_blocks():
    m = make()
    tokens = prompt(0, 2 * T + 1)
    run_context(m, 1, tokens, cache_salt=11)
    assert m.add_sequence(2, tokens, len(tokens), cache_salt=12).num_reused_tokens == 0
    assert m.add_sequence(3, tokens, len(tokens)).num_reused_tokens == 0
    assert m.add_sequence(4, tokens, len(tokens), cache_salt=11).num_reused_blocks == 2


def test_extra_ids_prevent_reuse_across_prompt_tables():
    m = make()
    tokens = prompt(0, 2 * T + 1)
    table_a = np.array([7, 7, 0, 0, 0, 0, 0, 0, 0], dtype=np.uint64)  # p-tuning ids of table A
    table_b = np.array([8, 8, 0, 0, 0, 0, 0, 0, 0], dtype=np.uint64)
    run_context(m, 1, tokens, extra_ids=table_a)
    assert m.match_prefix(tokens, extra_ids=table_b).num_matched_tokens == 0
    assert m.match_prefix(tokens).num_matched_tokens == 0
    assert m.match_prefix(tokens, extra_ids=table_a).num_matched_blocks == 2
    # All-zero extra ids mean normal tokens: the same key as no extra ids at all.
    run_context(m, 2, tokens)
    assert m.match_prefix(tokens, extra_ids=np.zeros(len(tokens), dtype=np.uint64)).num_matched_blocks == 2


def test_lora_task_id_prevents_reuse():
    m = make()
    tokens = prompt(0, 2 * T + 1)
    run_context(m, 1, tokens, lora_task_id=3)
    assert m.match_prefix(tokens, lora_task_id=4).num_matched_tokens == 0
    assert m.match_prefix(tokens).num_matched_tokens == 0
    assert m.match_prefix(tokens, lora_task_id=3).num_matched_blocks == 2


def test_hash_collision_never_reuses_wrong_kv():
    # key_hash_bits=0: every block key hashes to 0, so only the stored key fields tell blocks apart.
    m = KVCacheManager(CacheConfig(tokens_per_block=T, num_primary_blocks=16, event_buffer_max_size=16),
                       key_hash_bits=0)
    a, b = prompt(0, 2 * T + 1), prompt(40, 2 * T + 1)
    run_context(m, 1, a)
    assert m.match_prefix(b).num_matched_tokens == 0
    assert m.match_prefix(b, cache_salt=1).num_matched_tokens == 0
    run_context(m, 2, b)
    assert {e.block_hash for e in m.take_events()} == {0}  # really colliding
    ra, rb = m.add_sequence(3, a, len(a)), m.add_sequence(4, b, len(b))
    assert ra.num_reused_blocks == rb.num_reused_blocks == 2
    assert set(m.block_ids(3)[:2]).isdisjoint(m.block_ids(4)[:2])
    assert m.check_invariants() == []


def test_truncated_hash_keeps_every_prompt_apart():
    m = KVCacheManager(CacheConfig(tokens_per_block=T, num_primary_blocks=64), key_hash_bits=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 4, size=2 * T + 1).astype(np.int32) for _ in range(12)]
    kv = KvStore(T)
    for seq_id, tokens in enumerate(prompts):
        r = m.add_sequence(seq_id, tokens, len(tokens))
        kv.apply(m.take_copy_ops())
        table = m.block_ids(seq_id)
        for j in range(r.num_reused_tokens):  # reused KV must be this prompt's own prefix
            assert kv.read(int(table[j // T]), j % T) == tuple(tokens[: j + 1])
        for j in range(r.num_reused_tokens, len(tokens)):
            kv.write(int(table[j // T]), j % T, tuple(tokens[: j + 1]))
        m.mark_computed(seq_id, len(tokens))
    assert m.check_invariants() == []


# ---- eviction -------------------------------------------------------------------------------

def test_leaf_blocks_evicted_before_parents():
    # Release order alone would pick the leaf (a sequence releases its last block first); here the
    # parent is the first candidate by priority and LRU, so only the leaf-only rule saves it.
    m = make(num_primary_blocks=5)
    parent, child = prompt(0, T), prompt(20, T)
    run_context(m, 1, parent + [1], priority=10)  # the parent block is cached at priority 10
    run_context(m, 2, parent + child + [1], priority=80)  # reuses it; the child is cached at 80
    assert matched_blocks(m, parent + child + [1]) == 2
    run_context(m, 3, prompt(50, 4 * T), release=False)  # 3 free blocks + 1 eviction
    assert matched_blocks(m, parent + child + [1]) == 1  # the leaf went, its lower-priority parent stayed
    assert m.check_invariants() == []
    m.allocate(3, 5 * T)
    assert matched_blocks(m, parent + [1]) == 0


def test_leaf_blocks_offloaded_before_parents():
    # As above with a host tier: the child goes to the host, the parent stays in the primary pool.
    m = make(num_primary_blocks=5, num_secondary_blocks=4, event_buffer_max_size=64)
    parent, child = prompt(0, T), prompt(20, T)
    run_context(m, 1, parent + [1], priority=60)
    run_context(m, 2, parent + child + [1], priority=80)
    stored = {tuple(e.token_ids): e.block_hash for e in m.take_events() if e.kind == KvCacheEventKind.STORED}
    run_context(m, 3, prompt(50, 4 * T), release=False)  # 3 free blocks + 1 offload
    offloaded = [e.block_hash for e in m.take_events() if e.kind == KvCacheEventKind.OFFLOADED]
    assert offloaded == [stored[tuple(child)]]
    match = m.match_prefix(parent + child + [1])
    assert (match.num_matched_blocks, match.num_secondary_blocks) == (2, 1)
    assert m.check_invariants() == []


def test_leaf_evicted_before_older_parent():
    # With a sliding window the first block is released (least recently used) while its child is
    # still held; the child, released later, must still go first.
    m = make(num_primary_blocks=4, max_attention_window=T)
    a = prompt(0, 3 * T + 1)
    m.add_sequence(1, a, len(a))
    for n in range(T, len(a) + 1):
        m.mark_computed(1, n)
    assert list(m.block_ids(1)[:2]) == [-1, -1]
    m.release(1)
    run_context(m, 2, prompt(50, 2 * T), release=False)  # 1 free block + 1 eviction
    assert matched_blocks(m, a) == 2


def test_low_priority_evicted_first():
    m = make(num_primary_blocks=4)
    high, low = prompt(0, T + 1), prompt(20, T + 1)
    run_context(m, 1, high, priority=80)
    run_context(m, 2, low, priority=10)  # more recently used, but lower priority
    run_context(m, 3, prompt(50, 3 * T), release=False)  # 2 free blocks + 1 eviction
    assert matched_blocks(m, high) == 1
    assert matched_blocks(m, low) == 0


def test_lru_order_within_priority():
    m = make(num_primary_blocks=4)
    older, newer = prompt(0, T + 1), prompt(20, T + 1)
    run_context(m, 1, older)
    run_context(m, 2, newer)
    run_context(m, 3, prompt(50, 3 * T), release=False)
    assert matched_blocks(m, older) == 0
    assert matched_blocks(m, newer) == 1


def test_reuse_refreshes_lru_position():
    m = make(num_primary_blocks=4)
    first, second = prompt(0, T + 1), prompt(20, T + 1)
    run_context(m, 1, first)
    run_context(m, 2, second)
    run_context(m, 3, first)  # used again: now the most recently used
    run_context(m, 4, prompt(50, 3 * T), release=False)
    assert matched_blocks(m, first) == 1
    assert matched_blocks(m, second) == 0


# ---- host offload ---------------------------------------------------------------------------

def test_evicted_block_is_offloaded_then_onboarded():
    m = make(num_primary_blocks=3, num_secondary_blocks=3)
    kv = KvStore(T)
    a, b = prompt(0, 2 * T + 1), prompt(50, 3 * T)

    def context(seq_id, tokens):
        r = m.add_sequence(seq_id, tokens, len(tokens))
        kv.apply(m.take_copy_ops())
        table = m.block_ids(seq_id)
        for j in range(len(tokens)):
            if j >= r.num_reused_tokens:
                kv.write(int(table[j // T]), j % T, tuple(tokens[: j + 1]))
            assert kv.read(int(table[j // T]), j % T) == tuple(tokens[: j + 1])
        m.mark_computed(seq_id, len(tokens))
        m.release(seq_id)
        return r

    context(1, a)
    context(2, b)  # evicts a's two blocks: offloaded, not dropped
    stats = m.stats()
    assert (stats.offloaded_blocks, stats.evicted_blocks, stats.secondary.num_cached_blocks) == (2, 0, 2)
    match = m.match_prefix(a)
    assert (match.num_matched_blocks, match.num_secondary_blocks) == (2, 2)

    r = context(3, a)  # onboards a's blocks; b's blocks are offloaded to make room
    assert (r.num_reused_blocks, r.num_onboarded_blocks) == (2, 2)
    stats = m.stats()
    assert (stats.onboarded_blocks, stats.num_onboarded_tokens) == (2, 2 * T)
    assert stats.num_offloaded_tokens == stats.offloaded_blocks * T
    assert m.check_invariants() == []


def test_offload_precedes_overwrite_of_the_same_primary_block():
    m = make(num_primary_blocks=2, num_secondary_blocks=2)
    run_context(m, 1, prompt(0, T + 1))  # one cached primary block
    m.take_copy_ops()
    run_context(m, 2, prompt(50, T + 1))  # the cached block makes room for a new one
    run_context(m, 3, prompt(0, T + 1))  # comes back from the host tier
    ops = m.take_copy_ops().to_list()
    for i, op in enumerate(ops):
        if op.dst_pool == PoolKind.PRIMARY:
            # Whatever this copy overwrites was saved by an earlier offload in the same batch, if at all.
            later_offloads = [o for o in ops[i + 1:] if o.src_pool == PoolKind.PRIMARY and o.src_block_id == op.dst_block_id
                              and o.dst_pool == PoolKind.SECONDARY]
            assert later_offloads == []
    assert any(op.src_pool == PoolKind.SECONDARY and op.dst_pool == PoolKind.PRIMARY for op in ops)


def test_low_priority_block_is_dropped_not_offloaded():
    m = make(num_primary_blocks=3, num_secondary_blocks=4, secondary_offload_min_priority=35)
    low, high = prompt(0, T + 1), prompt(20, T + 1)
    run_context(m, 1, low, priority=10)
    run_context(m, 2, high, priority=50)
    run_context(m, 3, prompt(50, 3 * T), release=False)  # evicts both cached blocks
    stats = m.stats()
    assert (stats.offloaded_blocks, stats.evicted_blocks) == (1, 1)
    assert matched_blocks(m, low) == 0
    assert m.match_prefix(high).num_secondary_blocks == 1


def test_low_priority_block_is_offloaded_first():
    # Both blocks may be offloaded; the room for the new request is taken from the lower priority,
    # although it was used more recently.
    m = make(num_primary_blocks=4, num_secondary_blocks=4)
    high, low = prompt(0, T + 1), prompt(20, T + 1)
    run_context(m, 1, high, priority=80)
    run_context(m, 2, low, priority=40)
    run_context(m, 3, prompt(50, 3 * T), release=False)  # 2 free blocks + 1 offload
    assert (m.match_prefix(low).num_secondary_blocks, m.match_prefix(high).num_secondary_blocks) == (1, 0)
    assert (matched_blocks(m, low), matched_blocks(m, high)) == (1, 1)


def test_onboarded_host_block_frees_its_secondary_block():
    m = make(num_primary_blocks=2, num_secondary_blocks=1)
    a = prompt(0, T + 1)
    run_context(m, 1, a)
    run_context(m, 2, prompt(50, 2 * T))
    assert m.stats().secondary.num_free_blocks == 0
    m.add_sequence(3, a, len(a))  # onboarded; b's leaf takes the freed host block
    assert m.match_prefix(a).num_secondary_blocks == 0
    assert m.check_invariants() == []


def test_offloads_of_a_step_do_not_overwrite_host_blocks_its_onboards_read():
    # a (3 blocks) goes to the host; when it comes back each onboard needs b's primary block, so
    # b's blocks are offloaded in between. With free host blocks left, none of those offloads
    # lands on a host block an onboard of the same step reads (so the runtime can batch them).
    m = make(num_primary_blocks=4, num_secondary_blocks=8)
    a, b = prompt(0, 3 * T + 1), prompt(50, 4 * T)
    run_context(m, 1, a)
    run_context(m, 2, b)
    m.take_copy_ops()
    m.add_sequence(3, a, len(a))
    ops = m.take_copy_ops()
    onboard_reads = {int(s) for s, p in zip(ops.src_block_ids, ops.src_pool) if p == 1}
    offload_writes = {int(d) for d, p in zip(ops.dst_block_ids, ops.dst_pool) if p == 1}
    assert len(onboard_reads) == 3 and len(offload_writes) == 4  # a's last block is new: b loses all 4
    assert onboard_reads.isdisjoint(offload_writes)
    assert m.stats().secondary.num_free_blocks == 8 - 4  # b's blocks; a's host blocks are free again
    assert m.check_invariants() == []
    m.release(3)
    # Later steps may reuse them: a's 4 blocks are offloaded into the 4 free host blocks, no drop.
    run_context(m, 4, prompt(200, 4 * T))
    assert m.stats().evicted_blocks == 0
    assert m.check_invariants() == []


def test_secondary_pool_evicts_by_lru():
    m = make(num_primary_blocks=2, num_secondary_blocks=1)
    first, second = prompt(0, T + 1), prompt(20, T + 1)
    run_context(m, 1, first)
    run_context(m, 2, prompt(40, 2 * T))  # first -> host
    run_context(m, 3, second)  # evicts the cached block of request 2, whose leaf replaces first on host
    assert matched_blocks(m, first) == 0
    assert m.stats().evicted_blocks >= 1
    assert m.check_invariants() == []


# ---- sliding window, generation -------------------------------------------------------------

def test_sliding_window_releases_blocks_outside_window():
    m = make(max_attention_window=2 * T)
    tokens = prompt(0, 5 * T)
    m.add_sequence(1, tokens, len(tokens))
    m.mark_computed(1, 5 * T)  # attends to tokens [3T, 5T): blocks 0..2 are wholly outside
    table = m.block_ids(1)
    assert list(table[:3]) == [-1, -1, -1] and all(table[3:] >= 0)
    stats = m.stats().primary
    assert (stats.num_used_blocks, stats.num_cached_blocks) == (2, 3)  # with reuse they stay cached
    assert m.check_invariants() == []


def test_sliding_window_keeps_a_block_partly_inside_the_window():
    m = make(max_attention_window=2 * T)
    tokens = prompt(0, 5 * T + 2)
    m.add_sequence(1, tokens, len(tokens))
    m.mark_computed(1, 5 * T + 1)  # the next token sees positions > 3T + 1: block 3 is still read
    table = m.block_ids(1)
    assert list(table[:3]) == [-1, -1, -1] and all(table[3:] >= 0)
    assert m.check_invariants() == []


def test_generated_tokens_become_reusable():
    m = make()
    question = prompt(0, T + 2)
    m.add_sequence(1, question, len(question))
    m.mark_computed(1, len(question))
    answer = [70, 71, 72]
    m.allocate(1, len(question) + len(answer))
    m.append_tokens(1, answer)
    m.mark_computed(1, len(question) + len(answer))
    assert m.num_tokens(1) == len(question) + len(answer)
    m.release(1)
    next_turn = question + answer + [80, 81]
    assert m.add_sequence(2, next_turn, len(next_turn)).num_reused_blocks == 2


# ---- events, stats --------------------------------------------------------------------------

def test_events_recorded():
    m = make(num_primary_blocks=2, num_secondary_blocks=1, event_buffer_max_size=100)
    a = prompt(0, T + 1)
    run_context(m, 1, a)
    stored = m.take_events()
    assert [e.kind for e in stored] == [KvCacheEventKind.STORED]
    assert (list(stored[0].token_ids), stored[0].parent_hash) == (a[:T], 0)
    run_context(m, 2, prompt(50, 2 * T))  # a's block offloaded
    kinds = [e.kind for e in m.take_events()]
    assert kinds.count(KvCacheEventKind.OFFLOADED) == 1 and kinds.count(KvCacheEventKind.STORED) == 2
    m.add_sequence(3, a, len(a))
    kinds = [e.kind for e in m.take_events()]
    assert KvCacheEventKind.ONBOARDED in kinds and KvCacheEventKind.REMOVED in kinds

    chained = make(event_buffer_max_size=100)
    run_context(chained, 1, prompt(0, 2 * T + 1))
    first, second = chained.take_events()
    assert second.parent_hash == first.block_hash != 0


def test_event_buffer_drops_oldest():
    m = make(event_buffer_max_size=2)
    run_context(m, 1, prompt(0, 3 * T + 1))
    events = m.take_events()
    assert [e.event_id for e in events] == [1, 2]
    assert m.take_events() == []
    quiet = make()  # event_buffer_max_size=0: nothing recorded
    run_context(quiet, 1, prompt(0, 3 * T + 1))
    assert quiet.take_events() == []


def test_stats_hit_rate():
    m = make()
    tokens = prompt(0, 3 * T)
    run_context(m, 1, tokens)
    run_context(m, 2, tokens + [1])
    stats = m.stats()
    assert (stats.reused_blocks, stats.missed_blocks) == (3, 3)
    assert stats.cache_hit_rate == pytest.approx(0.5)
    assert (stats.alloc_total_blocks, stats.alloc_new_blocks) == (3 + 4, 3 + 1)
    m.reset_stats()
    zeroed = m.stats()
    assert (zeroed.reused_blocks, zeroed.missed_blocks, zeroed.cache_hit_rate, zeroed.alloc_total_blocks) == (0, 0, 0.0, 0)
    assert zeroed.primary.num_cached_blocks == 3  # reset keeps the cache
    assert m.add_sequence(3, tokens + [2], 3 * T + 1).num_reused_blocks == 3
    assert m.stats().to_dict()["reused_blocks"] == 3


def test_no_block_referenced_after_all_sequences_end():
    m = make(num_primary_blocks=8, num_secondary_blocks=4, max_attention_window=2 * T)
    rng = np.random.default_rng(1)
    for seq_id in range(30):
        tokens = rng.integers(0, 3, size=int(rng.integers(1, 3 * T))).astype(np.int32)
        if m.can_add_sequence(tokens, len(tokens)):
            run_context(m, seq_id, tokens)
    stats = m.stats().primary
    assert stats.num_used_blocks == 0
    assert stats.num_free_blocks + stats.num_cached_blocks == 8
    assert m.check_invariants() == []


# ---- capacity queries -----------------------------------------------------------------------

def test_num_blocks_to_add_nets_out_held_reused_blocks():
    m = make(num_primary_blocks=6)
    tokens = prompt(0, 2 * T + 1)
    assert m.num_blocks_to_add(tokens, len(tokens)) == 3
    run_context(m, 1, tokens, release=False)
    assert m.num_blocks_to_add(tokens, len(tokens)) == 1  # two blocks are shared, already in use
    assert m.num_available_blocks() == 3
    assert m.can_add_sequence(tokens, 4 * T)
    assert not m.can_add_sequence(tokens, 6 * T)


def test_recomputed_duplicate_block_does_not_pin_available_blocks():
    m = make(tokens_per_block=2, num_primary_blocks=3, enable_partial_reuse=False)
    run_context(m, 0, [0, 0])  # [0, 0] cached, unreferenced
    m.add_sequence(1, [0, 0], 2)  # the last prompt token is always computed: no match
    for n in (1, 2):
        m.mark_computed(1, n)  # recomputes [0, 0]: the sequence's block takes the cached node over
    assert m.num_available_blocks() == 2  # the cached copy's block is free now
    m.allocate(1, 4)
    m.append_tokens(1, [5, 5])
    for n in (3, 4):
        m.mark_computed(1, n)  # the next block is stored below [0, 0], held by sequence 1 itself
    assert m.num_available_blocks() == 1
    assert m.can_allocate(1, 5)
    m.release(1)
    assert matched_blocks(m, [0, 0, 5, 5, 9]) == 2  # one chain, both blocks reusable
    assert m.stats().primary.num_cached_blocks == 2
    assert m.check_invariants() == []


def test_duplicate_let_go_by_its_other_holder_is_taken_over_before_the_chain_grows():
    m = make(num_primary_blocks=4, enable_partial_reuse=False)
    tokens = prompt(0, T + 1)
    m.add_sequence(1, tokens, len(tokens))
    m.add_sequence(2, tokens, 2 * T)  # nothing cached yet: both compute the first block
    m.mark_computed(1, T)
    m.mark_computed(2, T)  # sequence 1 holds the node: sequence 2's block stays a duplicate
    m.release(1)  # the node is unreferenced now, sequence 2 still holds its duplicate
    available = m.num_available_blocks()
    m.append_tokens(2, prompt(50, T - 1))
    m.mark_computed(2, 2 * T)  # the second block goes below the node: the node moves into the duplicate
    assert m.num_available_blocks() == available
    own_first_block = m.block_ids(2)[0]
    m.release(2)
    assert m.stats().primary.num_cached_blocks == 2  # one chain, no stray copy
    follow_up = tokens + prompt(50, T - 1) + [9]
    assert m.add_sequence(3, follow_up, len(follow_up)).num_reused_blocks == 2
    assert m.block_ids(3)[0] == own_first_block
    assert m.check_invariants() == []


def test_every_idle_ancestor_is_taken_over_not_only_the_parent():
    m = make(num_primary_blocks=6, enable_partial_reuse=False)
    tokens = prompt(0, 2 * T + 3)
    m.add_sequence(1, tokens, len(tokens))
    m.add_sequence(2, tokens, len(tokens))
    m.mark_computed(1, 2 * T)  # a0 -> a1 cached, held by sequence 1
    m.mark_computed(2, len(tokens))  # sequence 2 holds duplicates of both
    m.release(1)  # a0 and a1 are idle: unreferenced, evictable
    available = m.num_available_blocks()
    m.append_tokens(2, [99])
    m.mark_computed(2, 3 * T)  # a2 goes below a1: a1 and a0 move into sequence 2's duplicates
    assert m.num_available_blocks() == available
    m.release(2)
    assert matched_blocks(m, tokens + [99, 5]) == 3
    assert m.stats().primary.num_cached_blocks == 3
    assert m.check_invariants() == []


def test_request_filling_the_pool_exactly_is_admitted_without_partial_copy():
    m = make(tokens_per_block=2, num_primary_blocks=2)
    run_context(m, 0, [0, 1])  # cached, unreferenced: a partial match for [0, ...]
    assert m.match_prefix([0, 0, 0]).num_partial_tokens == 1
    # The copy would pin its source while both blocks are taken: one block short, so the token
    # is computed instead and the request fits.
    assert m.num_blocks_to_add([0, 0, 0], 3) == 2 == m.num_available_blocks()
    assert m.can_add_sequence([0, 0, 0], 3)
    r = m.add_sequence(1, [0, 0, 0], 3)
    assert (r.num_partial_tokens, r.num_reused_tokens, r.num_new_blocks) == (0, 0, 2)
    assert len(m.take_copy_ops()) == 0
    assert m.check_invariants() == []


def test_partial_copy_is_made_when_a_spare_block_exists():
    m = make(tokens_per_block=2, num_primary_blocks=3)
    run_context(m, 0, [0, 1])
    assert m.num_blocks_to_add([0, 0, 0], 3) == 2
    r = m.add_sequence(1, [0, 0, 0], 3)
    assert (r.num_partial_tokens, r.num_new_blocks) == (1, 2)
    assert len(m.take_copy_ops()) == 1
    assert m.num_available_blocks() == 1  # the source stays cached
    assert m.check_invariants() == []


# ---- Python boundary ------------------------------------------------------------------------

def test_block_table_is_an_int32_numpy_array():
    m = make()
    m.add_sequence(1, np.arange(2 * T + 1, dtype=np.int64), 2 * T + 1)  # any integer dtype is accepted
    table = m.block_ids(1)
    assert isinstance(table, np.ndarray) and table.dtype == np.int32 and table.shape == (3,)


def test_copy_ops_come_as_arrays():
    m = make(num_primary_blocks=1, num_secondary_blocks=1)
    run_context(m, 1, prompt(0, T))
    m.add_sequence(2, prompt(20, T), T)
    ops = m.take_copy_ops()
    assert len(ops) == 1
    assert ops.src_pool.dtype == np.uint8 and ops.src_block_ids.dtype == np.int32
    assert (int(ops.src_pool[0]), int(ops.dst_pool[0]), int(ops.num_tokens[0])) == (0, 1, T)
    assert len(m.take_copy_ops()) == 0


# ---- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens_per_block", [0, 3, 24, -8])
def test_tokens_per_block_must_be_a_power_of_two(tokens_per_block):
    with pytest.raises(ValueError, match="tokens_per_block"):
        make(tokens_per_block=tokens_per_block)


def test_pool_of_zero_primary_blocks_is_rejected():
    with pytest.raises(ValueError, match="num_primary_blocks"):
        make(num_primary_blocks=0)
    with pytest.raises(ValueError, match="num_secondary_blocks"):
        make(num_secondary_blocks=-1)


def test_extra_ids_of_the_wrong_length_are_rejected():
    m = make()
    with pytest.raises(ValueError, match="extra_ids"):
        m.add_sequence(1, [1, 2, 3], 3, extra_ids=np.zeros(2, dtype=np.uint64))
    assert not m.has_sequence(1)


def test_releasing_an_unknown_sequence_raises_key_error():
    m = make()
    with pytest.raises(KeyError, match="42"):
        m.release(42)
    with pytest.raises(KeyError, match="42"):
        m.allocate(42, 10)


def test_adding_a_known_sequence_id_is_rejected():
    m = make()
    m.add_sequence(1, [1, 2], 2)
    with pytest.raises(ValueError, match="already known"):
        m.add_sequence(1, [1, 2], 2)


def test_allocating_beyond_capacity_raises_runtime_error():
    m = make(num_primary_blocks=4)
    with pytest.raises(RuntimeError, match="needs 5 more KV cache blocks .* only 4 of 4"):
        m.add_sequence(1, prompt(0, 5 * T), 5 * T)
    assert not m.has_sequence(1) and m.stats().primary.num_free_blocks == 4
    m.add_sequence(1, prompt(0, T), T)
    with pytest.raises(RuntimeError, match="needs 4 more"):
        m.allocate(1, 5 * T)
    assert len(m.block_ids(1)) == 1
    assert m.check_invariants() == []


@pytest.mark.parametrize("bad", [[], np.array([1.5, 2.0]), "abc", [1, 2**40], np.zeros((2, 2), dtype=np.int32)])
def test_bad_token_ids_are_rejected(bad):
    with pytest.raises(ValueError, match="token_ids"):
        make().add_sequence(1, bad, 2)


def test_bad_progress_is_rejected():
    m = make()
    m.add_sequence(1, [1, 2, 3], 3)
    with pytest.raises(ValueError, match="known tokens"):
        m.mark_computed(1, 4)
    m.mark_computed(1, 3)
    with pytest.raises(ValueError, match="below"):
        m.mark_computed(1, 2)
    with pytest.raises(ValueError, match="num_tokens"):
        m.add_sequence(2, [1], 0)
    with pytest.raises(ValueError, match="priority"):
        m.add_sequence(2, [1], 1, priority=101)
