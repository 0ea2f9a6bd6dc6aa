// Internal state of KVCacheManager, shared by its .cpp files (not the interface).
// Every cached block is a node of a prefix tree; sequences hold blocks, not nodes.
// Rules: docs/architecture.md#kv-cache-rules
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "block_digest.h"
#include "block_key.h"
#include "key_history.h"
#include "kv_cache_manager.h"
#include "node_index.h"

namespace kvtool {

inline constexpr int32_t kNumPriorities = 101;  // retention priorities 0..100
inline constexpr int64_t kNever = INT64_MAX;     // a retention priority that never reverts

struct KVCacheManager::Impl {
  struct Node {
    uint64_t hash = 0;              // chained block key (truncated with key_hash_bits)
    uint64_t partial_key = 0;       // its key in partial_index
    NodeId parent = kNoNode;
    NodeId first_child = kNoNode;
    NodeId next_sibling = kNoNode;
    NodeId prev_sibling = kNoNode;
    NodeId lru_prev = kNoNode;
    NodeId lru_next = kNoNode;
    int32_t num_children = 0;
    int32_t num_primary_children = 0;
    int32_t num_held_children = 0;  // primary children that are held (see is_held)
    BlockId block_id = kNoBlock;
    uint32_t generation = 0;        // bumped when the slot is freed, so stale NodeIds are detected
    uint8_t priority = kDefaultPriority;
    PoolKind pool = PoolKind::kPrimary;
    bool live = false;
    bool in_lru = false;
    bool pinned = false;            // being onboarded / copied: not an eviction candidate
    bool has_extras = false;        // some extra id of the block is non-zero
    bool owner_running = false;     // the sequence that computed it still references it (early reuse)
    bool in_partial_index = false;
    uint64_t lora_task_id = 0;
    uint64_t cache_salt = 0;
    SequenceId owner = 0;           // the sequence that computed it
    uint64_t lru_stamp = 0;         // when it last entered an LRU list (tie-break of partial sources)
  };
  // A node's third-tier state, beside it: the manager without a third tier never touches it.
  struct NodeTier3 {
    int32_t num_tier3_children = 0;  // children in the third tier
    bool from_tier3 = false;         // staged from the third tier into the host tier, not reused since
    bool staging = false;            // its fetch is not confirmed yet (complete_staging)
  };
  // A node's retention clock, beside it: read only once some range gave a duration
  // (uses_durations), so the release and reuse of blocks touch no more memory than before.
  struct NodeClock {
    int64_t duration_ms = -1;        // its priority reverts this long after its release; -1: never
    int64_t expires_at_ms = kNever;  // when it reverts (set while unreferenced)
  };

  // One list per retention priority, least recently used first.
  struct LruLists {
    NodeId head[kNumPriorities];
    NodeId tail[kNumPriorities];
    LruLists() {
      for (int p = 0; p < kNumPriorities; ++p) head[p] = tail[p] = kNoNode;
    }
  };

  struct Sequence {
    std::vector<TokenId> token_ids;  // prompt + appended
    std::vector<ExtraId> extra_ids;  // empty when all are 0; else one per token
    uint64_t lora_task_id = 0;
    uint64_t cache_salt = 0;
    uint64_t identity = 0;           // key_identity(lora_task_id, cache_salt)
    int32_t priority = kDefaultPriority;
    std::vector<RetentionRange> retention;
    std::vector<BlockId> block_ids;  // primary block table, kNoBlock where the window released
    std::vector<uint64_t> block_hashes;  // keys of its first full blocks, as far as computed
    // Plain keys (the same tokens' keys with LoRA 0, salt 0, no extra ids) of its first full
    // blocks, as far as computed; empty when they equal block_hashes (see plain_keys_differ).
    std::vector<uint64_t> plain_hashes;
    int32_t num_computed_tokens = 0;
    int32_t num_stored_blocks = 0;     // leading full blocks whose canonical node is known
    NodeId last_node = kNoNode;        // canonical node of block num_stored_blocks - 1 (root if 0)
    uint32_t last_node_generation = 0;
    bool chain_broken = false;         // a parent left the primary pool: no further blocks stored
    int32_t num_window_released = 0;   // blocks [0, n) were released by the sliding window
  };

