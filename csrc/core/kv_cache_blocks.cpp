// Prefix tree, pools, reference counts, LRU eviction and host offload of KVCacheManager.
#include <algorithm>
#include <cstring>
#include <stdexcept>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kv_cache_manager_impl.h"

namespace kvtool {

namespace {

// Copies a block's token ids into the node store. The store is written once per node and read
// only to confirm a key hit, so whole cache lines are written around the cache (no line fill,
// no eviction of hot index buckets); the manager's own later reads still see them.
void store_tokens(TokenId* dst, const TokenId* src, size_t num_tokens) {
  const size_t num_bytes = num_tokens * sizeof(TokenId);
#if defined(__SSE2__)
  if (num_bytes % 64 == 0 && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
    auto* d = reinterpret_cast<__m128i*>(dst);
    const auto* s = reinterpret_cast<const __m128i*>(src);
    for (size_t i = 0; i < num_bytes / 16; ++i) _mm_stream_si128(d + i, _mm_loadu_si128(s + i));
    return;
  }
#endif
  std::memcpy(dst, src, num_bytes);
}

}  // namespace

KVCacheManager::Impl::Impl(CacheConfig c, int32_t bits)
    : config(c),
      tpb(c.tokens_per_block),
      key_hash_bits(bits),
      key_index((c.validate(), static_cast<size_t>(c.num_primary_blocks) + c.num_secondary_blocks)),
      partial_index(c.enable_partial_reuse ? static_cast<size_t>(c.num_primary_blocks) + c.num_secondary_blocks
                                           : 0) {
  if (bits < 0 || bits > 64) {
    throw std::invalid_argument("key_hash_bits=" + std::to_string(bits) + " is outside 0..64: use 64");
  }
  const size_t max_nodes = config.enable_block_reuse
                               ? static_cast<size_t>(config.num_primary_blocks) + config.num_secondary_blocks
                               : 0;
  nodes.assign(max_nodes + 1, Node{});
  node_info.assign(max_nodes + 1, NodeInfo{});
  root = static_cast<NodeId>(max_nodes);
  nodes[root].live = true;
  free_node_ids.reserve(max_nodes);
  for (size_t n = max_nodes; n-- > 0;) free_node_ids.push_back(static_cast<NodeId>(n));
  node_token_ids.assign(max_nodes * tpb, 0);
  primary_refcount.assign(config.num_primary_blocks, 0);
  primary_node.assign(config.num_primary_blocks, kNoNode);
  primary_free.reserve(config.num_primary_blocks);
  for (BlockId b = config.num_primary_blocks; b-- > 0;) primary_free.push_back(b);
  secondary_node.assign(config.num_secondary_blocks, kNoNode);
  secondary_free.reserve(config.num_secondary_blocks);
  for (BlockId b = config.num_secondary_blocks; b-- > 0;) secondary_free.push_back(b);
}

NodeId KVCacheManager::Impl::find_child(NodeId parent, uint64_t hash, const TokenId* token_ids,
                                        const ExtraId* extra_ids, uint64_t lora, uint64_t salt) const {
  const bool has_extras = any_extra(extra_ids, tpb);
  // The collision guard: a hash hit is only a candidate; every key field must be equal too.
  return key_index.find(hash, [&](NodeId n) {
    const Node& x = nodes[n];
    if (x.parent != parent || x.hash != hash || x.has_extras != has_extras) return false;
    if (node_info[n].lora_task_id != lora || node_info[n].cache_salt != salt) return false;
    if (std::memcmp(node_tokens(n), token_ids, sizeof(TokenId) * tpb) != 0) return false;
    return !has_extras || std::memcmp(node_extras(n), extra_ids, sizeof(ExtraId) * tpb) == 0;
  });
}

// Held = a primary node that is referenced or has a held child: it cannot be evicted until the
// sequences below it let go. Unheld primary nodes are counted as available blocks. A change
// climbs the chain only while it flips a parent's held state.
void KVCacheManager::Impl::on_child_held(NodeId p) {
  for (; p != root; p = nodes[p].parent) {
    Node& x = nodes[p];
    if (x.num_held_children++ > 0 || primary_refcount[x.block_id] > 0) return;  // was held already
    --num_unheld_primary;
  }
}

void KVCacheManager::Impl::on_child_unheld(NodeId p) {
  for (; p != root; p = nodes[p].parent) {
    Node& x = nodes[p];
    if (--x.num_held_children > 0 || primary_refcount[x.block_id] > 0) return;  // still held
    ++num_unheld_primary;
  }
}

void KVCacheManager::Impl::lru_push(NodeId n) {
  Node& x = nodes[n];
  LruLists& l = lru[static_cast<int>(x.pool)];
  const int p = x.priority;
  x.lru_prev = l.tail[p];
  x.lru_next = kNoNode;
  if (l.tail[p] != kNoNode) {
    nodes[l.tail[p]].lru_next = n;
  } else {
    l.head[p] = n;
  }
  l.tail[p] = n;
  l.nonempty[p >> 6] |= 1ULL << (p & 63);
  x.in_lru = true;
  node_info[n].lru_stamp = ++lru_clock;
}

void KVCacheManager::Impl::lru_remove(NodeId n) {
  Node& x = nodes[n];
  if (!x.in_lru) return;
  LruLists& l = lru[static_cast<int>(x.pool)];
  const int p = x.priority;
  if (x.lru_prev != kNoNode) {
    nodes[x.lru_prev].lru_next = x.lru_next;
  } else {
    l.head[p] = x.lru_next;
  }
  if (x.lru_next != kNoNode) {
    nodes[x.lru_next].lru_prev = x.lru_prev;
  } else {
    l.tail[p] = x.lru_prev;
  }
  if (l.head[p] == kNoNode) l.nonempty[p >> 6] &= ~(1ULL << (p & 63));
  x.lru_prev = x.lru_next = kNoNode;
  x.in_lru = false;
}

// Children lists serve drop_tree only, which never drops the root: the root's children (a
// block for nearly every distinct first block) are counted, not linked, so storing or dropping
// one never touches a random sibling.
void KVCacheManager::Impl::add_child(NodeId parent, NodeId n) {
  Node& p = nodes[parent];
  Node& x = nodes[n];
  x.parent = parent;
  x.prev_sibling = kNoNode;
  x.next_sibling = kNoNode;
  ++p.num_children;
  if (x.pool == PoolKind::kPrimary) ++p.num_primary_children;
  if (parent == root) return;
  x.next_sibling = p.first_child;
  if (p.first_child != kNoNode) nodes[p.first_child].prev_sibling = n;
  p.first_child = n;
}

void KVCacheManager::Impl::remove_child(NodeId n) {
  Node& x = nodes[n];
  Node& p = nodes[x.parent];
  if (x.parent == root) {
    --p.num_children;
    if (x.pool == PoolKind::kPrimary) --p.num_primary_children;
    return;
  }
  if (x.prev_sibling != kNoNode) {
    nodes[x.prev_sibling].next_sibling = x.next_sibling;
  } else {
    p.first_child = x.next_sibling;
  }
  if (x.next_sibling != kNoNode) nodes[x.next_sibling].prev_sibling = x.prev_sibling;
  --p.num_children;
  if (x.pool == PoolKind::kPrimary) --p.num_primary_children;
  x.prev_sibling = x.next_sibling = kNoNode;
}

NodeId KVCacheManager::Impl::store_node(NodeId parent, uint64_t hash, const TokenId* token_ids,
                                        const ExtraId* extra_ids, const Sequence& seq, SequenceId seq_id,
                                        BlockId block) {
  const NodeId n = free_node_ids.back();
  free_node_ids.pop_back();
  Node& x = nodes[n];
  NodeInfo& info = node_info[n];
  // Every field written one by one (the slot keeps its generation): no wide copy into the line
  // followed by narrow read-modify-writes of its flag bits.
  x.hash = hash;
  x.partial_key = 0;
  x.first_child = x.next_sibling = x.prev_sibling = kNoNode;
  x.lru_prev = x.lru_next = kNoNode;
  x.num_children = x.num_primary_children = x.num_held_children = 0;
  x.block_id = block;
  x.priority = static_cast<uint8_t>(seq.priority);
  x.pool = PoolKind::kPrimary;
  x.live = true;
  x.in_lru = false;
  x.pinned = false;
  x.has_extras = any_extra(extra_ids, tpb);
  x.owner_running = true;
  x.in_partial_index = false;
  info.lora_task_id = seq.lora_task_id;
  info.cache_salt = seq.cache_salt;
  info.owner = seq_id;
  store_tokens(&node_token_ids[static_cast<size_t>(n) * tpb], token_ids, tpb);
  if (x.has_extras) {
    if (node_extra_ids.empty()) node_extra_ids.assign(node_token_ids.size(), 0);
    std::memcpy(&node_extra_ids[static_cast<size_t>(n) * tpb], extra_ids, sizeof(ExtraId) * tpb);
  }
  primary_node[block] = n;
  add_child(parent, n);
  key_index.insert(hash, n);
  if (config.enable_partial_reuse) {
    x.partial_key = partial_key(parent == root ? 0 : nodes[parent].hash, token_ids[0], seq.identity);
    const int32_t num_siblings = nodes[parent].num_children - 1;
    if (parent == root || num_siblings > 0) index_partial(n);
    if (parent != root && num_siblings == 1 && !nodes[x.next_sibling].in_partial_index) {
      index_partial(x.next_sibling);  // no longer an only child
    }
  }
  on_child_held(parent);  // its block is referenced: held from the start
  emit_event(KvCacheEventKind::kStored, n, true);
  return n;
}

void KVCacheManager::Impl::move_to_primary(NodeId n, BlockId block) {
  Node& x = nodes[n];
  lru_remove(n);
  secondary_node[x.block_id] = kNoNode;
  secondary_free.push_back(x.block_id);
  x.pool = PoolKind::kPrimary;
  x.block_id = block;
  x.pinned = false;
  primary_node[block] = n;
  ++nodes[x.parent].num_primary_children;
  on_child_held(x.parent);  // the caller referenced its block: held from the start
}

void KVCacheManager::Impl::ref_block(BlockId b) {
  if (primary_refcount[b]++ == 0) {
    ++num_used_primary;
    const NodeId n = primary_node[b];
    if (n != kNoNode) {
      lru_remove(n);
      on_referenced(n);
    }
  }
}

void KVCacheManager::Impl::unref_block(BlockId b, SequenceId seq_id) {
  const NodeId n = primary_node[b];
  if (n != kNoNode && nodes[n].owner_running && node_info[n].owner == seq_id) nodes[n].owner_running = false;
  if (--primary_refcount[b] == 0) {
    --num_used_primary;
    if (n == kNoNode) {
      primary_free.push_back(b);
    } else {
      lru_push(n);
      on_unreferenced(n);
    }
  }
}

// unref_block for block_ids from the last to the first, with the nodes that become unreferenced
// linked into runs (one per stretch of equal priority) that join their LRU list in one splice.
void KVCacheManager::Impl::unref_blocks_last_first(const std::vector<BlockId>& block_ids, SequenceId seq_id) {
  LruLists& l = lru[static_cast<int>(PoolKind::kPrimary)];
  NodeId first = kNoNode, last = kNoNode;
  int priority = -1;
  auto splice = [&] {
    if (first == kNoNode) return;
    nodes[first].lru_prev = l.tail[priority];
    if (l.tail[priority] != kNoNode) {
      nodes[l.tail[priority]].lru_next = first;
    } else {
      l.head[priority] = first;
    }
    l.tail[priority] = last;
    nodes[last].lru_next = kNoNode;
    l.nonempty[priority >> 6] |= 1ULL << (priority & 63);
  };
  for (size_t i = block_ids.size(); i-- > 0;) {
    const BlockId b = block_ids[i];
    if (b == kNoBlock) continue;
    const NodeId n = primary_node[b];
    if (n != kNoNode && nodes[n].owner_running && node_info[n].owner == seq_id) nodes[n].owner_running = false;
    if (--primary_refcount[b] != 0) continue;
    --num_used_primary;
    if (n == kNoNode) {
      primary_free.push_back(b);
      continue;
    }
    Node& x = nodes[n];
    if (x.priority != priority) {
      splice();
      priority = x.priority;
      first = n;
    } else {
      nodes[last].lru_next = n;
      x.lru_prev = last;
    }
    last = n;
    x.in_lru = true;
    node_info[n].lru_stamp = ++lru_clock;
    on_unreferenced(n);
  }
  splice();
}

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
  if (secondary_free.empty()) {
    const NodeId victim = find_victim(PoolKind::kSecondary);
    if (victim == kNoNode) return kNoBlock;
    drop_tree(victim);  // a leaf: its block goes back to secondary_free
  }
  const BlockId b = secondary_free.back();
  secondary_free.pop_back();
  return b;
}

