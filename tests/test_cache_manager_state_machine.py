"""Random add / grow / append / compute / release / pause sequences against the reference model.

Besides comparing every observable result with tests/reference_kv_cache.py, the machine keeps a
simulated KV store: it executes the manager's copy operations in the order given and writes each
computed token's identity (its whole prefix, extra ids, LoRA id and salt) into the sequence's
blocks. Every computed position of every running sequence must then hold exactly its own
identity, which catches wrong reuse, a bad copy order and blocks overwritten while in use.

Requests carry retention ranges and the clock advances, so priorities revert. With a third tier
(disk, or a remote store that other engines write to and that evicts on its own), a request is
staged before it is added: the store answers the lookup from the keys the manager wrote (SHA-256
bytes), the reference from its exact tuple keys, and both counts must agree; fetches fail now and
then, and a request may come unstaged.
"""

import hashlib

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from reference_kv_cache import KvStore, ReferenceKVCache

from kvtool._core import CacheConfig, KVCacheManager, PoolKind, RetentionRange

TOKENS_PER_BLOCK = 4
fresh_tokens_st = st.lists(st.integers(0, 2), max_size=6)  # 3 ids: prefixes collide often
PLAN_DIGEST = hashlib.sha256(b"state machine plan").digest()


@st.composite
def ranges_st(draw):
    """Up to two retention ranges (start, end or None, priority, duration or None), sorted, apart."""
    ranges, position = [], 0
    for _ in range(draw(st.integers(0, 2))):
        start = position + draw(st.integers(0, 6))
        end = None if draw(st.integers(0, 3)) == 0 else start + draw(st.integers(1, 8))
        ranges.append((start, end, draw(st.sampled_from([0, 10, 35, 60, 90])),
                       draw(st.sampled_from([None, 5, 20, 100]))))
        if end is None:
            break
        position = end
    return ranges


def retention_arg(ranges):
    return [RetentionRange(start, end, priority, duration) for start, end, priority, duration in ranges]

