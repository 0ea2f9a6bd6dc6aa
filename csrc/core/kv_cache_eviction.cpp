// Eviction and host offload of KVCacheManager: taking new primary blocks, choosing LRU victims,
// offloading them to the secondary pool (and from there spilling to the third tier) or dropping them.
#include <stdexcept>

#include "kv_cache_manager_impl.h"

namespace kvtool {

BlockId KVCacheManager::Impl::take_new_primary_block() {
  const BlockId b = acquire_primary();
  primary_refcount[b] = 1;
  ++num_used_primary;
  return b;
}

BlockId KVCacheManager::Impl::acquire_primary() {
  if (!primary_free.empty()) {
    const BlockId b = primary_free.back();
    primary_free.pop_back();
    return b;
  }
  const NodeId victim = find_victim(PoolKind::kPrimary);
  if (victim == kNoNode) {
    // Callers check num_available() first; reaching this is a bug, reported, not a crash.
    throw std::logic_error("KV cache manager: no free or evictable primary block left");
  }
  return evict_primary(victim);
}

BlockId KVCacheManager::Impl::acquire_secondary() {
  if (num_free_secondary() == 0) {
    const NodeId victim = find_victim(PoolKind::kSecondary);
    if (victim == kNoNode) return kNoBlock;
    // Spilled down when its priority allows and a third-tier slot can be had, else dropped with
    // its third-tier descendants. Either way its block goes back to secondary_free.
    if (!(has_t3 && nodes[victim].priority >= config.secondary_offload_min_priority && spill(victim))) {
      drop_tree(victim);
    }
  }
  return pop_free_secondary();
}

// As for host blocks, a slot a fetch of this step still reads is handed out last.
BlockId KVCacheManager::Impl::acquire_tier3() {
  if (tier3_free.empty() && tier3_fetched.empty()) {
    const NodeId victim = find_victim(t3);
    if (victim == kNoNode) return kNoBlock;
    drop_node(victim);  // a leaf: its slot goes back to tier3_free
  }
  std::vector<BlockId>& from = tier3_free.empty() ? tier3_fetched : tier3_free;
  const BlockId b = from.back();
  from.pop_back();
  return b;
}

// Moves the host node victim (no children outside the third tier) into a third-tier slot; its
// host block is freed for the caller, whose copy into it runs after the spill has read it.
bool KVCacheManager::Impl::spill(NodeId victim) {
  const BlockId dst = acquire_tier3();  // may drop a third-tier leaf (one of victim's children too)
  if (dst == kNoBlock) return false;
  Node& x = nodes[victim];
  const BlockId host = x.block_id;
  emit_tier3_copy(PoolKind::kSecondary, host, t3, dst, node_digests[victim]);
  lru_remove(victim);
  secondary_node[host] = kNoNode;
  secondary_free.push_back(host);
  x.pool = t3;
  x.block_id = dst;
  node_tier3[victim].from_tier3 = false;
  tier3_node[dst] = victim;
  ++node_tier3[x.parent].num_tier3_children;
  lru_push(victim);
  ++stats.tier3_traffic.spilled_blocks;
  return true;
}

BlockId KVCacheManager::Impl::pop_free_secondary() {
  std::vector<BlockId>& from = secondary_free.empty() ? secondary_onboarded : secondary_free;
  if (from.empty()) return kNoBlock;
  const BlockId b = from.back();
  from.pop_back();
  return b;
}

int KVCacheManager::Impl::lowest_priority(const LruLists& l) {
  for (int p = 0; p < kNumPriorities; ++p) {
    if (l.head[p] != kNoNode) return p;
  }
  return -1;
}

// Lowest priority first, least recently used within a priority, leaves of their tier only: a
// node with children in its own tier or a faster one is skipped (a primary node with primary
// children, a host node with children outside the third tier, a third-tier node with any), so a
// chain is never broken in the middle.
NodeId KVCacheManager::Impl::find_victim(PoolKind pool) const {
  const LruLists& l = lru[static_cast<int>(pool)];
  for (int p = 0; p < kNumPriorities; ++p) {
    for (NodeId n = l.head[p]; n != kNoNode; n = nodes[n].lru_next) {
      const Node& x = nodes[n];
      const int32_t num_blocking = pool == PoolKind::kPrimary     ? x.num_primary_children
                                   : pool == PoolKind::kSecondary ? x.num_children - (has_t3 ? node_tier3[n].num_tier3_children : 0)
                                                                  : x.num_children;
      if (!x.pinned && num_blocking == 0) return n;
    }
  }
  return kNoNode;
}

// Taking count blocks evicts the primary pool's LRU leaves; offloading them drops as many of the
// secondary pool's. Each drop erases index buckets at random places, of nodes last touched long
// ago: a scout walks the list the drops come from ahead of the evictions and starts loading
// those lines, so the cache misses overlap instead of being paid one after another.
void KVCacheManager::Impl::take_new_primary_blocks(int32_t count, std::vector<BlockId>& out) {
  const bool offload = config.num_secondary_blocks > 0;
  const int32_t num_drops =
      count - static_cast<int32_t>(primary_free.size()) - (offload ? num_free_secondary() : 0);
  scout_walk = scout_bucket = kNoNode;
  scout_steps_left = 0;
  if (num_drops > 1) {
    const LruLists& l = lru[offload ? 1 : 0];
    const int p = lowest_priority(l);
    if (p >= 0) {
      scout_walk = scout_bucket = l.head[p];
      scout_steps_left = num_drops;
      for (size_t k = 0; k < kForecastDistance + 2; ++k) advance_scout_walk();
      for (size_t k = 0; k < kForecastDistance; ++k) advance_scout_bucket();
    }
  }
  for (int32_t taken = 0; taken < count;) {
    advance_scout_walk();
    advance_scout_bucket();
    const int32_t num_offloaded = primary_free.empty() ? offload_run(count - taken, out) : 0;
    if (num_offloaded > 0) {
      taken += num_offloaded;
    } else {
      out.push_back(take_new_primary_block());
      ++taken;
    }
  }
}

// The steady state of a full cache, in bulk: offloads a run of primary LRU leaves from the head of
// the lowest-priority list and splices it onto the secondary list once. Its effects are those of
// as many take_new_primary_block calls; the run stops wherever a single call could choose
// differently (a pinned or non-leaf head, a victim that would be dropped, a secondary victim
// that is not the head of an older list).
int32_t KVCacheManager::Impl::offload_run(int32_t max_blocks, std::vector<BlockId>& out) {
  // With a third tier a host victim is spilled, not dropped: one take_new_primary_block at a time.
  if (config.num_secondary_blocks == 0 || has_t3) return 0;
  LruLists& from = lru[static_cast<int>(PoolKind::kPrimary)];
  LruLists& to = lru[static_cast<int>(PoolKind::kSecondary)];
  const int p = lowest_priority(from);
  if (p < 0 || p < config.secondary_offload_min_priority) return 0;
  // Offloaded nodes join secondary list p: a secondary victim must come from a list before it
  // (or from list p's older nodes), else a single call would drop a node of this very run.
  const int q = lowest_priority(to);
  const bool may_drop = q >= 0 && q <= p;
  const NodeId first = from.head[p];
  NodeId v = first, last = kNoNode;
  int32_t n = 0;
  while (n < max_blocks && v != kNoNode) {
    Node& x = nodes[v];
    if (x.pinned || x.num_primary_children > 0) break;
    if (num_free_secondary() == 0) {
      if (!may_drop) break;
      const NodeId victim = to.head[q];
      if (victim == kNoNode || nodes[victim].pinned || nodes[victim].num_children > 0) break;
      drop_node(victim);  // a leaf: its block goes back to secondary_free
    }
    const BlockId dst = pop_free_secondary();
    const BlockId block = x.block_id;
    emit_copy(PoolKind::kPrimary, block, PoolKind::kSecondary, dst, tpb);
    primary_node[block] = kNoNode;
    --nodes[x.parent].num_primary_children;
    --num_unheld_primary;
    x.pool = PoolKind::kSecondary;
    x.block_id = dst;
    secondary_node[dst] = v;
    x.lru_stamp = ++lru_clock;
    ++stats.offloaded_blocks;
    stats.num_offloaded_tokens += tpb;
    emit_event(KvCacheEventKind::kOffloaded, v, false);
    primary_refcount[block] = 1;
    ++num_used_primary;
    out.push_back(block);
    last = v;
    v = x.lru_next;
    ++n;
    advance_scout_walk();
    advance_scout_bucket();
  }
  if (n == 0) return 0;
  // Unlink [first, last] from the head of primary list p; append it to secondary list p.
  from.head[p] = v;
  if (v != kNoNode) {
    nodes[v].lru_prev = kNoNode;
  } else {
    from.tail[p] = kNoNode;
  }
  nodes[first].lru_prev = to.tail[p];
  if (to.tail[p] != kNoNode) {
    nodes[to.tail[p]].lru_next = first;
  } else {
    to.head[p] = first;
  }
  to.tail[p] = last;
  nodes[last].lru_next = kNoNode;
  return n;
}

// The walking cursor loads the next node's line; the bucket cursor, two nodes behind it, loads
// the index buckets that its node's drop (kForecastDistance drops ahead) will erase.
void KVCacheManager::Impl::advance_scout_walk() {
  if (scout_walk == kNoNode) return;
  scout_walk = nodes[scout_walk].lru_next;
  if (scout_walk != kNoNode) prefetch_line(&nodes[scout_walk]);
}

void KVCacheManager::Impl::advance_scout_bucket() {
  if (scout_bucket == kNoNode || scout_steps_left <= 0) return;
  const Node& x = nodes[scout_bucket];
  key_index.prefetch_for_write(x.hash);
  if (x.in_partial_index) partial_index.prefetch_for_write(x.partial_key);
  scout_bucket = x.lru_next;
  --scout_steps_left;
}

// Frees the victim's primary block for the caller: the node moves to the secondary pool
// (offload) when its priority allows and a secondary block can be had, else it is dropped.
BlockId KVCacheManager::Impl::evict_primary(NodeId victim) {
  Node& x = nodes[victim];
  const BlockId block = x.block_id;
  lru_remove(victim);
  --num_unheld_primary;
  if (config.num_secondary_blocks > 0 && x.priority >= config.secondary_offload_min_priority) {
    const BlockId dst = acquire_secondary();
    if (dst != kNoBlock) {
      emit_copy(PoolKind::kPrimary, block, PoolKind::kSecondary, dst, tpb);
      primary_node[block] = kNoNode;
      --nodes[x.parent].num_primary_children;
      x.pool = PoolKind::kSecondary;
      x.block_id = dst;
      secondary_node[dst] = victim;
      lru_push(victim);
      ++stats.offloaded_blocks;
      stats.num_offloaded_tokens += tpb;
      emit_event(KvCacheEventKind::kOffloaded, victim, false);
      return block;
    }
  }
  drop_tree(victim);
  return block;
}

// Drops n and its descendants (all in slower tiers) from the cache, leaves first. Secondary and
// third-tier blocks go back to their free lists; a primary block is left to the caller.
// `reason`: the key history's drop flag, 0 for the tier each node leaves.
void KVCacheManager::Impl::drop_tree(NodeId top, uint8_t reason) {
  if (nodes[top].first_child == kNoNode) {
    drop_node(top, reason);  // the common case: a leaf
    return;
  }
  std::vector<NodeId> order{top};
  for (size_t i = 0; i < order.size(); ++i) {
    for (NodeId c = nodes[order[i]].first_child; c != kNoNode; c = nodes[c].next_sibling) order.push_back(c);
  }
  for (size_t i = order.size(); i-- > 0;) drop_node(order[i], reason);
}

void KVCacheManager::Impl::drop_node(NodeId n, uint8_t reason) {
  Node& x = nodes[n];
  emit_event(KvCacheEventKind::kRemoved, n, false);
  ++stats.evicted_blocks;
  if (reason == 0) {
    reason = x.pool == PoolKind::kPrimary     ? KeyHistory::kDroppedFromPrimary
             : x.pool == PoolKind::kSecondary ? KeyHistory::kDroppedFromHost
                                              : KeyHistory::kDroppedFromTier3;
  }
  // A failed staging is the third tier's loss, whatever block the node was fetched into.
  ++stats.tiers[static_cast<int>(reason == KeyHistory::kFetchFailed ? t3 : x.pool)].evicted_blocks;
  key_history.update(x.hash, reason);
  lru_remove(n);
  key_index.erase(x.hash, n);
  if (x.in_partial_index) partial_index.erase(x.partial_key, n);
  remove_child(n);
  if (x.pool == PoolKind::kSecondary) {
    secondary_node[x.block_id] = kNoNode;
    secondary_free.push_back(x.block_id);
  } else if (x.pool == PoolKind::kPrimary) {
    primary_node[x.block_id] = kNoNode;
  } else {
    tier3_node[x.block_id] = kNoNode;
    tier3_free.push_back(x.block_id);
  }
  // A dead slot is only marked so (store_node writes every field when it is reused); its
  // generation tells sequences holding its id that it is gone.
  ++x.generation;
  x.live = false;
  x.parent = kNoNode;
  free_node_ids.push_back(n);
}

}  // namespace kvtool