int KVCacheManager::Impl::lowest_priority(const LruLists& l) {
  if (l.nonempty[0] != 0) return __builtin_ctzll(l.nonempty[0]);
  if (l.nonempty[1] != 0) return 64 + __builtin_ctzll(l.nonempty[1]);
  return -1;
}

// Lowest priority first, least recently used within a priority, leaves only: a primary node
// with primary children (or any node with children in the secondary pool) is skipped, so a
// chain is never broken in the middle.
NodeId KVCacheManager::Impl::find_victim(PoolKind pool) const {
  const LruLists& l = lru[static_cast<int>(pool)];
  for (int word = 0; word < 2; ++word) {
    uint64_t bits = l.nonempty[word];
    while (bits != 0) {
      const int p = word * 64 + __builtin_ctzll(bits);
      bits &= bits - 1;
      for (NodeId n = l.head[p]; n != kNoNode; n = nodes[n].lru_next) {
        const Node& x = nodes[n];
        if (x.pinned) continue;
        if ((pool == PoolKind::kPrimary ? x.num_primary_children : x.num_children) == 0) {
          return n;
        }
      }
    }
  }
  return kNoNode;
}

// Taking count blocks evicts the primary pool's first LRU leaves; offloading them drops as many
// of the secondary pool's (without a host tier the primary victims are dropped themselves). A
// drop erases two index buckets at random places, and the victims' nodes were last touched long
// ago. A scout walks the list the drops come from a few nodes ahead of the evictions, loading
// each node a step before it reads it (and, runs of node ids being common, the one a stride
// further), then the buckets of the node kForecastDistance drops ahead: the cache misses overlap
// with the evictions instead of being paid one after another.
void KVCacheManager::Impl::take_new_primary_blocks(int32_t count, std::vector<BlockId>& out) {
  const bool offload = config.num_secondary_blocks > 0;
  const int32_t num_drops =
      count - static_cast<int32_t>(primary_free.size()) - (offload ? static_cast<int32_t>(secondary_free.size()) : 0);
  scout_walk = scout_bucket = kNoNode;
  scout_steps_left = 0;
  if (num_drops > 1) {
    const LruLists& l = lru[offload ? 1 : 0];
    const int p = lowest_priority(l);
    if (p >= 0) {
      scout_walk = scout_bucket = l.head[p];
      scout_steps_left = num_drops;
      for (size_t k = 0; k < kForecastDistance + 2 && scout_walk != kNoNode; ++k) advance_scout_walk();
      for (size_t k = 0; k < kForecastDistance; ++k) advance_scout_bucket();
    }
  }
  for (int32_t taken = 0; taken < count;) {
    scout();
    if (primary_free.empty()) {
      const int32_t num_offloaded = offload_run(count - taken, out);
      if (num_offloaded > 0) {
        taken += num_offloaded;
        continue;
      }
    }
    out.push_back(take_new_primary_block());
    ++taken;
  }
}