  // A prefix lookup, found without side effects and applied by add_sequence.
  struct PrefixMatch {
    std::vector<NodeId> nodes;       // the matched chain, root first
    std::vector<uint64_t> hashes;    // keys of the prompt's first blocks (at least the matched ones)
    std::vector<uint64_t> plain_hashes;  // plain keys of its first blocks, when not equal to hashes
    uint64_t identity = 0;           // key_identity(lora_task_id, cache_salt)
    uint64_t last_hash = 0;
    int32_t num_secondary = 0;
    int32_t num_held_primary = 0;    // matched primary nodes already held (not in num_available)
    int32_t num_early = 0;
    NodeId partial_source = kNoNode;
    int32_t num_partial_tokens = 0;
    bool partial_source_evictable = false;  // pinned during the copy: one block less to evict
  };

  // A block's retention: the range holding its first token, else the sequence's priority.
  struct BlockRetention {
    int32_t priority = kDefaultPriority;
    int64_t duration_ms = -1;
    bool in_range = false;
  };
  // A node's priority reverting at expires_at_ms; stale once the node's own time differs.
  struct Expiry {
    int64_t expires_at_ms = 0;
    NodeId node = kNoNode;
    uint32_t generation = 0;
  };
  // A fetch of an open staging (third tier -> host block), in chain order.
  struct StagedFetch {
    NodeId node = kNoNode;
    BlockId host_block = kNoBlock;
  };

  Impl(CacheConfig config, int32_t key_hash_bits);

  // ---- prefix tree and pools (kv_cache_blocks.cpp) ----
  const TokenId* node_tokens(NodeId n) const { return &node_token_ids[static_cast<size_t>(n) * tpb]; }
  const ExtraId* node_extras(NodeId n) const {
    return nodes[n].has_extras ? &node_extra_ids[static_cast<size_t>(n) * tpb] : nullptr;
  }
  // Partial-reuse candidates are found by (parent key, first token, LoRA + salt identity).
  static uint64_t partial_key(uint64_t parent_hash, TokenId first_token, uint64_t identity) {
    return fold_mul(parent_hash ^ 0x632BE59BD9B4E019ULL,
                    (static_cast<uint64_t>(static_cast<uint32_t>(first_token)) | (1ULL << 40)) ^ identity);
  }
  NodeId find_child(NodeId parent, uint64_t hash, const TokenId* token_ids, const ExtraId* extra_ids,
                    uint64_t lora, uint64_t salt) const;
  // Held: a primary node that is referenced or has a held child; it cannot be evicted.
  bool is_held(NodeId n) const {
    const Node& x = nodes[n];
    return x.pool == PoolKind::kPrimary && (primary_refcount[x.block_id] > 0 || x.num_held_children > 0);
  }
  // A primary node's block got its first reference, or lost its last one.
  void on_referenced(NodeId n) {
    if (nodes[n].num_held_children > 0) return;  // held already
    --num_unheld_primary;
    on_child_held(nodes[n].parent);
  }
  void on_unreferenced(NodeId n) {
    if (nodes[n].num_held_children > 0) return;  // still held
    ++num_unheld_primary;
    on_child_unheld(nodes[n].parent);
  }
  void on_child_held(NodeId p);
  void on_child_unheld(NodeId p);
  void lru_push(NodeId n);
  void lru_remove(NodeId n);
  void add_child(NodeId parent, NodeId n);
  void remove_child(NodeId n);
  void index_partial(NodeId n) {
    partial_index.insert(nodes[n].partial_key, n);
    nodes[n].in_partial_index = true;
  }
  // Inline (kv_cache_blocks.cpp, its only user): storing computed blocks is the manager's hot path.
  inline NodeId insert_node(NodeId parent, uint64_t hash, const TokenId* token_ids, const ExtraId* extra_ids,
                     uint64_t lora_task_id, uint64_t cache_salt, uint64_t identity, PoolKind pool, BlockId block,
                     int32_t priority);
  NodeId store_node(NodeId parent, uint64_t hash, const TokenId* token_ids, const ExtraId* extra_ids,
                    const Sequence& seq, SequenceId seq_id, BlockId block, const BlockRetention& retention);
  // A node for a block found in the remote store, in host block `block` (stage_tier3).
  NodeId store_discovered_node(NodeId parent, uint64_t hash, const TokenId* token_ids, const ExtraId* extra_ids,
                               const SequenceSpec& spec, const BlockDigest& digest, BlockId block, int32_t priority);
  void move_to_primary(NodeId n, BlockId block);  // onboard / adopt into an already referenced block
  // The node's block in a pool other than the primary one leaves it (its slot freed or deferred).
  void release_lower_block(NodeId n);
  void ref_block(BlockId b);
  void unref_block(BlockId b, SequenceId seq_id);
  void emit_copy(PoolKind src_pool, BlockId src, PoolKind dst_pool, BlockId dst, int32_t num_tokens) {
    copy_ops.push_back(CopyOp{src_pool, src, dst_pool, dst, num_tokens});
  }
  void emit_tier3_copy(PoolKind src_pool, BlockId src, PoolKind dst_pool, BlockId dst, const BlockDigest& key) {
    emit_copy(src_pool, src, dst_pool, dst, tpb);
    copy_op_keys.push_back(key);
  }
  void emit_event(KvCacheEventKind kind, NodeId n, bool with_tokens) {
    if (config.event_buffer_max_size > 0) {
      record_event(kind, n, with_tokens);
    } else {
      ++next_event_id;  // ids count every event, recorded or not
    }
  }
  void record_event(KvCacheEventKind kind, NodeId n, bool with_tokens);

