// KVCacheManager: sequences, allocation, storing computed blocks (early reuse) and the sliding
// window. Prefix lookups: kv_cache_lookup.cpp; the tree and pools: kv_cache_blocks.cpp;
// eviction and offload: kv_cache_eviction.cpp.
#include "kv_cache_manager.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kv_cache_manager_impl.h"

namespace kvtool {

namespace {
std::string str(int64_t v) { return std::to_string(v); }
}  // namespace

void CacheConfig::validate() const {
  if (tokens_per_block <= 0 || (tokens_per_block & (tokens_per_block - 1)) != 0) {
    throw std::invalid_argument("tokens_per_block=" + str(tokens_per_block) +
                                " is not a power of 2: use 8, 16, 32 or 64");
  }
  if (num_primary_blocks <= 0) {
    throw std::invalid_argument("num_primary_blocks=" + str(num_primary_blocks) +
                                " leaves no room for KV: give the primary pool at least one block");
  }
  if (num_secondary_blocks < 0) {
    throw std::invalid_argument("num_secondary_blocks=" + str(num_secondary_blocks) +
                                " is negative: use 0 to disable host offloading");
  }
  if (secondary_offload_min_priority < 0 || secondary_offload_min_priority > 100) {
    throw std::invalid_argument("secondary_offload_min_priority=" + str(secondary_offload_min_priority) +
                                " is outside 0..100");
  }
  if (max_attention_window < 0) {
    throw std::invalid_argument("max_attention_window=" + str(max_attention_window) +
                                " is negative: use 0 for full attention");
  }
  if (event_buffer_max_size < 0) {
    throw std::invalid_argument("event_buffer_max_size=" + str(event_buffer_max_size) +
                                " is negative: use 0 to record no events");
  }
  if (num_tier3_blocks < 0) {
    throw std::invalid_argument("num_tier3_blocks=" + str(num_tier3_blocks) +
                                " is negative: use 0 for no third tier");
  }
  if (tier3_pool != PoolKind::kDisk && tier3_pool != PoolKind::kRemote) {
    throw std::invalid_argument("tier3_pool=" + str(static_cast<int>(tier3_pool)) +
                                " is not a third tier: use PoolKind.DISK or PoolKind.REMOTE");
  }
  if (num_tier3_blocks > 0 && num_secondary_blocks == 0) {
    throw std::invalid_argument("num_tier3_blocks=" + str(num_tier3_blocks) +
                                " needs a host tier: the third tier spills from it and stages into it; "
                                "give num_secondary_blocks > 0");
  }
  // A store shared by engines must tell plans apart: without an identity two models would read
  // each other's blocks.
  bool plan_digest_set = false;
  for (uint8_t b : plan_digest) plan_digest_set = plan_digest_set || b != 0;
  if (num_tier3_blocks > 0 && tier3_pool == PoolKind::kRemote && !plan_digest_set) {
    throw std::invalid_argument(
        "plan_digest is all zero: a remote tier keys blocks by the plan's identity; give the digest of the "
        "model, dtype and KV shapes (kvtool.runtime.tier3_store.plan_digest)");
  }
}

// ---------------------------------------------------------------------------------------------
// Impl: sequences

KVCacheManager::Impl::Sequence& KVCacheManager::Impl::get(SequenceId id) {
  auto it = sequences.find(id);
  if (it == sequences.end()) throw UnknownSequenceError("unknown sequence id " + str(id));
  return it->second;
}

const KVCacheManager::Impl::Sequence& KVCacheManager::Impl::get(SequenceId id) const {
  auto it = sequences.find(id);
  if (it == sequences.end()) throw UnknownSequenceError("unknown sequence id " + str(id));
  return it->second;
}

void KVCacheManager::Impl::validate_spec(const SequenceSpec& spec) const {
  if (spec.token_ids.empty()) throw std::invalid_argument("token_ids is empty: a prompt needs at least one token");
  if (!spec.extra_ids.empty() && spec.extra_ids.size() != spec.token_ids.size()) {
    throw std::invalid_argument("extra_ids has " + str(static_cast<int64_t>(spec.extra_ids.size())) +
                                " values for " + str(static_cast<int64_t>(spec.token_ids.size())) +
                                " token ids: give one per token (0 for a normal token) or none");
  }
  if (spec.priority < 0 || spec.priority > 100) {
    throw std::invalid_argument("priority=" + str(spec.priority) + " is outside 0..100");
  }
  validate_retention(spec.retention);
}

// Moves the unreferenced primary node n into block, a block of seq_id holding the same KV (its
// duplicate computation); n's old block becomes free. The node keeps its identity, children and
// generation; the sequence now holds it, so it counts as computed by that sequence.
void KVCacheManager::Impl::take_over_node(NodeId n, BlockId block, const Sequence& seq, SequenceId seq_id,
                                          int64_t block_index) {
  Node& x = nodes[n];
  lru_remove(n);
  primary_node[x.block_id] = kNoNode;
  primary_free.push_back(x.block_id);
  x.block_id = block;
  primary_node[block] = n;
  set_retention(n, block_retention(seq.retention, seq.priority, block_index));
  x.owner = seq_id;
  x.owner_running = true;
  on_referenced(n);
}

// Block i is about to be stored below the sequence's chain: the idle ancestors move into the
// sequence's duplicates of them, so that the new child pins no unreferenced node (rules:
// docs/architecture.md#kv-cache-rules). False, changing nothing, when the window released one.
bool KVCacheManager::Impl::take_over_idle_ancestors(SequenceId seq_id, Sequence& seq, int32_t i) {
  int32_t num_idle = 0;
  for (NodeId c = seq.last_node; c != root && primary_refcount[nodes[c].block_id] == 0 && !is_held(c);
       c = nodes[c].parent) {
    const BlockId own = seq.block_ids[i - 1 - num_idle];
    if (own == kNoBlock || primary_node[own] != kNoNode) return false;
    ++num_idle;
  }
  NodeId c = seq.last_node;
  for (int32_t k = 0; k < num_idle; ++k) {
    const NodeId up = nodes[c].parent;
    take_over_node(c, seq.block_ids[i - 1 - k], seq, seq_id, i - 1 - k);
    c = up;
  }
  return true;
}

// The index buckets that storing block j of seq writes.
void KVCacheManager::Impl::prefetch_store(const Sequence& seq, int32_t j) const {
  key_index.prefetch_for_write(seq.block_hashes[j]);
  // Only the first block of a batch can hang below a node with children (the root, a shared
  // prefix): the others follow a block stored just before them, as only children.
  if (config.enable_partial_reuse && j == seq.num_stored_blocks) {
    const uint64_t parent_hash = j == 0 ? 0 : seq.block_hashes[j - 1];
    partial_index.prefetch_for_write(partial_key(parent_hash, seq.token_ids[static_cast<size_t>(j) * tpb], seq.identity));
  }
}

// Gives keys to the sequence's newly computed full blocks (early reuse); a block whose key is
// cached takes the node over, or stays a duplicate while others reference the cached copy.
void KVCacheManager::Impl::store_blocks(SequenceId seq_id, Sequence& seq) {
  const int32_t num_full = seq.num_computed_tokens / tpb;
  if (seq.num_stored_blocks >= num_full || seq.chain_broken) return;
  if (seq.block_hashes.size() < static_cast<size_t>(num_full)) {
    extend_hashes(seq.block_hashes, seq.token_ids.data(), seq.extra_ids.empty() ? nullptr : seq.extra_ids.data(),
                  seq.identity, num_full);
  }
  const bool plain_differs = plain_keys_differ(seq.identity, !seq.extra_ids.empty());
  if (plain_differs && seq.plain_hashes.size() < static_cast<size_t>(num_full)) {
    extend_hashes(seq.plain_hashes, seq.token_ids.data(), nullptr, kPlainIdentity, num_full);
  }
  // Index buckets are loaded kPrefetchDistance blocks ahead of their insert, so the cache misses
  // overlap (without it the manager is about 1.3x slower: results/cache_manager.md).
  constexpr int32_t kPrefetchDistance = 12;
  for (int32_t j = seq.num_stored_blocks; j < std::min(num_full, seq.num_stored_blocks + kPrefetchDistance); ++j) {
    prefetch_store(seq, j);
  }
  while (seq.num_stored_blocks < num_full && !seq.chain_broken) {
    const int32_t i = seq.num_stored_blocks;
    if (i + kPrefetchDistance < num_full) prefetch_store(seq, i + kPrefetchDistance);
    const NodeId parent = i == 0 ? root : seq.last_node;
    const BlockId block = seq.block_ids[i];
    if (i > 0 && (!nodes[parent].live || nodes[parent].generation != seq.last_node_generation ||
                  nodes[parent].pool != PoolKind::kPrimary)) {
      seq.chain_broken = true;  // the parent was evicted or offloaded after the window let it go
      break;
    }
    if (block == kNoBlock) {
      seq.chain_broken = true;
      break;
    }
    if (i > 0 && !take_over_idle_ancestors(seq_id, seq, i)) {
      seq.chain_broken = true;  // an idle ancestor's duplicate was released by the window
      break;
    }
    const TokenId* t = seq.token_ids.data() + static_cast<size_t>(i) * tpb;
    const ExtraId* e = seq.extra_ids.empty() ? nullptr : seq.extra_ids.data() + static_cast<size_t>(i) * tpb;
    const uint64_t h = seq.block_hashes[i];
    // A parent without children (one this loop just stored, typically) has no match to find.
    NodeId n = nodes[parent].num_children == 0 ? kNoNode : find_child(parent, h, t, e, seq.lora_task_id, seq.cache_salt);
    if (n == kNoNode) {
      n = store_node(parent, h, t, e, seq, seq_id, block, block_retention(seq.retention, seq.priority, i));
      // These tokens under another identity: remembered by their plain key (classify_misses).
      if (plain_differs && seq.plain_hashes[i] != h) {
        key_history.update(seq.plain_hashes[i], KeyHistory::kStoredPlain);
      }
    } else if (nodes[n].pool != PoolKind::kPrimary) {  // the host tier or the third
      move_to_primary(n, block);
      set_retention(n, block_retention(seq.retention, seq.priority, i));
      nodes[n].owner = seq_id;
      nodes[n].owner_running = true;
      emit_event(KvCacheEventKind::kOnboarded, n, false);
    } else if (primary_refcount[nodes[n].block_id] == 0) {
      take_over_node(n, block, seq, seq_id, i);  // frees the cached copy's block: nothing is pinned
    }
    seq.last_node = n;
    seq.last_node_generation = nodes[n].generation;
    ++seq.num_stored_blocks;
  }
}

// Blocks wholly before (num_computed_tokens - window) leave the sequence's table.
void KVCacheManager::Impl::release_window(SequenceId seq_id, Sequence& seq) {
  if (config.max_attention_window <= 0) return;
  const int64_t limit = static_cast<int64_t>(seq.num_computed_tokens) - config.max_attention_window;
  if (limit <= 0) return;
  const int32_t end = std::min<int32_t>(static_cast<int32_t>(limit / tpb), static_cast<int32_t>(seq.block_ids.size()));
  for (int32_t i = end; i-- > seq.num_window_released;) {
    const BlockId b = seq.block_ids[i];
    if (b == kNoBlock) continue;
    seq.block_ids[i] = kNoBlock;
    unref_block(b, seq_id);
  }
  seq.num_window_released = std::max(seq.num_window_released, end);
}

// ---------------------------------------------------------------------------------------------
// Public interface

KVCacheManager::KVCacheManager(CacheConfig config) : impl_(std::make_unique<Impl>(config, kFullKeyHashBits)) {}
KVCacheManager::KVCacheManager(CacheConfig config, int32_t key_hash_bits)
    : impl_(std::make_unique<Impl>(config, key_hash_bits)) {}
KVCacheManager::~KVCacheManager() = default;
KVCacheManager::KVCacheManager(KVCacheManager&&) noexcept = default;
KVCacheManager& KVCacheManager::operator=(KVCacheManager&&) noexcept = default;

const CacheConfig& KVCacheManager::config() const { return impl_->config; }

MatchResult KVCacheManager::match_prefix(const SequenceSpec& spec) const {
  impl_->validate_spec(spec);
  const Impl::PrefixMatch match = impl_->find_prefix(spec);
  MatchResult r;
  r.num_matched_blocks = static_cast<int32_t>(match.nodes.size());
  r.num_secondary_blocks = match.num_secondary;
  r.num_partial_tokens = match.num_partial_tokens;
  r.num_matched_tokens = r.num_matched_blocks * impl_->tpb + r.num_partial_tokens;
  return r;
}

int32_t KVCacheManager::num_blocks_to_add(const SequenceSpec& spec, int32_t num_tokens) const {
  impl_->validate_spec(spec);
  Impl::PrefixMatch match = impl_->find_prefix(spec);
  return impl_->settle_blocks_to_add(match, num_tokens);
}

int32_t KVCacheManager::num_available_blocks() const { return impl_->num_available(); }

bool KVCacheManager::can_add_sequence(const SequenceSpec& spec, int32_t num_tokens) const {
  return num_blocks_to_add(spec, num_tokens) <= num_available_blocks();
}

AddSequenceResult KVCacheManager::add_sequence(SequenceId seq_id, const SequenceSpec& spec, int32_t num_tokens) {
  return add_sequence(seq_id, SequenceSpec(spec), num_tokens);
}

AddSequenceResult KVCacheManager::add_sequence(SequenceId seq_id, SequenceSpec&& spec, int32_t num_tokens) {
  Impl& m = *impl_;
  m.check_no_staging("add_sequence");
  if (m.sequences.count(seq_id)) {
    throw std::invalid_argument("sequence id " + str(seq_id) + " is already known: release it first or use a new id");
  }
  m.validate_spec(spec);
  if (num_tokens < 1) throw std::invalid_argument("num_tokens=" + str(num_tokens) + " must be >= 1");
  Impl::PrefixMatch match = m.find_prefix(spec);
  const int32_t needed = m.settle_blocks_to_add(match, num_tokens);
  if (needed > m.num_available()) {
    throw OutOfBlocksError("sequence " + str(seq_id) + " needs " + str(needed) + " more KV cache blocks for " +
                           str(num_tokens) + " tokens but only " + str(m.num_available()) + " of " +
                           str(m.config.num_primary_blocks) + " are available");
  }
  // Before the allocations below evict anything: the reasons describe the cache the prompt met.
  m.key_history.flush();
  const MissReasons missed = m.classify_misses(spec, match);

  const int64_t num_prompt_blocks = static_cast<int64_t>(spec.token_ids.size()) / m.tpb;
  Impl::Sequence seq;
  seq.token_ids = std::move(spec.token_ids);
  seq.block_hashes = std::move(match.hashes);
  seq.plain_hashes = std::move(match.plain_hashes);
  if (any_extra(spec.extra_ids.empty() ? nullptr : spec.extra_ids.data(), spec.extra_ids.size())) {
    seq.extra_ids = spec.extra_ids;
  }
  seq.lora_task_id = spec.lora_task_id;
  seq.cache_salt = spec.cache_salt;
  seq.identity = key_identity(spec.lora_task_id, spec.cache_salt);
  seq.priority = spec.priority;
  seq.retention = std::move(spec.retention);

  // Pin what this sequence is about to read so the allocations below cannot evict it.
  for (NodeId n : match.nodes) {
    if (m.nodes[n].pool == PoolKind::kSecondary) m.nodes[n].pinned = true;
  }
  if (match.partial_source != kNoNode) m.nodes[match.partial_source].pinned = true;
  // Share the primary blocks first: referenced, they are out of the eviction candidates.
  seq.block_ids.reserve(std::max<int32_t>(m.blocks_for(num_tokens), static_cast<int32_t>(match.nodes.size()) + 1));
  for (NodeId n : match.nodes) {
    if (m.nodes[n].pool == PoolKind::kPrimary) {
      m.ref_block(m.nodes[n].block_id);
    } else if (m.has_t3 && m.node_tier3[n].from_tier3) {
      ++m.stats.tiers[static_cast<int>(m.t3)].hit_blocks;  // staged from the third tier for this
    }
  }
  // Then onboard host blocks in chain order (a parent is primary before its child arrives).
  for (NodeId n : match.nodes) {
    Impl::Node& x = m.nodes[n];
    if (x.pool == PoolKind::kSecondary) {
      const BlockId dst = m.take_new_primary_block();
      m.emit_copy(PoolKind::kSecondary, x.block_id, PoolKind::kPrimary, dst, m.tpb);
      m.move_to_primary(n, dst);
      ++m.stats.onboarded_blocks;
      m.stats.num_onboarded_tokens += m.tpb;
      m.emit_event(KvCacheEventKind::kOnboarded, n, false);
    }
    seq.block_ids.push_back(x.block_id);
  }
  // A range of this sequence covering a shared block gives it its priority (as TensorRT-LLM's
  // reuse does); blocks outside its ranges keep theirs.
  for (size_t i = 0; i < match.nodes.size() && !seq.retention.empty(); ++i) {
    const Impl::BlockRetention r = m.block_retention(seq.retention, seq.priority, static_cast<int64_t>(i));
    if (r.in_range) m.set_retention(match.nodes[i], r);
  }
  if (match.partial_source != kNoNode) {
    const BlockId dst = m.take_new_primary_block();
    Impl::Node& src = m.nodes[match.partial_source];
    m.emit_copy(src.pool, src.block_id, PoolKind::kPrimary, dst, match.num_partial_tokens);
    if (src.pool == PoolKind::kSecondary) {
      m.stats.num_onboarded_tokens += match.num_partial_tokens;
    } else {
      m.tier_counters.partial_primary_tokens += match.num_partial_tokens;
    }
    src.pinned = false;
    seq.block_ids.push_back(dst);
    ++m.stats.partial_reused_blocks;
  }
  const int32_t total = std::max(m.blocks_for(num_tokens), static_cast<int32_t>(seq.block_ids.size()));
  m.take_new_primary_blocks(total - static_cast<int32_t>(seq.block_ids.size()), seq.block_ids);

  AddSequenceResult r;
  r.num_reused_blocks = static_cast<int32_t>(match.nodes.size());
  r.num_onboarded_blocks = match.num_secondary;
  r.num_partial_tokens = match.num_partial_tokens;
  r.num_reused_tokens = r.num_reused_blocks * m.tpb + r.num_partial_tokens;
  r.num_early_reused_blocks = match.num_early;
  r.num_new_blocks = total - r.num_reused_blocks;
  r.missed = missed;

  m.stats.reused_blocks += r.num_reused_blocks;
  m.stats.missed_blocks += num_prompt_blocks - r.num_reused_blocks;
  m.stats.missed += missed;
  m.stats.early_reused_blocks += r.num_early_reused_blocks;
  m.stats.alloc_total_blocks += total;
  m.stats.alloc_new_blocks += r.num_new_blocks;

  seq.num_computed_tokens = r.num_reused_tokens;
  seq.num_stored_blocks = r.num_reused_blocks;
  seq.last_node = match.nodes.empty() ? m.root : match.nodes.back();
  seq.last_node_generation = m.nodes[seq.last_node].generation;
  auto& stored = m.sequences.emplace(seq_id, std::move(seq)).first->second;
  m.release_window(seq_id, stored);
  return r;
}

bool KVCacheManager::can_allocate(SequenceId seq_id, int32_t num_tokens) const {
  const auto& seq = impl_->get(seq_id);
  const int32_t need = impl_->blocks_for(num_tokens) - static_cast<int32_t>(seq.block_ids.size());
  return need <= impl_->num_available();
}

void KVCacheManager::allocate(SequenceId seq_id, int32_t num_tokens) {
  Impl& m = *impl_;
  m.check_no_staging("allocate");
  auto& seq = m.get(seq_id);
  const int32_t need = m.blocks_for(num_tokens) - static_cast<int32_t>(seq.block_ids.size());
  if (need <= 0) return;
  if (need > m.num_available()) {
    throw OutOfBlocksError("sequence " + str(seq_id) + " needs " + str(need) + " more KV cache blocks to hold " +
                           str(num_tokens) + " tokens but only " + str(m.num_available()) + " of " +
                           str(m.config.num_primary_blocks) + " are available");
  }
  m.take_new_primary_blocks(need, seq.block_ids);
  m.stats.alloc_total_blocks += need;
  m.stats.alloc_new_blocks += need;
}

void KVCacheManager::append_tokens(SequenceId seq_id, const std::vector<TokenId>& token_ids) {
  auto& seq = impl_->get(seq_id);
  seq.token_ids.insert(seq.token_ids.end(), token_ids.begin(), token_ids.end());
  if (!seq.extra_ids.empty()) seq.extra_ids.resize(seq.token_ids.size(), 0);  // generated tokens: 0
}

void KVCacheManager::mark_computed(SequenceId seq_id, int32_t num_computed_tokens) {
  Impl& m = *impl_;
  m.check_no_staging("mark_computed");
  auto& seq = m.get(seq_id);
  if (num_computed_tokens < seq.num_computed_tokens) {
    throw std::invalid_argument("num_computed_tokens=" + str(num_computed_tokens) + " for sequence " + str(seq_id) +
                                " is below the " + str(seq.num_computed_tokens) + " already computed");
  }
  if (num_computed_tokens > static_cast<int32_t>(seq.token_ids.size())) {
    throw std::invalid_argument("num_computed_tokens=" + str(num_computed_tokens) + " for sequence " + str(seq_id) +
                                " exceeds its " + str(static_cast<int64_t>(seq.token_ids.size())) +
                                " known tokens: append_tokens first");
  }
  if (num_computed_tokens > static_cast<int64_t>(seq.block_ids.size()) * m.tpb) {
    throw std::invalid_argument("num_computed_tokens=" + str(num_computed_tokens) + " for sequence " + str(seq_id) +
                                " exceeds its " + str(static_cast<int64_t>(seq.block_ids.size()) * m.tpb) +
                                " allocated token slots: allocate first");
  }
  seq.num_computed_tokens = num_computed_tokens;
  if (m.config.enable_block_reuse) m.store_blocks(seq_id, seq);
  m.release_window(seq_id, seq);
}

void KVCacheManager::release(SequenceId seq_id) {
  Impl& m = *impl_;
  auto& seq = m.get(seq_id);
  // Last block first: the chain's leaf becomes the least recently used of the sequence's blocks.
  for (size_t i = seq.block_ids.size(); i-- > 0;) {
    if (seq.block_ids[i] != kNoBlock) m.unref_block(seq.block_ids[i], seq_id);
  }
  m.sequences.erase(seq_id);
}

bool KVCacheManager::has_sequence(SequenceId seq_id) const { return impl_->sequences.count(seq_id) > 0; }

int32_t KVCacheManager::num_tokens(SequenceId seq_id) const {
  return static_cast<int32_t>(impl_->get(seq_id).token_ids.size());
}

int32_t KVCacheManager::num_computed_tokens(SequenceId seq_id) const {
  return impl_->get(seq_id).num_computed_tokens;
}

std::vector<BlockId> KVCacheManager::block_ids(SequenceId seq_id) const { return impl_->get(seq_id).block_ids; }

std::vector<CopyOp> KVCacheManager::take_copy_ops(std::vector<BlockDigest>* tier3_keys) {
  Impl& m = *impl_;
  std::vector<CopyOp> out(m.copy_ops);  // the manager keeps its buffer's capacity
  m.copy_ops.clear();
  if (tier3_keys != nullptr) tier3_keys->assign(m.copy_op_keys.begin(), m.copy_op_keys.end());
  m.copy_op_keys.clear();
  // The onboards are handed over: the blocks they read may be overwritten by later steps' copies.
  std::vector<BlockId>& onboarded = m.secondary_onboarded;
  m.secondary_free.insert(m.secondary_free.end(), onboarded.begin(), onboarded.end());
  onboarded.clear();
  m.tier3_free.insert(m.tier3_free.end(), m.tier3_fetched.begin(), m.tier3_fetched.end());
  m.tier3_fetched.clear();
  return out;
}

std::vector<KvCacheEvent> KVCacheManager::take_events() {
  std::vector<KvCacheEvent> out(std::make_move_iterator(impl_->events.begin()),
                                std::make_move_iterator(impl_->events.end()));
  impl_->events.clear();
  return out;
}

void KVCacheManager::reset_stats() {
  impl_->stats = CacheStats{};
  impl_->tier_counters = Impl::TierCounters{};
}

}  // namespace kvtool
