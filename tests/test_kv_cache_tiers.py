"""The third KV tier (docs/architecture.md#kv-cache-rules): blocks evicted from the host tier spill to
a disk or remote tier and are staged back into the host tier on a hit; one test per rule, through
kvtool._core. The data plane is tests/reference_kv_cache.py's KvStore: it runs the copy operations
and holds each token's identity, so a wrong block shows as a wrong identity."""

import hashlib

import numpy as np
import pytest
from reference_kv_cache import KvStore

from kvtool._core import CacheConfig, KVCacheManager, PoolKind, Scheduler, SchedulerConfig

T = 4  # tokens per block
PLAN = hashlib.sha256(b"plan A").digest()


def make(tier3=PoolKind.DISK, *, num_primary_blocks=4, num_secondary_blocks=2, num_tier3_blocks=8,
         plan_digest=PLAN, **kwargs):
    return KVCacheManager(CacheConfig(tokens_per_block=T, num_primary_blocks=num_primary_blocks,
                                      num_secondary_blocks=num_secondary_blocks, num_tier3_blocks=num_tier3_blocks,
                                      tier3_pool=tier3, plan_digest=plan_digest, **kwargs))


def prompt(start, n):
    return list(range(start, start + n))


def identity(tokens, j, lora=0, salt=0):
    return (lora, salt, tuple(tokens[:j + 1]))


