"""A short pure-Python model of the KV cache rules (docs/architecture.md#kv-cache-rules).

It is written independently of the C++ manager, for clarity rather than speed: block identity
is the exact nested tuple (parent key, tokens, extra ids, LoRA task id, cache salt) (no hashing,
so no collisions), pools are counts, eviction is a min() over candidates. It predicts what a
user of KVCacheManager can see: reuse results, which prompts match, available blocks, stats.
Block ids are not modelled.

Rules (the specification the C++ manager is checked against):
- A full block becomes a cached node once its KV is computed (mark_computed), keyed by its chain.
  If the key is already cached, the sequence's block takes the node over (the node moves into it;
  the cached copy's block, primary, secondary or third-tier, becomes free) unless the cached copy
  is a primary block that other sequences reference: then the block stays an unkeyed duplicate and
  the chain continues through the cached node. Before a block is stored, the canonical nodes above
  it (parent first, up to the first that is referenced or held) that nothing references or holds
  move into the sequence's duplicates of them; if the sliding window released one of those
  duplicates, the chain stops.
- Available blocks: free ones plus primary nodes that are not held (held: referenced, or with a
  held primary child). They only shrink by blocks handed out.
- match: longest chain of cached full blocks in the primary or host tier, never the last prompt
  token; then (partial reuse) the child of the last matched node in the primary or host tier
  sharing the longest prefix with the next block (< a block, capped so the last prompt token is
  computed); ties go to a primary, then a held, then the most recently stamped node.
- Blocks to add: max(blocks for num_tokens, matched blocks + the partial copy target) less the
  matched primary nodes already held. A partial copy whose source is an unheld primary node pins
  it while blocks are taken: it is made only if one more block than that is available, else the
  tokens are computed.
- LRU clock: a node is stamped when it becomes unreferenced (release: last block first; the
  sliding window: last released block first), when it arrives in the host tier or the third tier,
  and when its retention priority reverts.
- Eviction victim: unreferenced, unpinned nodes without children in their own tier or a faster
  one (primary: no primary children; host: no primary or host children; third tier: no children),
  lowest (priority, stamp). An evicted primary node of priority >= secondary_offload_min_priority
  moves to the host tier when a host block is free or can be had, else it is dropped with its
  descendants. Having a host block evicts a host victim: with a third tier and a priority >= that
  same minimum it moves there when a slot is free or a third-tier victim can be dropped, else it
  is dropped with its descendants, leaves first (the reverse of a breadth-first walk that takes
  each node's children newest first).
- Retention: a block takes the priority (and duration) of the sequence's range holding its first
  token, else the sequence's priority without a duration; a shared block takes a range's too. A
  duration starts when the block is released (unreferenced); referenced again, it stops. At
  set_time(now), every priority whose time is up (in the order due, then by stamp) reverts to 35,
  and an unreferenced node is stamped.
- The third tier: tier3_lookup walks the prompt's leading blocks in the primary and host tiers,
  then gives the keys of the rest of its matchable blocks. stage(num_present) stages the first
  num_present of them into the host tier, in order, each after having a host block: a node in the
  third tier moves; a block without a node is created (remote only; disk stops there); nothing
  left to have stops it. Staged nodes are pinned until complete_staging; a failed one is dropped
  with its descendants (the chain after it), the others count as staged. Remote: a third-tier node
  right after the num_present blocks (when all were staged) is dropped with its subtree (lost).
- Why a block was missed: add_sequence gives each full prompt block after the shared chain one
  reason, judged before its own allocations evict anything: reuse off -> reuse_off; the first
  block after the chain: cached and holding the last prompt token -> last_token, else the block
  that got the partial copy -> partial; then cached (in the third tier) -> not_staged; its key last
  dropped from the primary / host / third tier or by a failed staging -> evicted_primary /
  evicted_host / evicted_disk or evicted_remote / fetch_failed; its plain key (the same tokens'
  chain with LoRA 0, salt 0, no extra ids) cached, dropped, or stored by a node whose key is not
  its plain key -> identity; else never_seen, and so are all later blocks (keys chain). What was
  dropped or stored is remembered in a KeyHistory: two generations of at most 2 x (blocks of
  every tier) keys.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

DEFAULT_PRIORITY = 35
TIERS = ("P", "S", "T")  # primary, host (secondary), third tier: fastest first
POOL_NAMES = {"P": "primary", "S": "secondary", "disk": "disk", "remote": "remote"}


@dataclass(eq=False)
class Node:
    key: tuple
    parent: tuple | None  # key of the parent node, None at the root
    tokens: tuple
    extras: tuple | None  # None when all extra ids of the block are 0
    lora: int
    salt: int
    tier: str  # "P" primary, "S" secondary, "T" third tier
    priority: int
    refcount: int = 0
    owner: int | None = None  # sequence that computed it, while it still holds the block
    stamp: int = 0
    pinned: bool = False
    plain: tuple | None = None  # the plain key of its chain (== key for a plain node)
    duration: int | None = None  # ms its priority lasts after a release; None: for ever
    expires: int | None = None  # when its priority reverts (while unreferenced)
    from_tier3: bool = False  # staged from the third tier, not reused since
    staging: bool = False


@dataclass
class Seq:
    tokens: list
    extras: list | None
    lora: int
    salt: int
    priority: int
    ranges: list = field(default_factory=list)  # (start, end or None, priority, duration or None)
    table: list = field(default_factory=list)  # Node, "own" (unkeyed block) or None (window-released)
    computed: int = 0
    stored: int = 0
    last: Node | None = None
    broken: bool = False
    window_released: int = 0


MISS_REASONS = ("never_seen", "evicted_primary", "evicted_host", "identity", "partial", "last_token", "reuse_off")
TIER3_MISS_REASONS = ("evicted_disk", "evicted_remote", "fetch_failed", "not_staged")
TIER_STAT_NAMES = [f"{pool}_{name}" for pool in ("primary", "secondary", "disk", "remote")
                   for name in ("hit_blocks", "stored_blocks", "evicted_blocks", "num_tokens_in", "num_tokens_out")]
STAT_NAMES = (
    "reused_blocks missed_blocks early_reused_blocks partial_reused_blocks alloc_total_blocks "
    "alloc_new_blocks offloaded_blocks onboarded_blocks evicted_blocks num_offloaded_tokens "
    "num_onboarded_tokens spilled_blocks staged_blocks fetch_failed_blocks lost_blocks discovered_blocks"
).split() + [f"missed_{reason}_blocks" for reason in MISS_REASONS + TIER3_MISS_REASONS] + TIER_STAT_NAMES

DROPPED_PRIMARY, DROPPED_HOST, STORED_PLAIN, DROPPED_TIER3, FETCH_FAILED = 1, 2, 4, 8, 16
DROPPED = DROPPED_PRIMARY | DROPPED_HOST | DROPPED_TIER3 | FETCH_FAILED


class KeyHistory:
    """Flags of keys: from which tier a node was last dropped (or by a failed staging), whether a
    non-plain node with this plain key was stored. Two generations of at most `capacity` keys:
    writing a key the newer one lacks while it is full first forgets the older one, and the newer
    one becomes the older."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.newer: dict = {}
        self.older: dict = {}
        self.num_forgotten = 0  # generations forgotten (tests report it)

    def flags(self, key):
        newer, older = self.newer.get(key, 0), self.older.get(key, 0)
        return (newer & DROPPED or older & DROPPED) | ((newer | older) & STORED_PLAIN)

    def update(self, key, clear, set_):
        if key not in self.newer and len(self.newer) == self.capacity:
            self.older, self.newer = self.newer, {}
            self.num_forgotten += 1
        self.newer[key] = (self.newer.get(key, 0) & ~clear) | set_


