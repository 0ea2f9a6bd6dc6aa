// Prefix tree, pools and reference counts of KVCacheManager (eviction: kv_cache_eviction.cpp).
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "kv_cache_manager_impl.h"

namespace kvtool {

KVCacheManager::Impl::Impl(CacheConfig c, int32_t bits)
    : config(c),
      tpb(c.tokens_per_block),
      key_hash_bits(bits),
      key_index((c.validate(), static_cast<size_t>(c.num_primary_blocks) + c.num_secondary_blocks + c.num_tier3_blocks)),
      partial_index(c.enable_partial_reuse
                        ? static_cast<size_t>(c.num_primary_blocks) + c.num_secondary_blocks + c.num_tier3_blocks
                        : 0),
      // A key is remembered for at least 2 x (blocks of every tier) later drops: a block evicted
      // while up to twice the whole cache was computed after it still counts as evicted.
      key_history(c.enable_block_reuse
                      ? 2 * (static_cast<size_t>(c.num_primary_blocks) + c.num_secondary_blocks + c.num_tier3_blocks)
                      : 0) {
  if (bits < 0 || bits > 64) {
    throw std::invalid_argument("key_hash_bits=" + std::to_string(bits) + " is outside 0..64: use 64");
  }
  has_t3 = config.has_tier3() && config.enable_block_reuse;
  t3 = config.tier3_pool;
  const size_t max_nodes =
      config.enable_block_reuse
          ? static_cast<size_t>(config.num_primary_blocks) + config.num_secondary_blocks + config.num_tier3_blocks
          : 0;
  nodes.assign(max_nodes + 1, Node{});
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
  secondary_onboarded.reserve(config.num_secondary_blocks);
  for (BlockId b = config.num_secondary_blocks; b-- > 0;) secondary_free.push_back(b);
  if (has_t3) {
    tier3_node.assign(config.num_tier3_blocks, kNoNode);
    tier3_free.reserve(config.num_tier3_blocks);
    tier3_fetched.reserve(config.num_tier3_blocks);
    for (BlockId b = config.num_tier3_blocks; b-- > 0;) tier3_free.push_back(b);
    root_key = root_digest(config.plan_digest);
    node_digests.assign(nodes.size(), BlockDigest{});
    node_tier3.assign(nodes.size(), NodeTier3{});
  }
  node_clock.assign(nodes.size(), NodeClock{});
}

NodeId KVCacheManager::Impl::find_child(NodeId parent, uint64_t hash, const TokenId* token_ids,
                                        const ExtraId* extra_ids, uint64_t lora, uint64_t salt) const {
  const bool has_extras = any_extra(extra_ids, tpb);
  // The collision guard: a hash hit is only a candidate; every key field must be equal too.
  return key_index.find(hash, [&](NodeId n) {
    const Node& x = nodes[n];
    if (x.parent != parent || x.hash != hash || x.has_extras != has_extras) return false;
    if (x.lora_task_id != lora || x.cache_salt != salt) return false;
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

void KVCacheManager::Impl::add_child(NodeId parent, NodeId n) {
  Node& p = nodes[parent];
  Node& x = nodes[n];
  x.parent = parent;
  x.prev_sibling = kNoNode;
  ++p.num_children;
  if (x.pool == PoolKind::kPrimary) ++p.num_primary_children;
  if (in_tier3(n)) ++node_tier3[parent].num_tier3_children;
  x.next_sibling = p.first_child;
  if (p.first_child != kNoNode) nodes[p.first_child].prev_sibling = n;
  p.first_child = n;
}

// A new node for block `block` of `pool` below parent: keyed, indexed, in the tree. The callers
// set what depends on how it came (computed by a sequence, or found in the remote store).
inline NodeId KVCacheManager::Impl::insert_node(NodeId parent, uint64_t hash, const TokenId* token_ids,
                                         const ExtraId* extra_ids, uint64_t lora_task_id, uint64_t cache_salt,
                                         uint64_t identity, PoolKind pool, BlockId block, int32_t priority) {
  const NodeId n = free_node_ids.back();
  free_node_ids.pop_back();
  Node& x = nodes[n];
  Node fresh;
  fresh.hash = hash;
  fresh.block_id = block;
  fresh.generation = x.generation;  // the slot keeps counting
  fresh.priority = static_cast<uint8_t>(priority);
  fresh.pool = pool;
  fresh.live = true;
  fresh.has_extras = any_extra(extra_ids, tpb);
  fresh.lora_task_id = lora_task_id;
  fresh.cache_salt = cache_salt;
  x = fresh;
  // A reused slot forgets its former node's third-tier state (a block staged from the third tier,
  // then dropped, must not make this node's later host hits count as the third tier's).
  if (has_t3) node_tier3[n] = NodeTier3{};
  std::memcpy(&node_token_ids[static_cast<size_t>(n) * tpb], token_ids, sizeof(TokenId) * tpb);
  if (x.has_extras) {
    if (node_extra_ids.empty()) node_extra_ids.assign(node_token_ids.size(), 0);
    std::memcpy(&node_extra_ids[static_cast<size_t>(n) * tpb], extra_ids, sizeof(ExtraId) * tpb);
  }
  (pool == PoolKind::kPrimary ? primary_node : secondary_node)[block] = n;
  add_child(parent, n);
  key_index.insert(hash, n);
  if (config.enable_partial_reuse) {
    x.partial_key = partial_key(parent == root ? 0 : nodes[parent].hash, token_ids[0], identity);
    const int32_t num_siblings = nodes[parent].num_children - 1;
    if (parent == root || num_siblings > 0) index_partial(n);
    if (parent != root && num_siblings == 1 && !nodes[x.next_sibling].in_partial_index) {
      index_partial(x.next_sibling);  // no longer an only child
    }
  }
  return n;
}

NodeId KVCacheManager::Impl::store_node(NodeId parent, uint64_t hash, const TokenId* token_ids,
                                        const ExtraId* extra_ids, const Sequence& seq, SequenceId seq_id,
                                        BlockId block, const BlockRetention& retention) {
  const NodeId n = insert_node(parent, hash, token_ids, extra_ids, seq.lora_task_id, seq.cache_salt, seq.identity,
                               PoolKind::kPrimary, block, retention.priority);
  Node& x = nodes[n];
  set_retention(n, retention);
  x.owner_running = true;
  x.owner = seq_id;
  ++stats.tiers[static_cast<int>(PoolKind::kPrimary)].stored_blocks;
  if (has_t3) node_digests[n] = block_digest(digest_of(parent), token_ids, extra_ids, tpb, seq.lora_task_id, seq.cache_salt);
  on_child_held(parent);  // its block is referenced: held from the start
  emit_event(KvCacheEventKind::kStored, n, true);
  return n;
}

// A node for a block another engine stored in the remote store: it arrives in host block `block`
// (its fetch emitted by the caller), keyed like a block this manager computed.
NodeId KVCacheManager::Impl::store_discovered_node(NodeId parent, uint64_t hash, const TokenId* token_ids,
                                                   const ExtraId* extra_ids, const SequenceSpec& spec,
                                                   const BlockDigest& digest, BlockId block, int32_t priority) {
  const NodeId n = insert_node(parent, hash, token_ids, extra_ids, spec.lora_task_id, spec.cache_salt,
                               key_identity(spec.lora_task_id, spec.cache_salt), PoolKind::kSecondary, block, priority);
  node_digests[n] = digest;
  set_retention(n, BlockRetention{priority, -1, false});
  lru_push(n);
  emit_event(KvCacheEventKind::kStored, n, true);
  return n;
}

void KVCacheManager::Impl::release_lower_block(NodeId n) {
  Node& x = nodes[n];
  if (x.pool == PoolKind::kSecondary) {
    secondary_node[x.block_id] = kNoNode;
    secondary_onboarded.push_back(x.block_id);  // an onboard of this step may still read it
  } else if (in_tier3(n)) {
    tier3_node[x.block_id] = kNoNode;
    tier3_free.push_back(x.block_id);  // adopted without a copy: nothing reads the slot
    --node_tier3[x.parent].num_tier3_children;
  }
  if (has_t3) node_tier3[n].from_tier3 = false;
}

void KVCacheManager::Impl::move_to_primary(NodeId n, BlockId block) {
  Node& x = nodes[n];
  lru_remove(n);
  release_lower_block(n);
  x.pool = PoolKind::kPrimary;
  x.block_id = block;
  x.pinned = false;
  stop_retention_clock(n);  // referenced: its retention clock stops
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
      stop_retention_clock(n);  // referenced: its retention clock stops
      on_referenced(n);
    }
  }
}

void KVCacheManager::Impl::unref_block(BlockId b, SequenceId seq_id) {
  const NodeId n = primary_node[b];
  if (n != kNoNode && nodes[n].owner_running && nodes[n].owner == seq_id) nodes[n].owner_running = false;
  if (--primary_refcount[b] == 0) {
    --num_used_primary;
    if (n == kNoNode) {
      primary_free.push_back(b);
    } else {
      lru_push(n);
      if (uses_durations) start_retention_clock(n);
      on_unreferenced(n);
    }
  }
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