class CacheManagerMachine(RuleBasedStateMachine):
    key_hash_bits = 64  # full block keys; the subclasses below truncate them so that keys collide

    @initialize(num_primary=st.integers(6, 12), num_secondary=st.integers(0, 6), partial=st.booleans(),
                min_priority=st.sampled_from([0, 35, 50]), window=st.sampled_from([0, 0, 8, 10]),
                reuse=st.sampled_from([True, True, True, False]), num_tier3=st.sampled_from([0, 0, 2, 5, 9]),
                tier3=st.sampled_from(["disk", "remote"]))
    def setup(self, num_primary, num_secondary, partial, min_priority, window, reuse, num_tier3, tier3):
        num_tier3 = num_tier3 if num_secondary > 0 else 0  # the third tier stages through the host tier
        kwargs = dict(tokens_per_block=TOKENS_PER_BLOCK, num_primary_blocks=num_primary,
                      num_secondary_blocks=num_secondary, enable_block_reuse=reuse, enable_partial_reuse=partial,
                      secondary_offload_min_priority=min_priority, max_attention_window=window)
        pool = PoolKind.DISK if tier3 == "disk" else PoolKind.REMOTE
        self.manager = KVCacheManager(CacheConfig(**kwargs, num_tier3_blocks=num_tier3, tier3_pool=pool,
                                                  plan_digest=PLAN_DIGEST), key_hash_bits=self.key_hash_bits)
        self.ref = ReferenceKVCache(**kwargs, num_tier3_blocks=num_tier3, tier3=tier3)
        self.kv = KvStore(TOKENS_PER_BLOCK)
        self.tier3 = tier3 if num_tier3 > 0 and reuse else None
        self.now = 0
        self.window = window
        self.seqs = {}  # id -> dict(tokens, extras, lora, salt, priority)
        self.history = [[0, 1, 2, 0, 1, 2, 0, 1, 2]]  # token lists seen, to draw shared prefixes from
        self.next_id = 0
        self.released = []  # (tokens, extras, lora, salt, priority) of released sequences

    # ---- helpers ----------------------------------------------------------------------------
    def _identity(self, seq, j):
        extras = seq["extras"] or [0] * len(seq["tokens"])
        return (seq["lora"], seq["salt"], tuple(seq["tokens"][: j + 1]), tuple(extras[: j + 1]))

    def _sync_copies(self):
        assert self.kv.apply(self.manager.take_copy_ops()) == []  # nothing but a staging fetches

    def _stage(self, data, tokens, extras, lora, salt, priority, ranges):
        """What the engine does before it adds a request: looks the prompt's blocks up in the third
        tier, stages those the store holds into the host tier, runs the fetches (some may fail) and
        confirms them. Sometimes fewer blocks (a lookup cut short) or none (a request added unstaged)."""
        extras_arg = None if extras is None else np.array(extras, dtype=np.uint64)
        ckw = dict(extra_ids=extras_arg, lora_task_id=lora, cache_salt=salt)
        lookup = self.manager.tier3_lookup(tokens, **ckw)
        want, ref_keys = self.ref.tier3_lookup(tokens, extras, lora, salt)
        assert {"num_local_blocks": lookup.num_local_blocks, "num_known_blocks": lookup.num_known_blocks} == want
        assert len(lookup.keys) == len(ref_keys)
        if self.tier3 == "disk":
            num_present = lookup.num_known_blocks
        else:  # the store's answer from the manager's keys must be the reference's from the exact ones
            num_present = next((j for j, key in enumerate(lookup.keys) if key not in self.kv.remote), len(ref_keys))
            assert num_present == next((j for j, key in enumerate(ref_keys) if key not in self.ref.remote_keys),
                                       len(ref_keys))
        how = data.draw(st.sampled_from(["all", "all", "all", "fewer", "unstaged"]))
        if how == "unstaged":
            return
        if how == "fewer":
            num_present = data.draw(st.integers(0, num_present))
        got = self.manager.stage_tier3(tokens, num_present, priority=priority, retention=retention_arg(ranges), **ckw)
        num_local, staged, num_lost = self.ref.stage(tokens, num_present, extras, lora, salt, priority, ranges)
        assert (got.num_local_blocks, got.num_staged_blocks, got.num_lost_blocks) == (num_local, len(staged), num_lost)
        assert self.manager.staging_open() == bool(staged)
        fail = set()
        if staged and data.draw(st.integers(0, 4)) == 0:
            fail.add(data.draw(st.integers(0, len(staged) - 1)))  # a read error, a timeout, a bad value
        failed = self.kv.apply(self.manager.take_copy_ops(), fail)
        self.manager.complete_staging([block for _, block in failed])
        self.ref.complete_staging([staged[index] for index, _ in failed])
        event(f"staged {min(len(staged), 3)}+ blocks" + (", a fetch failed" if failed else ""))
        if num_lost:
            event("a remote index entry was lost")

    def _add(self, tokens, extras, lora, salt, priority, num_tokens, ranges=(), data=None):
        if self.tier3 is not None and data is not None:
            self._stage(data, tokens, extras, lora, salt, priority, ranges)
        seq_id = self.next_id
        self.next_id += 1
        extras_arg = None if extras is None else np.array(extras, dtype=np.uint64)
        kw = dict(extras=extras, lora=lora, salt=salt)
        ckw = dict(extra_ids=extras_arg, lora_task_id=lora, cache_salt=salt)
        match, want_match = self.manager.match_prefix(tokens, **ckw), self.ref.match_prefix(tokens, **kw)
        assert {name: getattr(match, name) for name in want_match} == want_match
        assert self.manager.num_blocks_to_add(tokens, num_tokens, **ckw) == self.ref.num_blocks_to_add(tokens, num_tokens, **kw)
        can = self.ref.can_add_sequence(tokens, num_tokens, **kw)
        assert self.manager.can_add_sequence(tokens, num_tokens, **ckw) == can
        if not can:
            try:
                self.manager.add_sequence(seq_id, tokens, num_tokens, priority=priority, **ckw)
            except RuntimeError:
                event("add_sequence refused: blocks lack")
                return
            raise AssertionError("add_sequence succeeded although blocks lack")
        event("add_sequence")
        needed, available = self.manager.num_blocks_to_add(tokens, num_tokens, **ckw), self.manager.num_available_blocks()
        got = self.manager.add_sequence(seq_id, np.array(tokens, dtype=np.int32), num_tokens, priority=priority,
                                        retention=retention_arg(ranges), **ckw)
        want = self.ref.add_sequence(seq_id, tokens, num_tokens, priority=priority, ranges=ranges, **kw)
        # What num_blocks_to_add promised is exactly what the sequence took.
        assert self.manager.num_available_blocks() == available - needed
        want_missed = want.pop("missed")
        assert {k: getattr(got, k) for k in want} == want
        # Why each missed block was missed: one reason per block, as the reference judges it. The
        # reasons come from a history of block keys: with truncated keys a block may be counted
        # under another block's reason, so those runs check only that every missed block has one.
        if self.key_hash_bits == 64:
            assert got.missed.to_dict(tier3=self.tier3 is not None) == want_missed
        assert got.missed.total == len(tokens) // TOKENS_PER_BLOCK - got.num_reused_blocks
        for name in ("num_reused_blocks", "num_onboarded_blocks", "num_partial_tokens", "num_early_reused_blocks"):
            if want[name]:
                event(f"add_sequence with {name} > 0")
        for reason, count in want_missed.items():
            if count:
                event(f"missed: {reason}")
        self._sync_copies()
        self.seqs[seq_id] = dict(tokens=list(tokens), extras=None if extras is None else list(extras), lora=lora,
                                 salt=salt, priority=priority, ranges=list(ranges))
        return seq_id

    # ---- rules ------------------------------------------------------------------------------
    @rule(data=st.data(), fresh=fresh_tokens_st, lora=st.sampled_from([0, 0, 0, 1]),
          salt=st.sampled_from([0, 0, 0, 5]), priority=st.sampled_from([10, 35, 35, 60]),
          extra_room=st.integers(0, 4), with_extras=st.sampled_from([False, False, True]), ranges=ranges_st())
    def add(self, data, fresh, lora, salt, priority, extra_room, with_extras, ranges):
        # Mostly an earlier prompt (cut anywhere) plus a few new tokens: lots of shared prefixes.
        base = data.draw(st.sampled_from(self.history[-4:]))
        cut = data.draw(st.sampled_from([len(base), len(base), 0]) | st.integers(0, len(base)))
        tokens = (base[:cut] + fresh)[:16] or [1]
        extras = None
        if with_extras:
            extras = data.draw(st.lists(st.sampled_from([0, 0, 7]), min_size=len(tokens), max_size=len(tokens)))
        self.history.append(tokens)
        seq_id = self._add(tokens, extras, lora, salt, priority, len(tokens) + extra_room, ranges, data)
        if seq_id is not None and data.draw(st.booleans()):
            self._compute(seq_id, data.draw(st.integers(1, 16)))  # its first context step

    @rule(data=st.data())
    def resubmit_released(self, data):
        """An earlier request comes back (A, B, A, B): its blocks may have moved to the host tier."""
        if not self.released:
            return
        tokens, extras, lora, salt, priority, ranges = data.draw(st.sampled_from(self.released[-3:]))
        seq_id = self._add(tokens, extras, lora, salt, priority, len(tokens), ranges, data)
        if seq_id is not None:
            self._compute(seq_id, len(tokens))

    @rule(data=st.data(), num_flood=st.integers(1, 8), flood_priority=st.sampled_from([10, 35, 60]))
    def flood_and_return(self, data, num_flood, flood_priority):
        """An earlier request returns after requests of new tokens pushed its blocks out of the
        primary pool and the host tier: its misses are evicted_primary / evicted_host."""
        if not self.released:
            return
        tokens, extras, lora, salt, priority, ranges = data.draw(st.sampled_from(self.released[-3:]))
        for k in range(num_flood):
            flood = [3 + (self.next_id + k + j) % 5 for j in range(12)]  # token ids no other rule uses
            seq_id = self._add(flood, None, 0, 0, flood_priority, len(flood))
            if seq_id is not None:
                self._compute(seq_id, len(flood))
                self._release(seq_id)
        seq_id = self._add(tokens, extras, lora, salt, priority, len(tokens), ranges, data)
        if seq_id is not None:
            self._compute(seq_id, len(tokens))

    @rule(tokens=st.lists(st.integers(0, 2), min_size=8, max_size=16), priority=st.sampled_from([10, 35, 60]))
    def churn(self, tokens, priority):
        """A whole request passes through: computed and released, pushing older blocks out."""
        seq_id = self._add(tokens, None, 0, 0, priority, len(tokens))
        if seq_id is not None:
            self._compute(seq_id, len(tokens))
            self._release(seq_id)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=5, max_size=14), extra_room=st.integers(0, 8),
          lead=st.integers(1, 14))
    def twins(self, tokens, extra_room, lead):
        """Two requests with one prompt computed side by side: the second one's blocks duplicate
        the first one's, which later let go (release) while the second keeps computing."""
        first = self._add(tokens, None, 0, 0, 35, len(tokens) + extra_room)
        second = self._add(tokens, None, 0, 0, 35, len(tokens) + extra_room)
        if first is not None:
            self._compute(first, lead)
        if second is not None:
            self._compute(second, len(tokens))

    @rule(tokens=st.lists(st.integers(0, 2), min_size=5, max_size=14),
          answer=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def twins_first_leaves(self, tokens, answer):
        """As twins, then the first request ends while the second generates its answer: the
        blocks the second one stores go below cached blocks it only duplicated."""
        first = self._add(tokens, None, 0, 0, 35, len(tokens))
        second = self._add(tokens, None, 0, 0, 35, len(tokens) + len(answer))
        if first is None or second is None:
            return
        self._compute(first, len(tokens))
        self._compute(second, len(tokens))
        self._release(first)
        self._append(second, answer)
        self._compute(second, len(answer))

    @rule(data=st.data(), more=st.integers(1, 8))
    def grow(self, data, more):
        if not self.seqs:
            return
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        target = len(self.manager.block_ids(seq_id)) * TOKENS_PER_BLOCK + more
        can = self.ref.can_allocate(seq_id, target)
        assert self.manager.can_allocate(seq_id, target) == can
        if can:
            available, num_blocks = self.manager.num_available_blocks(), len(self.manager.block_ids(seq_id))
            self.manager.allocate(seq_id, target)
            self.ref.allocate(seq_id, target)
            self._sync_copies()
            num_new = len(self.manager.block_ids(seq_id)) - num_blocks
            assert self.manager.num_available_blocks() == available - num_new

    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def append(self, data, tokens):
        if not self.seqs:
            return
        self._append(data.draw(st.sampled_from(sorted(self.seqs))), tokens)

    def _append(self, seq_id, tokens):
        self.manager.append_tokens(seq_id, tokens)
        self.ref.append_tokens(seq_id, tokens)
        seq = self.seqs[seq_id]
        seq["tokens"] += tokens
        if seq["extras"] is not None:
            seq["extras"] += [0] * len(tokens)

    @rule(data=st.data(), amount=st.integers(1, 9))
    def compute(self, data, amount):
        if not self.seqs:
            return
        self._compute(data.draw(st.sampled_from(sorted(self.seqs))), amount)

    def _compute(self, seq_id, amount):
        seq = self.seqs[seq_id]
        before = self.manager.num_computed_tokens(seq_id)
        capacity = len(self.manager.block_ids(seq_id)) * TOKENS_PER_BLOCK
        after = min(before + amount, len(seq["tokens"]), capacity)
        table = self.manager.block_ids(seq_id)
        for j in range(before, after):  # the forward writes the new tokens' KV
            self.kv.write(int(table[j // TOKENS_PER_BLOCK]), j % TOKENS_PER_BLOCK, self._identity(seq, j))
        available, num_free = self.manager.num_available_blocks(), self.manager.stats().primary.num_free_blocks
        self.manager.mark_computed(seq_id, after)
        self.ref.mark_computed(seq_id, after)
        self._sync_copies()
        # Computing hands no block out: available blocks never shrink (the scheduler's
        # GUARANTEED_NO_EVICT reservations rely on it), whatever duplicates the sequence computed.
        assert self.manager.num_available_blocks() >= available
        if self.window == 0 and self.manager.stats().primary.num_free_blocks > num_free:
            event("mark_computed took a cached node over (its old block freed)")

    @rule(data=st.data())
    def release(self, data):
        if not self.seqs:
            return
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self._release(seq_id)

    def _release(self, seq_id):
        seq = self.seqs.pop(seq_id)
        self.history.append(seq["tokens"][:16])
        self.released.append((seq["tokens"][:16], None if seq["extras"] is None else seq["extras"][:16],
                              seq["lora"], seq["salt"], seq["priority"], seq["ranges"]))
        available = self.manager.num_available_blocks()
        self.manager.release(seq_id)
        self.ref.release(seq_id)
        assert self.manager.num_available_blocks() >= available

    @rule(data=st.data())
    def pause_and_resume(self, data):
        if not self.seqs:
            return
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs.pop(seq_id)
        self.manager.release(seq_id)
        self.ref.release(seq_id)
        tokens = seq["tokens"][:20]
        extras = None if seq["extras"] is None else seq["extras"][:20]
        self._add(tokens, extras, seq["lora"], seq["salt"], seq["priority"], len(tokens), seq["ranges"], data)

    @rule(step_ms=st.sampled_from([1, 5, 20, 60]))
    def advance_time(self, step_ms):
        """The engine's clock moves on: priorities whose duration ran out revert to 35."""
        self.now += step_ms
        self.manager.set_time(self.now)
        self.ref.set_time(self.now)

    # ---- the remote store, as other engines and its own eviction change it ------------------
    def _remote_block(self, data):
        """A block of a prompt seen before: (bytes key, exact key, identities of its tokens)."""
        tokens, extras, lora, salt, _, _ = data.draw(st.sampled_from(self.released[-4:]))
        num_blocks = len(tokens) // TOKENS_PER_BLOCK
        if num_blocks == 0:
            return None
        i = data.draw(st.integers(0, num_blocks - 1))
        extras_arg = None if extras is None else np.array(extras, dtype=np.uint64)
        key = self.manager.tier3_keys(tokens, extra_ids=extras_arg, lora_task_id=lora, cache_salt=salt)[i]
        exact = self.ref.keys(tokens, extras, lora, salt)[i]
        seq = dict(tokens=tokens, extras=extras, lora=lora, salt=salt)
        identities = [self._identity(seq, j) for j in range(i * TOKENS_PER_BLOCK, (i + 1) * TOKENS_PER_BLOCK)]
        return key, exact, identities

    @rule(data=st.data(), num_blocks=st.integers(1, 3))
    def another_engine_stores(self, data, num_blocks):
        """Another engine on the same store wrote blocks (of prompts this one has seen too)."""
        if self.tier3 != "remote" or not self.released:
            return
        for _ in range(num_blocks):
            block = self._remote_block(data)
            if block is not None:
                key, exact, identities = block
                self.kv.remote[key] = identities
                self.ref.remote_keys.add(exact)

    @rule(data=st.data(), everything=st.sampled_from([False, False, False, True]))
    def store_evicts(self, data, everything):
        """The store dropped a block on its own (its memory policy), or everything (a restart)."""
        if self.tier3 != "remote" or not self.released:
            return
        if everything:
            self.kv.remote.clear()
            self.ref.remote_keys.clear()
            return
        block = self._remote_block(data)
        if block is not None:
            key, exact, _ = block
            self.kv.remote.pop(key, None)
            self.ref.remote_keys.discard(exact)

    # ---- checks after every step ------------------------------------------------------------
    @invariant()
    def manager_matches_reference(self):
        if not hasattr(self, "manager"):
            return
        assert self.manager.check_invariants() == []
        got = self.manager.stats().to_dict(tier3=True)
        for name in ("evicted_blocks", "offloaded_blocks", "spilled_blocks", "discovered_blocks",
                     "fetch_failed_blocks", "missed_not_staged_blocks"):
            if got[name]:
                event(f"{name} > 0")
        want = self.ref.stats_dict()
        if self.key_hash_bits < 64:  # the reasons' totals only (see _add)
            want = {k: v for k, v in want.items() if not (k.startswith("missed_") and k != "missed_blocks")}
        assert {k: got[k] for k in want} == want
        if self.ref.history.num_forgotten:
            event("the key history forgot a generation")
        assert self.manager.num_available_blocks() == self.ref.num_available_blocks()

    @invariant()
    def computed_positions_hold_their_own_kv(self):
        if not hasattr(self, "manager"):
            return
        for seq_id, seq in self.seqs.items():
            table = self.manager.block_ids(seq_id)
            for j in range(self.manager.num_computed_tokens(seq_id)):
                block = int(table[j // TOKENS_PER_BLOCK])
                if block == -1:
                    continue  # released by the sliding window
                assert self.kv.read(block, j % TOKENS_PER_BLOCK) == self._identity(seq, j), (seq_id, j)

    def teardown(self):
        if not hasattr(self, "manager"):
            return
        event(f"steps: {self.next_id // 10 * 10}+ sequences")
        for seq_id in range(self.next_id):  # also one a failed check left out of self.seqs
            if self.manager.has_sequence(seq_id):
                self.manager.release(seq_id)
        stats = self.manager.stats()
        assert stats.primary.num_used_blocks == 0
        assert self.manager.check_invariants() == []


CacheManagerMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_cache_manager_matches_reference = CacheManagerMachine.TestCase


class CollidingKeysMachine(CacheManagerMachine):
    """Every block key hashes to 0: only the stored key fields tell blocks apart."""

    key_hash_bits = 0


class EightBucketKeysMachine(CacheManagerMachine):
    """Keys of 3 bits: some blocks collide, others do not."""

    key_hash_bits = 3


for _machine in (CollidingKeysMachine, EightBucketKeysMachine):
    _machine.TestCase.settings = settings(
        max_examples=100, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_cache_manager_with_colliding_keys_matches_reference = CollidingKeysMachine.TestCase
test_cache_manager_with_3_bit_keys_matches_reference = EightBucketKeysMachine.TestCase