def block_retention(ranges, priority, block, tokens_per_block):
    """(priority, duration, in a range) of block `block`: the range holding its first token decides."""
    first = block * tokens_per_block
    for start, end, range_priority, duration in ranges:
        if start <= first and (end is None or first < end):
            return range_priority, duration, True
    return priority, None, False


class ReferenceKVCache:
    def __init__(self, tokens_per_block, num_primary_blocks, num_secondary_blocks=0, enable_block_reuse=True,
                 enable_partial_reuse=True, secondary_offload_min_priority=35, max_attention_window=0,
                 num_tier3_blocks=0, tier3="disk", remote_keys=None):
        self.tpb = tokens_per_block
        self.num_primary = num_primary_blocks
        self.num_secondary = num_secondary_blocks
        self.reuse = enable_block_reuse
        self.partial = enable_partial_reuse and enable_block_reuse
        self.min_priority = secondary_offload_min_priority
        self.window = max_attention_window
        self.num_tier3 = num_tier3_blocks if enable_block_reuse else 0
        self.tier3 = tier3  # "disk" or "remote"
        # The keys a remote store holds: what this manager spilled, what other engines stored, less
        # what the store evicted (the tests change it as the store would).
        self.remote_keys = set() if remote_keys is None else remote_keys
        self.nodes: dict[tuple, Node] = {}
        self.children: dict[tuple | None, dict[tuple, Node]] = {}  # parent key -> {key: node}
        self.num_in = {"P": 0, "S": 0, "T": 0}  # nodes per tier
        self.num_unkeyed = 0  # primary blocks held by sequences without a node
        self.seqs: dict[int, Seq] = {}
        self.clock = itertools.count(1)
        self.now = 0
        self.staged: list[Node] = []  # the open staging, in chain order
        self.stats = dict.fromkeys(STAT_NAMES, 0)
        self.history = KeyHistory(2 * (num_primary_blocks + num_secondary_blocks + self.num_tier3))

    def _tier_name(self, tier):
        return POOL_NAMES[self.tier3 if tier == "T" else tier]

    def _count_copy(self, src, dst, num_tokens):
        self.stats[f"{self._tier_name(src)}_num_tokens_out"] += num_tokens
        self.stats[f"{self._tier_name(dst)}_num_tokens_in"] += num_tokens

    # ---- keys and lookups -------------------------------------------------------------------
    def _block(self, tokens, extras, i):
        t = tuple(tokens[i * self.tpb:(i + 1) * self.tpb])
        e = tuple(extras[i * self.tpb:(i + 1) * self.tpb]) if extras else None
        if e is not None and not any(e):
            e = None
        return t, e

    def _key(self, parent_key, t, e, lora, salt):
        return (parent_key, t, e, lora, salt)

    def keys(self, tokens, extras=None, lora=0, salt=0):
        """The key of every full block of a prompt (the third tier's keys, as exact tuples)."""
        extras = list(extras) if extras is not None and any(extras) else None
        out, key = [], None
        for i in range(len(tokens) // self.tpb):
            key = self._key(key, *self._block(tokens, extras, i), lora, salt)
            out.append(key)
        return out

    def _children(self, parent_key):
        return list(self.children.get(parent_key, {}).values())

    def _set_tier(self, node, tier):
        self.num_in[node.tier] -= 1
        node.tier = tier
        self.num_in[tier] += 1

    def _held(self, node):
        if node.tier != "P":
            return False
        return node.refcount > 0 or any(self._held(c) for c in self._children(node.key) if c.tier == "P")

    def _local(self, node):
        """In the primary or host tier (and not being staged): a prompt can share it."""
        return node.tier in ("P", "S") and not node.staging

    def free_primary(self):
        return self.num_primary - self.num_unkeyed - self.num_in["P"]

    def free_secondary(self):
        return self.num_secondary - self.num_in["S"]

    def free_tier3(self):
        return self.num_tier3 - self.num_in["T"]

    def num_available_blocks(self):
        return self.free_primary() + sum(1 for n in self.nodes.values() if n.tier == "P" and not self._held(n))

    def match(self, tokens, extras=None, lora=0, salt=0):
        """(matched nodes, partial source or None, partial token count)."""
        if not self.reuse:
            return [], None, 0
        extras = list(extras) if extras is not None and any(extras) else None
        max_tokens = len(tokens) - 1
        chain, parent = [], None
        while (len(chain) + 1) * self.tpb <= max_tokens:
            t, e = self._block(tokens, extras, len(chain))
            node = self.nodes.get(self._key(parent, t, e, lora, salt))
            if node is None or not self._local(node):
                break
            chain.append(node)
            parent = node.key
        source, k_best, best_rank = None, 0, None
        limit = min(self.tpb, max_tokens - len(chain) * self.tpb)
        if self.partial and limit > 0:
            start = len(chain) * self.tpb
            want = [(tokens[start + j], extras[start + j] if extras else 0) for j in range(limit)]
            for cand in self._children(parent):
                if (cand.lora, cand.salt) != (lora, salt) or not self._local(cand):
                    continue
                have = [(cand.tokens[j], cand.extras[j] if cand.extras else 0) for j in range(self.tpb)]
                k = next((j for j in range(limit) if have[j] != want[j]), limit)
                rank = (k, cand.tier == "P", self._held(cand), cand.stamp)
                if k > 0 and (source is None or rank > best_rank):
                    source, k_best, best_rank = cand, k, rank
        return chain, source, k_best

    def match_prefix(self, tokens, extras=None, lora=0, salt=0):
        chain, _, k = self.match(tokens, extras, lora, salt)
        return dict(num_matched_tokens=len(chain) * self.tpb + k, num_matched_blocks=len(chain),
                    num_secondary_blocks=sum(n.tier == "S" for n in chain), num_partial_tokens=k)

    def match_to_add(self, tokens, num_tokens, extras=None, lora=0, salt=0):
        """(matched nodes, partial source or None, partial token count, blocks to add as a
        function of whether the partial copy is made)."""
        chain, source, k = self.match(tokens, extras, lora, salt)

        def needed(with_partial):
            held = sum(1 for n in chain if n.tier == "P" and self._held(n))
            return max(-(-num_tokens // self.tpb), len(chain) + with_partial) - held

        pins_a_victim = source is not None and source.tier == "P" and not self._held(source)
        if pins_a_victim and needed(1) + 1 > self.num_available_blocks():
            source, k = None, 0  # no spare block for the pinned source: compute those tokens
        return chain, source, k, needed

    def num_blocks_to_add(self, tokens, num_tokens, extras=None, lora=0, salt=0):
        _, source, _, needed = self.match_to_add(tokens, num_tokens, extras, lora, salt)
        return needed(1 if source is not None else 0)

    # ---- pools ------------------------------------------------------------------------------
    def _victim(self, tier):
        faster = {"P": ("P",), "S": ("P", "S"), "T": TIERS}[tier]
        cands = [n for n in self.nodes.values() if n.tier == tier and n.refcount == 0 and not n.pinned
                 and not any(c.tier in faster for c in self._children(n.key))]
        return min(cands, key=lambda n: (n.priority, n.stamp), default=None)

    def _drop_tree(self, top, reason=None):
        order = [top]
        for node in order:
            order.extend(reversed(self._children(node.key)))  # newest child first
        for node in reversed(order):
            del self.nodes[node.key]
            del self.children[node.parent][node.key]
            self.num_in[node.tier] -= 1
            self.stats["evicted_blocks"] += 1
            flag = reason or {"P": DROPPED_PRIMARY, "S": DROPPED_HOST, "T": DROPPED_TIER3}[node.tier]
            self.stats[f"{self._tier_name('T' if flag == FETCH_FAILED else node.tier)}_evicted_blocks"] += 1
            self.history.update(node.key, DROPPED, flag)
        return len(order)

    def _take_tier3(self):
        """Makes one third-tier slot free; False when none can be."""
        if self.free_tier3() > 0:
            return True
        victim = self._victim("T")
        if victim is None:
            return False
        self._drop_tree(victim)
        return True

    def _take_secondary(self):
        """Makes one secondary block free; False when none can be."""
        if self.free_secondary() > 0:
            return True
        victim = self._victim("S")
        if victim is None:
            return False
        if self.num_tier3 > 0 and victim.priority >= self.min_priority and self._take_tier3():
            self._set_tier(victim, "T")
            if self.tier3 == "remote":
                self.remote_keys.add(victim.key)
            victim.stamp = next(self.clock)
            victim.from_tier3 = False
            self.stats["spilled_blocks"] += 1
            self.stats[f"{self._tier_name('T')}_stored_blocks"] += 1
            self._count_copy("S", "T", self.tpb)
        else:
            self._drop_tree(victim)
        return True

    def _take_primary(self):
        """Makes one primary block free (evicting if needed) for the caller to fill."""
        if self.free_primary() > 0:
            return
        victim = self._victim("P")
        assert victim is not None, "reference: nothing to evict"
        if self.num_secondary > 0 and victim.priority >= self.min_priority and self._take_secondary():
            self._set_tier(victim, "S")
            victim.stamp = next(self.clock)
            self.stats["offloaded_blocks"] += 1
            self.stats["num_offloaded_tokens"] += self.tpb
            self.stats["secondary_stored_blocks"] += 1
            self._count_copy("P", "S", self.tpb)
        else:
            self._drop_tree(victim)

    def _new_block(self):
        self._take_primary()
        self.num_unkeyed += 1
        return "own"

    def _unref(self, entry, seq_id):
        if entry == "own":
            self.num_unkeyed -= 1
            return
        if entry.owner == seq_id:
            entry.owner = None
        entry.refcount -= 1
        if entry.refcount == 0:
            entry.stamp = next(self.clock)
            if entry.duration is not None and entry.priority != DEFAULT_PRIORITY:
                entry.expires = self.now + entry.duration

    def _set_retention(self, node, priority, duration):
        node.priority, node.duration, node.expires = priority, duration, None

    def set_time(self, now):
        self.now = now
        due = sorted((n for n in self.nodes.values() if n.expires is not None and n.expires <= now),
                     key=lambda n: (n.expires, n.stamp))
        for node in due:
            self._set_retention(node, DEFAULT_PRIORITY, None)
            if node.tier != "P" or node.refcount == 0:
                node.stamp = next(self.clock)

    def miss_reasons(self, tokens, extras, lora, salt, num_shared, partial_copy):
        """{reason: blocks} of the full prompt blocks after the num_shared shared ones (the third
        tier's reasons too when there is one, as MissReasons.to_dict(tier3=True) lists them)."""
        reasons = dict.fromkeys(MISS_REASONS + (TIER3_MISS_REASONS if self.num_tier3 else ()), 0)
        num_blocks = len(tokens) // self.tpb
        if not self.reuse:
            reasons["reuse_off"] = max(num_blocks - num_shared, 0)
            return reasons
        key = plain = None
        for i in range(num_blocks):
            t, e = self._block(tokens, extras, i)
            key, plain = self._key(key, t, e, lora, salt), self._key(plain, t, None, 0, 0)
            if i < num_shared:
                continue
            flags = self.history.flags(key)
            holds_last_token = i == num_blocks - 1 and len(tokens) % self.tpb == 0
            if i == num_shared and holds_last_token and key in self.nodes:
                reason = "last_token"
            elif i == num_shared and partial_copy:
                reason = "partial"
            elif key in self.nodes:  # only in the third tier: else find_prefix shares it
                reason = "not_staged"
            elif flags & DROPPED:
                reason = {DROPPED_PRIMARY: "evicted_primary", DROPPED_HOST: "evicted_host",
                          DROPPED_TIER3: f"evicted_{self.tier3}", FETCH_FAILED: "fetch_failed"}[flags & DROPPED]
            elif plain in self.nodes or self.history.flags(plain):
                reason = "identity"
            else:
                reasons["never_seen"] += num_blocks - i
                break
            reasons[reason] += 1
        return reasons

    # ---- the third tier ---------------------------------------------------------------------
    def _walk(self, tokens, extras, lora, salt):
        """(leading nodes in the primary or host tier, keys of the matchable blocks after them)."""
        extras = list(extras) if extras is not None and any(extras) else None
        keys = self.keys(tokens, extras, lora, salt)[:(len(tokens) - 1) // self.tpb]
        local = []
        for key in keys:
            node = self.nodes.get(key)
            if node is None or not self._local(node):
                break
            local.append(node)
        return local, keys[len(local):]

    def tier3_lookup(self, tokens, extras=None, lora=0, salt=0):
        local, keys = self._walk(tokens, extras, lora, salt)
        known = next((j for j, key in enumerate(keys) if key not in self.nodes), len(keys))
        return dict(num_local_blocks=len(local), num_known_blocks=known), keys

    def stage(self, tokens, num_present, extras=None, lora=0, salt=0, priority=DEFAULT_PRIORITY, ranges=()):
        """Stages the first num_present blocks after the local chain; returns
        (num_local_blocks, staged nodes, lost blocks)."""
        local, keys = self._walk(tokens, extras, lora, salt)
        wanted = keys[:num_present]
        pinned = [n for n in local if n.tier == "S"] + [self.nodes[k] for k in wanted if k in self.nodes]
        for node in pinned:
            node.pinned = True
        staged = []
        for j, key in enumerate(wanted):
            node = self.nodes.get(key)
            if node is None and self.tier3 == "disk":
                break
            if not self._take_secondary():
                break
            if node is None:  # found in the store: another engine's block
                i = len(local) + j
                t, e = self._block(tokens, list(extras) if extras is not None and any(extras) else None, i)
                plain = self.keys(tokens)[i]
                node = Node(key, key[0], t, e, lora, salt, "S", block_retention(ranges, priority, i, self.tpb)[0],
                            plain=key if plain == key else plain)
                self.nodes[key] = node
                self.children.setdefault(node.parent, {})[key] = node
                self.num_in["S"] += 1
                self.stats["discovered_blocks"] += 1
            else:
                self._set_tier(node, "S")
            node.stamp = next(self.clock)
            node.pinned = node.staging = True
            self._count_copy("T", "S", self.tpb)
            staged.append(node)
        for node in pinned:
            node.pinned = node.staging
        lost = 0
        if (self.tier3 == "remote" and len(staged) == len(wanted) and len(wanted) < len(keys)
                and keys[len(wanted)] in self.nodes):
            lost = self._drop_tree(self.nodes[keys[len(wanted)]], DROPPED_TIER3)
            self.stats["lost_blocks"] += lost
        self.staged = staged
        return len(local), staged, lost

    def complete_staging(self, failed_nodes=()):
        """The staging's fetches ran; those of failed_nodes (and the chain after the first) failed."""
        first = min((self.staged.index(n) for n in failed_nodes), default=len(self.staged))
        for j, node in enumerate(self.staged):
            node.pinned = node.staging = False
            if j < first:
                node.from_tier3 = True
                self.stats["staged_blocks"] += 1
                self.stats["secondary_stored_blocks"] += 1
        if first < len(self.staged):
            self.stats["fetch_failed_blocks"] += len(self.staged) - first
            self._drop_tree(self.staged[first], FETCH_FAILED)
        self.staged = []

    # ---- sequences --------------------------------------------------------------------------
    def can_add_sequence(self, tokens, num_tokens, extras=None, lora=0, salt=0):
        return self.num_blocks_to_add(tokens, num_tokens, extras, lora, salt) <= self.num_available_blocks()

    def add_sequence(self, seq_id, tokens, num_tokens, extras=None, lora=0, salt=0, priority=35, ranges=()):
        """The caller checks can_add_sequence first."""
        assert seq_id not in self.seqs
        chain, source, k, _ = self.match_to_add(tokens, num_tokens, extras, lora, salt)
        missed = self.miss_reasons(tokens, extras, lora, salt, len(chain), source is not None)
        seq = Seq(list(tokens), list(extras) if extras is not None and any(extras) else None, lora, salt, priority,
                  list(ranges))
        early = sum(1 for n in chain if n.tier == "P" and n.owner is not None)
        onboarded = sum(1 for n in chain if n.tier == "S")
        for n in chain:
            tier = "T" if n.tier == "S" and n.from_tier3 else n.tier
            self.stats[f"{self._tier_name(tier)}_hit_blocks"] += 1
        for n in chain:
            n.pinned = n.tier == "S"
        if source is not None:
            source.pinned = True
        for n in chain:
            if n.tier == "P":
                n.refcount += 1
                n.expires = None
        for n in chain:
            if n.tier == "S":
                self._take_primary()
                self._set_tier(n, "P")
                n.refcount, n.pinned, n.expires, n.from_tier3 = 1, False, None, False
                self.stats["onboarded_blocks"] += 1
                self.stats["num_onboarded_tokens"] += self.tpb
                self._count_copy("S", "P", self.tpb)
            seq.table.append(n)
        for i, n in enumerate(chain):
            block_priority, duration, in_range = block_retention(seq.ranges, priority, i, self.tpb)
            if in_range:
                self._set_retention(n, block_priority, duration)
        if source is not None:
            seq.table.append(self._new_block())
            if source.tier == "S":
                self.stats["num_onboarded_tokens"] += k
            self._count_copy(source.tier, "P", k)
            source.pinned = False
            self.stats["partial_reused_blocks"] += 1
        total = max(-(-num_tokens // self.tpb), len(seq.table))
        while len(seq.table) < total:
            seq.table.append(self._new_block())
        self.stats["reused_blocks"] += len(chain)
        self.stats["missed_blocks"] += len(tokens) // self.tpb - len(chain)
        for reason, count in missed.items():
            self.stats[f"missed_{reason}_blocks"] += count
        self.stats["early_reused_blocks"] += early
        self.stats["alloc_total_blocks"] += total
        self.stats["alloc_new_blocks"] += total - len(chain)
        seq.computed = len(chain) * self.tpb + k
        seq.stored = len(chain)
        seq.last = chain[-1] if chain else None
        self.seqs[seq_id] = seq
        self._release_window(seq_id, seq)
        return dict(num_reused_tokens=seq.computed, num_reused_blocks=len(chain), num_onboarded_blocks=onboarded,
                    num_partial_tokens=k, num_early_reused_blocks=early, num_new_blocks=total - len(chain),
                    missed=missed)

    def can_allocate(self, seq_id, num_tokens):
        return -(-num_tokens // self.tpb) - len(self.seqs[seq_id].table) <= self.num_available_blocks()

    def allocate(self, seq_id, num_tokens):
        seq = self.seqs[seq_id]
        need = -(-num_tokens // self.tpb) - len(seq.table)  # the caller checks can_allocate first
        for _ in range(max(need, 0)):
            seq.table.append(self._new_block())
        self.stats["alloc_total_blocks"] += max(need, 0)
        self.stats["alloc_new_blocks"] += max(need, 0)

    def append_tokens(self, seq_id, tokens):
        seq = self.seqs[seq_id]
        seq.tokens += list(tokens)
        if seq.extras is not None:
            seq.extras += [0] * len(tokens)

    def mark_computed(self, seq_id, num_computed):
        seq = self.seqs[seq_id]
        seq.computed = num_computed
        while self.reuse and seq.stored < num_computed // self.tpb and not seq.broken:
            i = seq.stored
            parent = seq.last
            if i > 0 and (self.nodes.get(parent.key) is not parent or parent.tier != "P"):
                seq.broken = True
                break
            if seq.table[i] is None:
                seq.broken = True
                break
            # Canonical nodes above block i that nothing references or holds would be pinned by
            # the new child: each moves into this sequence's duplicate of it (the chain stops if
            # the window released one).
            idle, j, node = [], i - 1, parent
            while node is not None and node.refcount == 0 and not self._held(node):
                idle.append((j, node))
                node = self.nodes[node.parent] if node.parent is not None else None
                j -= 1
            if any(seq.table[j] != "own" for j, _ in idle):
                seq.broken = True
                break
            for j, node in idle:
                self._take_over(node, seq_id, seq, j)
            t, e = self._block(seq.tokens, seq.extras, i)
            key = self._key(parent.key if parent else None, t, e, seq.lora, seq.salt)
            node = self.nodes.get(key)
            if node is None:
                plain = self._key(parent.plain if parent else None, t, None, 0, 0)
                plain = key if plain == key else plain
                block_priority, duration, _ = block_retention(seq.ranges, seq.priority, i, self.tpb)
                node = Node(key, parent.key if parent else None, t, e, seq.lora, seq.salt, "P", block_priority,
                            plain=plain, duration=duration)
                if plain is not key:  # these tokens under another identity
                    self.history.update(plain, 0, STORED_PLAIN)
                self.nodes[key] = node
                self.children.setdefault(node.parent, {})[key] = node
                self.num_in["P"] += 1
                self.stats["primary_stored_blocks"] += 1
                node.refcount, node.owner = 1, seq_id
                self.num_unkeyed -= 1
                seq.table[i] = node
            elif node.tier != "P" or node.refcount == 0:
                self._take_over(node, seq_id, seq, i)
            seq.last = node
            seq.stored += 1
        self._release_window(seq_id, seq)

    def _take_over(self, node, seq_id, seq, i):
        """An unreferenced node moves into the sequence's own block i (same KV); its block is freed."""
        self._set_tier(node, "P")
        self._set_retention(node, *block_retention(seq.ranges, seq.priority, i, self.tpb)[:2])
        node.refcount, node.owner, node.from_tier3 = 1, seq_id, False
        self.num_unkeyed -= 1
        seq.table[i] = node

    def _release_window(self, seq_id, seq):
        if self.window <= 0 or seq.computed - self.window <= 0:
            return
        end = min((seq.computed - self.window) // self.tpb, len(seq.table))
        for i in reversed(range(seq.window_released, end)):
            if seq.table[i] is not None:
                self._unref(seq.table[i], seq_id)
                seq.table[i] = None
        seq.window_released = max(seq.window_released, end)

    def release(self, seq_id):
        seq = self.seqs.pop(seq_id)
        for entry in reversed(seq.table):
            if entry is not None:
                self._unref(entry, seq_id)

    # ---- observation ------------------------------------------------------------------------
    def stats_dict(self):
        out = dict(self.stats)
        looked_up = out["reused_blocks"] + out["missed_blocks"]
        out["cache_hit_rate"] = out["reused_blocks"] / looked_up if looked_up else 0.0
        used = self.num_unkeyed + sum(1 for n in self.nodes.values() if n.tier == "P" and n.refcount > 0)
        out.update(
            primary_num_blocks=self.num_primary, primary_num_free_blocks=self.free_primary(),
            primary_num_used_blocks=used,
            primary_num_cached_blocks=sum(1 for n in self.nodes.values() if n.tier == "P" and n.refcount == 0),
            secondary_num_blocks=self.num_secondary, secondary_num_free_blocks=self.free_secondary(),
            secondary_num_cached_blocks=sum(n.tier == "S" for n in self.nodes.values()),
            secondary_num_used_blocks=0, tier3_num_blocks=self.num_tier3, tier3_num_free_blocks=self.free_tier3(),
            tier3_num_cached_blocks=self.num_in["T"])
        return out


class KvStore:
    """Simulated KV memory: what each (pool, block) slot holds, moved by the manager's copy ops.

    Tests write a token's identity when its KV is computed and execute copy operations in the
    order given, then check that every computed position a sequence reads holds its own identity.
    A remote block lives under its key (``remote``: key -> identities, the store engines share);
    a fetch whose source holds nothing fails, and so does one listed in ``fail``.
    """

    DISK, REMOTE = 2, 3

    def __init__(self, tokens_per_block, remote=None):
        self.tpb = tokens_per_block
        self.slots = {}  # (pool, block id) -> list of identities, one per token slot
        self.remote = {} if remote is None else remote

    def apply(self, ops, fail=()):
        """Executes a CopyOpArrays batch in order; returns (fetch index, host block) of each failed
        fetch (a fetch out of the third tier; ``fail``: indices of fetches that fail anyway)."""
        keys = iter(ops.tier3_keys)
        failed = []
        num_fetches = 0
        for src_pool, src, dst_pool, dst, k in zip(ops.src_pool, ops.src_block_ids, ops.dst_pool,
                                                   ops.dst_block_ids, ops.num_tokens):
            src_pool, src, dst_pool, dst = int(src_pool), int(src), int(dst_pool), int(dst)
            key = next(keys) if self.DISK in (src_pool, dst_pool) or self.REMOTE in (src_pool, dst_pool) else None
            if src_pool == self.REMOTE:
                data = self.remote.get(key)
            else:
                data = self.slots.get((src_pool, src))
            if src_pool in (self.DISK, self.REMOTE):
                num_fetches += 1
                if data is None or num_fetches - 1 in fail:
                    failed.append((num_fetches - 1, dst))
                    continue
            data = data or [None] * self.tpb
            if dst_pool == self.REMOTE:
                self.remote[key] = list(data)
                continue
            target = list(self.slots.get((dst_pool, dst), [None] * self.tpb))
            target[:k] = data[:k]
            self.slots[(dst_pool, dst)] = target
        return failed

    def write(self, block, offset, identity):
        target = list(self.slots.get((0, block), [None] * self.tpb))
        target[offset] = identity
        self.slots[(0, block)] = target

    def read(self, block, offset):
        return self.slots.get((0, block), [None] * self.tpb)[offset]