  // ---- eviction and offload (kv_cache_eviction.cpp) ----
  BlockId take_new_primary_block();  // refcount 1, no node; evicts when none is free
  void take_new_primary_blocks(int32_t count, std::vector<BlockId>& out);  // appends count blocks
  BlockId acquire_primary();
  BlockId acquire_secondary();       // kNoBlock when no secondary block can be had
  BlockId acquire_tier3();           // kNoBlock when no third-tier slot can be had
  bool spill(NodeId victim);         // host -> third tier; false (nothing changed) when no slot
  BlockId pop_free_secondary();      // a free secondary block, kNoBlock when none is free
  int32_t num_free_secondary() const {
    return static_cast<int32_t>(secondary_free.size() + secondary_onboarded.size());
  }
  static int lowest_priority(const LruLists& l);  // -1 when every list is empty
  NodeId find_victim(PoolKind pool) const;
  int32_t offload_run(int32_t max_blocks, std::vector<BlockId>& out);  // blocks taken, 0 if none
  BlockId evict_primary(NodeId victim);
  void drop_tree(NodeId n, uint8_t reason = 0);
  void drop_node(NodeId n, uint8_t reason = 0);  // a node without children
  void advance_scout_walk();
  void advance_scout_bucket();
  static constexpr size_t kForecastDistance = 12;  // drops between a bucket prefetch and its use

  // ---- retention (kv_cache_retention.cpp) ----
  // The range holding the block's first token decides (TensorRT-LLM's per-block rule).
  BlockRetention block_retention(const std::vector<RetentionRange>& ranges, int32_t priority, int64_t block) const {
    const int64_t first = block * tpb;
    for (const RetentionRange& r : ranges) {
      if (first < r.token_start) break;  // sorted: no later range holds it either
      if (r.token_end < 0 || first < r.token_end) return BlockRetention{r.priority, r.duration_ms, true};
    }
    return BlockRetention{priority, -1, false};
  }
  void set_retention(NodeId n, const BlockRetention& r) {
    nodes[n].priority = static_cast<uint8_t>(r.priority);
    if (r.duration_ms >= 0) uses_durations = true;
    if (uses_durations) node_clock[n] = NodeClock{r.duration_ms, kNever};
  }
  void stop_retention_clock(NodeId n) {  // referenced again
    if (uses_durations) node_clock[n].expires_at_ms = kNever;
  }
  void start_retention_clock(NodeId n);  // the node was released: its priority's duration starts (uses_durations)
  void expire_retention();               // priorities whose time is up revert to kDefaultPriority