// The walking cursor loads the next node's line (and, runs of node ids being common, the one a
// stride further); the bucket cursor, two nodes behind, loads the index buckets of its node.
void KVCacheManager::Impl::advance_scout_walk() {
  const NodeId next = nodes[scout_walk].lru_next;
  if (next != kNoNode) {
    prefetch_line(&nodes[next]);
    const int64_t guess = 2 * static_cast<int64_t>(next) - scout_walk;
    if (guess >= 0 && guess < static_cast<int64_t>(nodes.size())) prefetch_line(&nodes[guess]);
  }
  scout_walk = next;
}

void KVCacheManager::Impl::advance_scout_bucket() {
  if (scout_bucket == kNoNode || scout_steps_left <= 0) return;
  const Node& x = nodes[scout_bucket];
  key_index.prefetch_for_write(x.hash);
  if (x.in_partial_index) partial_index.prefetch_for_write(x.partial_key);
  scout_bucket = x.lru_next;
  --scout_steps_left;
}

// One eviction's step of the scout (see take_new_primary_blocks).
void KVCacheManager::Impl::scout() {
  if (scout_walk != kNoNode) advance_scout_walk();
  advance_scout_bucket();
}

// The steady state of a full cache, in bulk: offloads a run of primary LRU leaves from the head of
// the lowest-priority list, each into a free secondary block or the block of a secondary LRU leaf
// dropped for it, and splices the run onto the secondary list once (its LRU links are already in
// order). Every effect — copy ops, events, stamps, counters, which nodes go — is that of as many
// take_new_primary_block calls; the run stops (returning the blocks taken so far) wherever a
// single call could choose differently: a pinned or non-leaf head, a victim that would be
// dropped, or a secondary victim that would not be the head of the list the run started from.
int32_t KVCacheManager::Impl::offload_run(int32_t max_blocks, std::vector<BlockId>& out) {
  if (config.num_secondary_blocks == 0) return 0;
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
    // The next victim (usually this one's parent) and, runs of node ids being common, the one
    // after it: their lines load while this one is offloaded.
    if (x.lru_next != kNoNode) {
      prefetch_line_for_write(&nodes[x.lru_next]);
      prefetch_line_for_write(&node_info[x.lru_next]);  // its LRU stamp is written
      const int64_t guess = 2 * static_cast<int64_t>(x.lru_next) - v;
      if (guess >= 0 && guess < static_cast<int64_t>(nodes.size())) {
        prefetch_line_for_write(&nodes[guess]);
        prefetch_line_for_write(&node_info[guess]);
      }
    }
    if (secondary_free.empty()) {
      if (!may_drop) break;
      const NodeId victim = to.head[q];
      if (victim == kNoNode || nodes[victim].pinned || nodes[victim].num_children > 0) break;
      drop_node(victim);  // a leaf: its block goes back to secondary_free
    }
    const BlockId dst = secondary_free.back();
    secondary_free.pop_back();
    const BlockId block = x.block_id;
    emit_copy(PoolKind::kPrimary, block, PoolKind::kSecondary, dst, tpb);
    primary_node[block] = kNoNode;
    --nodes[x.parent].num_primary_children;
    --num_unheld_primary;
    x.pool = PoolKind::kSecondary;
    x.block_id = dst;
    secondary_node[dst] = v;
    node_info[v].lru_stamp = ++lru_clock;
    ++stats.offloaded_blocks;
    stats.num_offloaded_tokens += tpb;
    emit_event(KvCacheEventKind::kOffloaded, v, false);
    primary_refcount[block] = 1;
    ++num_used_primary;
    out.push_back(block);
    last = v;
    v = x.lru_next;
    ++n;
    scout();
  }
  if (n == 0) return 0;
  // Unlink [first, last] from the head of primary list p; append it to secondary list p.
  from.head[p] = v;
  if (v != kNoNode) {
    nodes[v].lru_prev = kNoNode;
  } else {
    from.tail[p] = kNoNode;
    from.nonempty[p >> 6] &= ~(1ULL << (p & 63));
  }
  nodes[first].lru_prev = to.tail[p];
  if (to.tail[p] != kNoNode) {
    nodes[to.tail[p]].lru_next = first;
  } else {
    to.head[p] = first;
  }
  to.tail[p] = last;
  nodes[last].lru_next = kNoNode;
  to.nonempty[p >> 6] |= 1ULL << (p & 63);
  return n;
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

