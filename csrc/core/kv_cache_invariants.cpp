// KVCacheManager::stats and check_invariants: recounts everything from scratch and compares it
// with the incrementally kept state.
#include <string>
#include <vector>

#include "kv_cache_manager_impl.h"

namespace kvtool {

CacheStats KVCacheManager::stats() const {
  const Impl& m = *impl_;
  CacheStats s = m.stats;
  const int64_t looked_up = s.reused_blocks + s.missed_blocks;
  s.cache_hit_rate = looked_up > 0 ? static_cast<double>(s.reused_blocks) / static_cast<double>(looked_up) : 0.0;
  s.primary.num_blocks = m.config.num_primary_blocks;
  s.primary.num_free_blocks = static_cast<int32_t>(m.primary_free.size());
  s.primary.num_used_blocks = m.num_used_primary;
  s.primary.num_cached_blocks = s.primary.num_blocks - s.primary.num_free_blocks - s.primary.num_used_blocks;
  s.secondary.num_blocks = m.config.num_secondary_blocks;
  s.secondary.num_free_blocks = m.num_free_secondary();
  s.secondary.num_used_blocks = 0;  // sequences never hold host blocks
  s.secondary.num_cached_blocks = s.secondary.num_blocks - s.secondary.num_free_blocks;
  s.tier3.num_blocks = m.has_t3 ? m.config.num_tier3_blocks : 0;
  s.tier3.num_free_blocks = static_cast<int32_t>(m.tier3_free.size() + m.tier3_fetched.size());
  s.tier3.num_cached_blocks = s.tier3.num_blocks - s.tier3.num_free_blocks;
  // Per tier, from the counters kept (primary arrivals, evictions, third-tier hits) and the rest.
  TierStats& primary = s.tiers[static_cast<int>(PoolKind::kPrimary)];
  TierStats& host = s.tiers[static_cast<int>(PoolKind::kSecondary)];
  const int64_t third_hits = m.has_t3 ? s.tiers[static_cast<int>(m.t3)].hit_blocks : 0;
  const int64_t spilled_tokens = s.tier3_traffic.spilled_blocks * m.tpb;
  const int64_t partial_tokens = m.tier_counters.partial_primary_tokens;
  primary.hit_blocks = s.reused_blocks - s.onboarded_blocks;
  primary.num_tokens_in = s.num_onboarded_tokens + partial_tokens;
  primary.num_tokens_out = s.num_offloaded_tokens + partial_tokens;
  host.hit_blocks = s.onboarded_blocks - third_hits;
  host.stored_blocks = s.offloaded_blocks + s.tier3_traffic.staged_blocks;
  host.num_tokens_in = s.num_offloaded_tokens + m.tier_counters.fetch_tokens;
  host.num_tokens_out = s.num_onboarded_tokens + spilled_tokens;
  if (m.has_t3) {
    TierStats& third = s.tiers[static_cast<int>(m.t3)];
    third.stored_blocks = s.tier3_traffic.spilled_blocks;
    third.num_tokens_in = spilled_tokens;
    third.num_tokens_out = m.tier_counters.fetch_tokens;
  }
  return s;
}

std::vector<std::string> KVCacheManager::check_invariants() const {
  const Impl& m = *impl_;
  std::vector<std::string> bad;
  auto fail = [&bad](std::string msg) { bad.push_back(std::move(msg)); };
  const auto s = [](int64_t v) { return std::to_string(v); };
  const int32_t num_primary = m.config.num_primary_blocks;
  const int32_t num_secondary = m.config.num_secondary_blocks;

  // Blocks held by sequences, counted from the block tables.
  std::vector<int32_t> holders(num_primary, 0);
  for (const auto& [id, seq] : m.sequences) {
    std::vector<char> seen(num_primary, 0);
    for (BlockId b : seq.block_ids) {
      if (b == kNoBlock) continue;
      if (b < 0 || b >= num_primary) {
        fail("sequence " + s(id) + " holds out-of-range block " + s(b));
        continue;
      }
      if (seen[b]++) fail("sequence " + s(id) + " holds primary block " + s(b) + " twice");
      ++holders[b];
    }
    if (seq.num_computed_tokens > static_cast<int32_t>(seq.token_ids.size())) {
      fail("sequence " + s(id) + " has more computed tokens than tokens");
    }
    if (seq.num_computed_tokens > static_cast<int64_t>(seq.block_ids.size()) * m.tpb) {
      fail("sequence " + s(id) + " has computed tokens beyond its block table");
    }
    if (!seq.extra_ids.empty() && seq.extra_ids.size() != seq.token_ids.size()) {
      fail("sequence " + s(id) + " has extra ids not matching its tokens");
    }
  }

  // Primary pool: every block exactly one of free / referenced / cached.
  std::vector<char> in_free(num_primary, 0);
  for (BlockId b : m.primary_free) {
    if (in_free[b]++) fail("primary block " + s(b) + " is on the free list twice");
  }
  int32_t num_used = 0;
  for (BlockId b = 0; b < num_primary; ++b) {
    const int32_t rc = m.primary_refcount[b];
    const bool has_node = m.primary_node[b] != kNoNode;
    if (rc < 0) fail("primary block " + s(b) + " has negative refcount " + s(rc));
    if (rc != holders[b]) {
      fail("primary block " + s(b) + " has refcount " + s(rc) + " but " + s(holders[b]) + " sequences hold it");
    }
    if (rc > 0) ++num_used;
    const int states = (in_free[b] ? 1 : 0) + (rc > 0 ? 1 : 0) + (rc == 0 && has_node ? 1 : 0);
    if (states != 1 || (in_free[b] && has_node)) {
      fail("primary block " + s(b) + " is not exactly one of free / referenced / cached (free=" + s(in_free[b]) +
           ", refcount=" + s(rc) + ", cached=" + s(has_node) + ")");
    }
  }
  if (num_used != m.num_used_primary) fail("used primary block count is off: " + s(m.num_used_primary) + " kept, " + s(num_used) + " counted");

  // Secondary pool: every block exactly one of free / cached.
  std::vector<char> in_secondary_free(num_secondary, 0);
  for (const std::vector<BlockId>* list : {&m.secondary_free, &m.secondary_onboarded}) {
    for (BlockId b : *list) {
      if (in_secondary_free[b]++) fail("secondary block " + s(b) + " is on the free lists twice");
    }
  }
  for (BlockId b = 0; b < num_secondary; ++b) {
    if ((in_secondary_free[b] != 0) == (m.secondary_node[b] != kNoNode)) {
      fail("secondary block " + s(b) + " is not exactly one of free / cached");
    }
  }

  // Third tier: every slot exactly one of free / cached.
  const int32_t num_tier3 = m.has_t3 ? m.config.num_tier3_blocks : 0;
  std::vector<char> in_tier3_free(num_tier3, 0);
  for (const std::vector<BlockId>* list : {&m.tier3_free, &m.tier3_fetched}) {
    for (BlockId b : *list) {
      if (b < 0 || b >= num_tier3 || in_tier3_free[b]++) fail("third-tier slot " + s(b) + " is on the free lists twice or out of range");
    }
  }
  for (BlockId b = 0; b < num_tier3; ++b) {
    if ((in_tier3_free[b] != 0) == (m.tier3_node[b] != kNoNode)) {
      fail("third-tier slot " + s(b) + " is not exactly one of free / cached");
    }
  }
  for (const auto& fetch : m.staging) {
    if (!m.nodes[fetch.node].live || !m.node_tier3[fetch.node].staging || m.nodes[fetch.node].pool != PoolKind::kSecondary ||
        m.nodes[fetch.node].block_id != fetch.host_block) {
      fail("staged fetch into host block " + s(fetch.host_block) + " has no staging node there");
    }
  }
  // Tiers by speed: a child lives in its parent's tier or a slower one.
  const auto rank = [&m](const auto& x) { return x.pool == PoolKind::kPrimary ? 0 : x.pool == PoolKind::kSecondary ? 1 : 2; };

  // Prefix tree.
  const NodeId root = m.root;
  const int32_t num_slots = static_cast<int32_t>(m.nodes.size());
  std::vector<int32_t> children(num_slots, 0), primary_children(num_slots, 0), held_children(num_slots, 0);
  std::vector<int32_t> tier3_children(num_slots, 0);
  int32_t num_live = 0, num_unheld = 0;
  if (!m.config.enable_block_reuse && num_slots > 1) fail("nodes exist although block reuse is disabled");
  for (NodeId n = 0; n < num_slots; ++n) {
    const auto& x = m.nodes[n];
    if (n == root || !x.live) continue;
    ++num_live;
    static const char* const pool_names[] = {" primary)", " secondary)", " disk)", " remote)"};
    const std::string name = "node " + s(n) + " (block " + s(x.block_id) + pool_names[static_cast<int>(x.pool)];
    const bool staging = m.has_t3 && m.node_tier3[n].staging;
    if (x.pinned != staging) fail(name + (x.pinned ? " is still pinned between calls" : " is staging but not pinned"));
    if (x.pool == PoolKind::kPrimary) {
      if (x.block_id < 0 || x.block_id >= num_primary || m.primary_node[x.block_id] != n) fail(name + " and its primary block disagree");
    } else if (x.pool == PoolKind::kSecondary) {
      if (x.block_id < 0 || x.block_id >= num_secondary || m.secondary_node[x.block_id] != n) {
        fail(name + " and its secondary block disagree");
      }
    } else if (!m.in_tier3(n) || x.block_id < 0 || x.block_id >= num_tier3 || m.tier3_node[x.block_id] != n) {
      fail(name + " and its third-tier slot disagree");
    }
    if (m.has_t3 && m.node_tier3[n].from_tier3 && x.pool != PoolKind::kSecondary) {
      fail(name + " is marked staged from the third tier outside the host tier");
    }
    if (x.parent < 0 || x.parent >= num_slots || !m.nodes[x.parent].live) {
      fail(name + " has a parent that is not in the tree");
      continue;
    }
    ++children[x.parent];
    if (m.in_tier3(n)) ++tier3_children[x.parent];
    if (x.parent != root && rank(x) < rank(m.nodes[x.parent])) fail(name + " lives in a faster tier than its parent");
    if (m.has_t3) {
      const BlockDigest d = block_digest(m.digest_of(x.parent), m.node_tokens(n), m.node_extras(n), m.tpb, x.lora_task_id,
                                         x.cache_salt);
      if (d != m.node_digests[n]) fail(name + " has a third-tier key that does not match its tokens and parent");
    }
    if (x.pool == PoolKind::kPrimary) {
      ++primary_children[x.parent];
      const bool held = m.is_held(n);
      if (held) ++held_children[x.parent];
      if (!held) ++num_unheld;
      if ((m.primary_refcount[x.block_id] == 0) != x.in_lru) fail(name + " is in the LRU list iff unreferenced: violated");
    } else if (!x.in_lru) {
      fail(name + " is cached in the secondary pool but not in its LRU list");
    }
    if (m.config.enable_partial_reuse) {
      const bool must_be_indexed = x.parent == root || m.nodes[x.parent].num_children >= 2;
      if (must_be_indexed && !x.in_partial_index) fail(name + " has siblings but is not in the partial index");
      if (x.in_partial_index && m.partial_index.find(x.partial_key, [n](NodeId c) { return c == n; }) != n) {
        fail(name + " is flagged as in the partial index but cannot be found there");
      }
    } else if (x.in_partial_index) {
      fail(name + " is in the partial index although partial reuse is disabled");
    }
    const uint64_t parent_hash = x.parent == root ? 0 : m.nodes[x.parent].hash;
    const uint64_t h = block_key_hash(parent_hash, m.node_tokens(n), m.node_extras(n), m.tpb, x.lora_task_id,
                                      x.cache_salt, m.key_hash_bits);
    if (h != x.hash) fail(name + " has a key that does not match its tokens and parent");
    if (m.find_child(x.parent, x.hash, m.node_tokens(n), m.node_extras(n), x.lora_task_id, x.cache_salt) ==
        kNoNode) {
      fail(name + " cannot be found through the key index");
    }
  }
  for (NodeId n = 0; n < num_slots; ++n) {
    const auto& x = m.nodes[n];
    if (!x.live) continue;
    int32_t listed = 0;
    for (NodeId c = x.first_child; c != kNoNode && listed <= num_slots; c = m.nodes[c].next_sibling) {
      if (m.nodes[c].parent != n) fail("node " + s(c) + " is listed as a child of node " + s(n) + " but has another parent");
      ++listed;
    }
    if (listed != children[n] || x.num_children != children[n] || x.num_primary_children != primary_children[n] ||
        (m.has_t3 && m.node_tier3[n].num_tier3_children != tier3_children[n]) ||
        (n != root && x.num_held_children != held_children[n])) {
      fail("node " + s(n) + " has wrong child counts (" + s(x.num_children) + "/" + s(x.num_primary_children) + "/" +
           s(x.num_held_children) + " kept, " + s(children[n]) + "/" + s(primary_children[n]) + "/" +
           s(held_children[n]) + " counted)");
    }
  }
  if (num_unheld != m.num_unheld_primary) {
    fail("evictable primary node count is off: " + s(m.num_unheld_primary) + " kept, " + s(num_unheld) + " counted");
  }
  if (num_live + static_cast<int32_t>(m.free_node_ids.size()) != num_slots - 1) fail("node slots leaked");

  // LRU lists hold exactly the unreferenced nodes of their pool, at their priority.
  int32_t num_listed = 0, num_should = 0;
  for (int pool = 0; pool < kNumPools; ++pool) {
    const auto& l = m.lru[pool];
    for (int p = 0; p < kNumPriorities; ++p) {
      NodeId prev = kNoNode;
      for (NodeId n = l.head[p]; n != kNoNode && num_listed <= num_slots; n = m.nodes[n].lru_next) {
        const auto& x = m.nodes[n];
        if (!x.live || !x.in_lru || static_cast<int>(x.pool) != pool || x.priority != p || x.lru_prev != prev) {
          fail("LRU list " + s(pool) + "/" + s(p) + " holds node " + s(n) + " wrongly");
        }
        prev = n;
        ++num_listed;
      }
      if (l.tail[p] != prev) fail("LRU list " + s(pool) + "/" + s(p) + " has a wrong tail");
    }
  }
  for (NodeId n = 0; n < num_slots; ++n) {
    if (n != root && m.nodes[n].live && m.nodes[n].in_lru) ++num_should;
  }
  if (num_listed != num_should) fail("LRU lists hold " + s(num_listed) + " nodes, " + s(num_should) + " are flagged");
  if (m.stats.missed.total() != m.stats.missed_blocks) {
    fail("the miss reasons sum to " + s(m.stats.missed.total()) + ", not the " + s(m.stats.missed_blocks) +
         " missed blocks");
  }
  return bad;
}

}  // namespace kvtool