  // ---- the third tier (kv_cache_tier3.cpp) ----
  bool in_tier3(NodeId n) const { return has_t3 && nodes[n].pool == t3; }
  // In the primary or host tier and not being staged: a prompt can share or onboard it (with a
  // third tier; without one every node is).
  bool is_local(NodeId n) const {
    const Node& x = nodes[n];
    return (x.pool == PoolKind::kPrimary || x.pool == PoolKind::kSecondary) && !node_tier3[n].staging;
  }
  const BlockDigest& digest_of(NodeId n) const { return n == root ? root_key : node_digests[n]; }
  // The prompt's leading blocks in the primary or host tier (`local`), then its matchable blocks
  // after them as far as max_blocks: their nodes (kNoNode where not cached) and keys.
  struct Tier3Walk {
    std::vector<NodeId> local;
    std::vector<NodeId> nodes;
    std::vector<BlockDigest> keys;
    std::vector<uint64_t> hashes;  // 64-bit keys of every walked block, local ones first
  };
  Tier3Walk walk_tier3(const SequenceSpec& spec, size_t max_blocks) const;
  void check_no_staging(const char* what) const;

  // ---- prefix lookups (kv_cache_lookup.cpp) ----
  PrefixMatch find_prefix(const SequenceSpec& spec) const;
  // Appends the keys of blocks [hashes.size(), end).
  void extend_hashes(std::vector<uint64_t>& hashes, const TokenId* token_ids, const ExtraId* extra_ids,
                     uint64_t identity, size_t end) const;
  // Blocks add_sequence takes out of num_available() for num_tokens tokens. Drops the match's
  // partial copy when pinning its source would leave too few blocks (those tokens are computed).
  int32_t settle_blocks_to_add(PrefixMatch& match, int32_t num_tokens) const;

  // Why the prompt's full blocks after the match are not shared, one reason each (rules:
  // docs/architecture.md#kv-cache-rules). Called after settle_blocks_to_add, before anything
  // changes; extends match.hashes (and match.plain_hashes) as far as it looks.
  MissReasons classify_misses(const SequenceSpec& spec, PrefixMatch& match) const;
  // Whether a sequence's keys may differ from its plain keys (another identity, or extra ids).
  static bool plain_keys_differ(uint64_t identity, bool has_extra_ids) {
    return identity != kPlainIdentity || has_extra_ids;
  }
  static constexpr uint64_t kPlainIdentity = key_identity(0, 0);

  // ---- sequences (kv_cache_manager.cpp) ----
  int32_t blocks_for(int64_t num_tokens) const {
    return static_cast<int32_t>((num_tokens + tpb - 1) / tpb);
  }
  int32_t num_available() const { return static_cast<int32_t>(primary_free.size()) + num_unheld_primary; }
  void validate_spec(const SequenceSpec& spec) const;
  void take_over_node(NodeId n, BlockId block, const Sequence& seq, SequenceId seq_id, int64_t block_index);
  bool take_over_idle_ancestors(SequenceId seq_id, Sequence& seq, int32_t i);
  Sequence& get(SequenceId id);
  const Sequence& get(SequenceId id) const;
  void store_blocks(SequenceId seq_id, Sequence& seq);
  void prefetch_store(const Sequence& seq, int32_t j) const;
  void release_window(SequenceId seq_id, Sequence& seq);

  CacheConfig config;
  int32_t tpb = 0;
  int32_t key_hash_bits = kFullKeyHashBits;
  NodeId root = kNoNode;  // sentinel node: parent of every first block, never in a block

  std::vector<Node> nodes;                 // [num_primary + num_secondary + num_tier3 + 1 (root)]
  std::vector<NodeId> free_node_ids;
  std::vector<TokenId> node_token_ids;     // [num nodes * tokens_per_block]
  std::vector<ExtraId> node_extra_ids;     // same shape, allocated at the first non-zero extra id
  NodeIndex key_index;                     // block key hash -> nodes
  // partial_key -> nodes, for every child of the root or of a node with two children or more (an
  // only child is found through its parent, so a prompt's own chain costs no index updates).
  NodeIndex partial_index;
  // Keys dropped from either pool and plain keys of nodes stored with another identity, for
  // classify_misses (a bounded memory: key_history.h).
  KeyHistory key_history;