// Drops n and its descendants (all in the secondary pool) from the cache, leaves first.
// Secondary blocks go back to secondary_free; a primary block is left to the caller.
void KVCacheManager::Impl::drop_tree(NodeId top) {
  if (nodes[top].first_child == kNoNode) {
    drop_node(top);  // the common case: a leaf
    return;
  }
  std::vector<NodeId> order{top};
  for (size_t i = 0; i < order.size(); ++i) {
    for (NodeId c = nodes[order[i]].first_child; c != kNoNode; c = nodes[c].next_sibling) order.push_back(c);
  }
  for (size_t i = order.size(); i-- > 0;) drop_node(order[i]);
}

void KVCacheManager::Impl::drop_node(NodeId n) {
  Node& x = nodes[n];
  emit_event(KvCacheEventKind::kRemoved, n, false);
  ++stats.evicted_blocks;
  lru_remove(n);
  key_index.erase(x.hash, n);
  if (x.in_partial_index) partial_index.erase(x.partial_key, n);
  remove_child(n);
  if (x.pool == PoolKind::kSecondary) {
    secondary_node[x.block_id] = kNoNode;
    secondary_free.push_back(x.block_id);
  } else {
    primary_node[x.block_id] = kNoNode;
  }
  // A dead slot is only marked so (store_node writes every field when it is reused); its
  // generation tells sequences holding its id that it is gone.
  ++x.generation;
  x.live = false;
  x.parent = kNoNode;
  free_node_ids.push_back(n);
}

void KVCacheManager::Impl::emit_copy(PoolKind src_pool, BlockId src, PoolKind dst_pool, BlockId dst,
                                     int32_t num_tokens) {
  // Filled in place: a CopyOp built on the stack and copied costs a store-forwarding stall.
  CopyOp& op = copy_ops.emplace_back();
  op.src_pool = src_pool;
  op.src_block_id = src;
  op.dst_pool = dst_pool;
  op.dst_block_id = dst;
  op.num_tokens = num_tokens;
}

void KVCacheManager::Impl::record_event(KvCacheEventKind kind, NodeId n, bool with_tokens) {
  const int64_t id = next_event_id++;
  if (static_cast<int32_t>(events.size()) >= config.event_buffer_max_size) events.pop_front();
  KvCacheEvent e;
  e.event_id = id;
  e.kind = kind;
  e.block_hash = nodes[n].hash;
  e.parent_hash = nodes[n].parent == root ? 0 : nodes[nodes[n].parent].hash;
  if (with_tokens) e.token_ids.assign(node_tokens(n), node_tokens(n) + tpb);
  events.push_back(std::move(e));
}

}  // namespace kvtool