class Engine:
    """A manager with a simulated KV store: computes prompts (writing each token's identity), runs
    every copy operation, and stages prompts from the third tier as an engine would."""

    def __init__(self, manager, remote=None):
        self.m = manager
        self.kv = KvStore(T, remote)
        self.next_id = 0

    def sync(self, fail=()):
        return self.kv.apply(self.m.take_copy_ops(), fail)

    def run(self, tokens, *, release=True, stage=True, fail=(), **kwargs):
        """Stages the prompt's third-tier blocks, adds it, computes it and checks every position."""
        if stage:
            self.stage(tokens, fail=fail, **kwargs)
        seq_id, self.next_id = self.next_id, self.next_id + 1
        r = self.m.add_sequence(seq_id, tokens, len(tokens), **kwargs)
        self.sync()
        table = self.m.block_ids(seq_id)
        for j in range(r.num_reused_tokens, len(tokens)):
            self.kv.write(int(table[j // T]), j % T, identity(tokens, j))
        for j in range(len(tokens)):  # reused or computed: every position holds its own KV
            assert self.kv.read(int(table[j // T]), j % T) == identity(tokens, j), j
        self.m.mark_computed(seq_id, len(tokens))
        if release:
            self.m.release(seq_id)
        assert self.m.check_invariants() == []
        return r

    def stage(self, tokens, *, fail=(), **kwargs):
        lookup = self.m.tier3_lookup(tokens, **{k: v for k, v in kwargs.items() if k != "priority"})
        if self.m.config.tier3_pool == PoolKind.DISK:
            present = lookup.num_known_blocks
        else:
            present = next((j for j, key in enumerate(lookup.keys) if key not in self.kv.remote), len(lookup.keys))
        result = self.m.stage_tier3(tokens, present, **kwargs)
        failed = self.sync(fail)
        self.m.complete_staging([block for _, block in failed])
        return result


def ops_of(arrays):
    return [(PoolKind(int(s)), PoolKind(int(d))) for s, d in zip(arrays.src_pool, arrays.dst_pool)]


def fill(engine, start, num_prompts=3):
    """Prompts of new tokens that push older blocks down the tiers."""
    for k in range(num_prompts):
        engine.run(prompt(start + 100 * k, 4 * T))


def spilled(manager, num_blocks=2, remote=None):
    """An engine whose system prompt of num_blocks blocks (+ 1 token) went down to the third tier."""
    e = Engine(manager, remote)
    system = prompt(0, num_blocks * T + 1)
    e.run(system)
    fill(e, 1000)
    return e, system


# ---- spilling and staging -----------------------------------------------------------------

@pytest.mark.parametrize("tier3", [PoolKind.DISK, PoolKind.REMOTE])
def test_block_evicted_from_host_spills_to_the_third_tier_and_is_staged_back(tier3):
    e, system = spilled(make(tier3))
    assert e.m.match_prefix(system).num_matched_blocks == 0  # neither in the primary nor the host tier
    stats = e.m.stats()
    assert stats.tier3_traffic.spilled_blocks > 0 and stats.tier3.num_cached_blocks > 0
    lookup = e.m.tier3_lookup(system)
    assert (lookup.num_local_blocks, lookup.num_known_blocks, len(lookup.keys)) == (0, 2, 2)
    assert e.stage(system).num_staged_blocks == 2
    assert e.m.match_prefix(system).num_secondary_blocks == 2  # staged into the host tier
    r = e.run(system, stage=False)
    assert (r.num_reused_blocks, r.num_onboarded_blocks, r.missed.total) == (2, 2, 0)
    stats = e.m.stats()
    assert stats.tier(tier3).hit_blocks == 2 and stats.tier(PoolKind.SECONDARY).hit_blocks == 0
    assert stats.tier3_traffic.staged_blocks == 2


def test_staging_fetches_into_the_host_tier_never_into_the_primary_pool():
    e, system = spilled(make())
    available = e.m.num_available_blocks()
    e.m.stage_tier3(system, 2)
    ops = e.m.take_copy_ops()
    fetches = [op for op in ops_of(ops) if op[0] == PoolKind.DISK]
    assert fetches == [(PoolKind.DISK, PoolKind.SECONDARY)] * 2
    assert all(dst != PoolKind.PRIMARY for _, dst in ops_of(ops))
    assert e.m.num_available_blocks() == available  # the primary pool is untouched
    e.kv.apply(ops)
    e.m.complete_staging([])


def test_copies_into_and_out_of_the_third_tier_carry_their_block_keys():
    e = Engine(make())
    system = prompt(0, 2 * T + 1)
    e.run(system)
    for k in range(3):
        e.m.add_sequence(100 + k, prompt(1000 + 100 * k, 4 * T), 4 * T)
        e.m.mark_computed(100 + k, 4 * T)
        e.m.release(100 + k)
    ops = e.m.take_copy_ops()
    spills = [i for i, op in enumerate(ops_of(ops)) if op == (PoolKind.SECONDARY, PoolKind.DISK)]
    assert len(spills) > 0 and len(ops.tier3_keys) == len(spills)
    assert set(e.m.tier3_keys(system)) <= set(ops.tier3_keys)  # the system prompt's blocks went down
    assert all(len(key) == 32 for key in ops.tier3_keys)


def test_block_in_the_third_tier_but_not_staged_is_missed_as_not_staged():
    e, system = spilled(make())
    r = e.run(system, stage=False)
    assert r.num_reused_blocks == 0
    assert (r.missed.not_staged, r.missed.total) == (2, 2)
    assert r.missed.to_dict()["never_seen"] == 0 and "not_staged" not in r.missed.to_dict()
    assert r.missed.to_dict(tier3=True)["not_staged"] == 2


def test_staging_is_a_transaction_that_add_sequence_waits_for():
    e, system = spilled(make())
    e.m.stage_tier3(system, 2)
    assert e.m.staging_open()
    assert e.m.match_prefix(system).num_matched_blocks == 0  # not matchable before it is confirmed
    with pytest.raises(RuntimeError, match="complete_staging"):
        e.m.add_sequence(99, system, len(system))
    with pytest.raises(RuntimeError, match="complete_staging"):
        e.m.stage_tier3(system, 2)
    e.sync()
    e.m.complete_staging([])
    assert not e.m.staging_open()
    assert e.m.match_prefix(system).num_matched_blocks == 2


@pytest.mark.parametrize("failed_block", [0, 1])
def test_failed_fetch_is_a_miss_and_the_chain_after_it_goes_too(failed_block):
    e, system = spilled(make(num_secondary_blocks=3), 3)
    e.stage(system, fail={failed_block})
    stats = e.m.stats()
    assert stats.tier3_traffic.fetch_failed_blocks == 3 - failed_block
    assert stats.tier3_traffic.staged_blocks == failed_block
    r = e.run(system, stage=False)  # positions are checked: no wrong token from a failed fetch
    assert r.num_reused_blocks == failed_block
    assert r.missed.fetch_failed == 3 - failed_block


def test_fetch_of_a_block_that_is_not_a_staging_fetch_is_rejected():
    e = Engine(make())
    with pytest.raises(ValueError, match="host block 1"):
        e.m.stage_tier3(prompt(0, 9), 0)  # nothing staged
        e.m.complete_staging([1])


def test_only_blocks_of_the_offload_priority_go_down_the_tiers():
    e = Engine(make(secondary_offload_min_priority=50))
    older, newer = prompt(0, 2 * T + 1), prompt(500, 2 * T + 1)
    e.run(older, priority=60)
    e.run(newer, priority=60)
    fill(e, 1000)  # priority 35: dropped from the primary pool, never reaching the host tier
    stats = e.m.stats()
    assert stats.tier(PoolKind.SECONDARY).stored_blocks == 4 and stats.tier3_traffic.spilled_blocks == 2
    assert e.m.tier3_lookup(older).num_known_blocks == 2  # spilled to make room for the newer ones
    assert e.m.match_prefix(newer).num_secondary_blocks == 2
    assert e.m.stats().tier(PoolKind.PRIMARY).evicted_blocks == 3 * 4 - 4  # the filler, less what stays


def test_third_tier_evicts_its_least_recently_used_leaf():
    e = Engine(make(num_tier3_blocks=2))
    first, second = prompt(0, T + 1), prompt(500, T + 1)
    e.run(first)
    e.run(second)
    fill(e, 1000, num_prompts=4)
    assert e.m.tier3_lookup(first).num_known_blocks == 0
    stats = e.m.stats()
    assert stats.tier(PoolKind.DISK).evicted_blocks > 0
    r = e.run(first)
    assert r.missed.evicted_disk == 1


def test_counters_say_how_many_token_slots_moved_in_and_out_of_each_tier():
    e, system = spilled(make())
    e.run(system)
    d = e.m.stats().to_dict(tier3=True)
    assert d["disk_num_tokens_in"] == T * d["spilled_blocks"]
    assert d["disk_num_tokens_out"] == T * d["staged_blocks"] == 2 * T
    assert d["secondary_num_tokens_out"] >= d["disk_num_tokens_in"] + d["num_onboarded_tokens"]
    assert d["disk_hit_blocks"] == 2


# ---- the remote store: an index the manager does not own -----------------------------------

def test_remote_lookup_finds_blocks_another_engine_stored():
    shared = {}  # the store both engines point at
    a = Engine(make(PoolKind.REMOTE), shared)
    b = Engine(make(PoolKind.REMOTE, num_secondary_blocks=3), shared)
    system = prompt(0, 3 * T + 1)
    a.run(system)
    fill(a, 1000)  # engine a's blocks of the system prompt spill to the store
    assert set(a.m.tier3_keys(system)[:3]) <= set(shared)
    lookup = b.m.tier3_lookup(system)
    assert lookup.num_known_blocks == 0 and len(lookup.keys) == 3  # b never saw them
    assert b.stage(system).num_staged_blocks == 3
    assert b.m.stats().tier3_traffic.discovered_blocks == 3
    r = b.run(system, stage=False)  # positions are checked against engine a's KV
    assert (r.num_reused_blocks, r.missed.total) == (3, 0)
    assert b.m.stats().tier(PoolKind.REMOTE).hit_blocks == 3


def test_remote_index_entry_the_store_evicted_is_dropped_at_lookup():
    e, system = spilled(make(PoolKind.REMOTE, num_tier3_blocks=16))
    keys = e.m.tier3_keys(system)
    del e.kv.remote[keys[1]]  # the store's own memory policy
    assert e.m.tier3_lookup(system).num_known_blocks == 2  # the manager still believes it
    result = e.stage(system)
    assert (result.num_staged_blocks, result.num_lost_blocks) == (1, 1)
    r = e.run(system, stage=False)
    assert r.num_reused_blocks == 1 and r.missed.evicted_remote == 1


def test_remote_fetch_of_a_block_evicted_after_the_lookup_is_a_miss():
    e, system = spilled(make(PoolKind.REMOTE))
    e.m.stage_tier3(system, 2)
    e.kv.remote.clear()  # between the lookup and the fetch: a restart of the store
    failed = e.sync()
    assert len(failed) == 2
    e.m.complete_staging([block for _, block in failed])
    r = e.run(system, stage=False)
    assert r.num_reused_blocks == 0 and r.missed.fetch_failed == 2


@pytest.mark.parametrize("change", ["plan", "salt", "lora", "extra_ids", "prefix"])
def test_remote_keys_of_anything_that_changes_kv_differ(change):
    tokens = prompt(0, 2 * T)
    base = make(PoolKind.REMOTE).tier3_keys(tokens)
    if change == "plan":
        other = make(PoolKind.REMOTE, plan_digest=hashlib.sha256(b"plan B").digest()).tier3_keys(tokens)
    elif change == "salt":
        other = make(PoolKind.REMOTE).tier3_keys(tokens, cache_salt=7)
    elif change == "lora":
        other = make(PoolKind.REMOTE).tier3_keys(tokens, lora_task_id=3)
    elif change == "extra_ids":
        other = make(PoolKind.REMOTE).tier3_keys(tokens, extra_ids=np.array([0] * T + [9] + [0] * (T - 1), np.uint64))
    else:  # the same second block after another first block
        other = make(PoolKind.REMOTE).tier3_keys(prompt(100, T) + tokens[T:])
    assert base[1] != other[1]
    if change == "extra_ids":
        assert base[0] == other[0]  # all-zero extra ids key as none


def test_remote_keys_are_a_sha256_chain_over_plan_and_prefix():
    """An independent restatement of the key (docs/architecture.md#kv-cache-rules)."""
    tokens, extras, lora, salt = prompt(7, 2 * T), [0, 0, 5, 0] + [0] * T, 3, 11
    got = make(PoolKind.REMOTE).tier3_keys(tokens, extra_ids=np.array(extras, np.uint64), lora_task_id=lora,
                                           cache_salt=salt)
    key = hashlib.sha256(b"kvtool tier-3 block key v1\0" + PLAN).digest()
    want = []
    for i in range(2):
        block, block_extras = tokens[i * T:(i + 1) * T], extras[i * T:(i + 1) * T]
        h = hashlib.sha256(key + lora.to_bytes(8, "little") + salt.to_bytes(8, "little") + T.to_bytes(4, "little"))
        h.update(b"".join(t.to_bytes(4, "little") for t in block))
        h.update(b"\1" + b"".join(x.to_bytes(8, "little") for x in block_extras) if any(block_extras) else b"\0")
        key = h.digest()
        want.append(key)
    assert got == want


# ---- configuration and the scheduler ------------------------------------------------------

def test_third_tier_needs_a_host_tier():
    with pytest.raises(ValueError, match="num_secondary_blocks > 0"):
        make(num_secondary_blocks=0)


def test_remote_tier_needs_a_plan_identity():
    with pytest.raises(ValueError, match="plan_digest is all zero"):
        make(PoolKind.REMOTE, plan_digest=b"")
    with pytest.raises(ValueError, match="32 bytes"):
        make(PoolKind.REMOTE, plan_digest=b"short")


def test_tier3_pool_must_be_disk_or_remote():
    with pytest.raises(ValueError, match="tier3_pool"):
        make(PoolKind.SECONDARY)


def test_third_tier_calls_without_one_name_the_missing_setting():
    m = KVCacheManager(CacheConfig(tokens_per_block=T, num_primary_blocks=4))
    with pytest.raises(ValueError, match="num_tier3_blocks > 0"):
        m.tier3_lookup(prompt(0, 9))


def test_without_a_third_tier_the_counters_and_reasons_keep_their_names():
    m = KVCacheManager(CacheConfig(tokens_per_block=T, num_primary_blocks=4))
    assert "missed_not_staged_blocks" not in m.stats().to_dict()
    assert list(m.stats().missed.to_dict()) == ["never_seen", "evicted_primary", "evicted_host", "identity",
                                                "partial", "last_token", "reuse_off"]
    assert m.stats().tier3.num_blocks == 0


def test_scheduled_batch_carries_the_keys_of_its_spills():
    config = CacheConfig(tokens_per_block=T, num_primary_blocks=4, num_secondary_blocks=1, num_tier3_blocks=4,
                         tier3_pool=PoolKind.DISK)
    s = Scheduler(config, SchedulerConfig(max_batch_size=1, max_num_tokens=64, max_seq_len=64))
    keys = []
    for k in range(4):
        s.add_request(k, prompt(100 * k, 3 * T), 1)
        while s.has_unfinished_requests():
            batch = s.schedule()
            keys += batch.copy_ops.tier3_keys
            s.complete_step([r.request_id for r in batch.requests if r.samples], [1] * sum(r.samples for r in batch.requests))
    assert s.cache_manager.stats().tier3_traffic.spilled_blocks == len(keys) > 0