  std::vector<int32_t> primary_refcount;   // [num_primary_blocks]
  std::vector<NodeId> primary_node;        // [num_primary_blocks], kNoNode when unkeyed
  std::vector<BlockId> primary_free;       // stack
  std::vector<NodeId> secondary_node;      // [num_secondary_blocks]
  std::vector<BlockId> secondary_free;     // stack
  // Secondary blocks freed by an onboard since the last take_copy_ops: handed out only when
  // secondary_free is empty, so a step's offloads do not overwrite host blocks its onboards read.
  std::vector<BlockId> secondary_onboarded;
  LruLists lru[kNumPools];                 // by PoolKind
  // The third tier (config.tier3_pool): slots of the disk files, or entries of the remote index.
  bool has_t3 = false;
  PoolKind t3 = PoolKind::kDisk;
  std::vector<NodeTier3> node_tier3;       // [nodes], with a third tier
  std::vector<NodeId> tier3_node;          // [num_tier3_blocks]
  std::vector<BlockId> tier3_free;         // stack
  std::vector<BlockId> tier3_fetched;      // freed by a fetch since the last take_copy_ops (deferred)
  BlockDigest root_key{};                  // root_digest(plan_digest)
  std::vector<BlockDigest> node_digests;   // [nodes], with a third tier: each node's key
  std::vector<BlockDigest> copy_op_keys;   // keys of the third-tier copies in copy_ops, in order
  std::vector<StagedFetch> staging;        // the open staging's fetches (empty: none open)
  // Retention: the manager's clock (set_time) and the priorities due to revert.
  int64_t now_ms = 0;
  bool uses_durations = false;             // some block got a duration: node_clock is kept
  std::vector<NodeClock> node_clock;       // [nodes]
  std::vector<Expiry> expiry_heap;         // min-heap by expires_at_ms
  int32_t num_unheld_primary = 0;          // primary nodes not held: evictable, part of num_available
  int32_t num_used_primary = 0;            // primary blocks with refcount > 0
  uint64_t lru_clock = 0;

  std::unordered_map<SequenceId, Sequence> sequences;
  NodeId scout_walk = kNoNode;             // take_new_primary_blocks' scout: next node to load
  NodeId scout_bucket = kNoNode;           // next node whose index buckets to load
  int32_t scout_steps_left = 0;            // buckets still worth loading (drops to come)
  std::vector<CopyOp> copy_ops;
  // Besides `stats`, what stats() derives the per-tier figures from (the copies themselves are
  // not counted one by one: a full cache offloads a block per block it hands out).
  struct TierCounters {
    int64_t partial_primary_tokens = 0;  // partial copies within the primary pool
    int64_t fetch_tokens = 0;            // third tier -> host, emitted
  } tier_counters;
  std::deque<KvCacheEvent> events;
  int64_t next_event_id = 0;
  CacheStats stats;
};

// Small helpers used by several of the .cpp files, inline in each.

inline void KVCacheManager::Impl::lru_push(NodeId n) {
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
  x.in_lru = true;
  x.lru_stamp = ++lru_clock;
}

inline void KVCacheManager::Impl::lru_remove(NodeId n) {
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
  x.lru_prev = x.lru_next = kNoNode;
  x.in_lru = false;
}

inline void KVCacheManager::Impl::remove_child(NodeId n) {
  Node& x = nodes[n];
  Node& p = nodes[x.parent];
  if (x.prev_sibling != kNoNode) {
    nodes[x.prev_sibling].next_sibling = x.next_sibling;
  } else {
    p.first_child = x.next_sibling;
  }
  if (x.next_sibling != kNoNode) nodes[x.next_sibling].prev_sibling = x.prev_sibling;
  --p.num_children;
  if (x.pool == PoolKind::kPrimary) --p.num_primary_children;
  if (in_tier3(n)) --node_tier3[x.parent].num_tier3_children;
  x.prev_sibling = x.next_sibling = kNoNode;
}

}  // namespace kvtool
