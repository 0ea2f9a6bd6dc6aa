// First, simple implementation of KVCacheManager: allocation, release, block tables and
// mark_computed without reuse. Full reuse / offload semantics follow.
#include "kv_cache_manager.h"

#include <algorithm>
#include <deque>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace kvtool {

void CacheConfig::validate() const {
  if (tokens_per_block <= 0 || (tokens_per_block & (tokens_per_block - 1)) != 0) {
    throw std::invalid_argument("tokens_per_block=" + std::to_string(tokens_per_block) +
                                " is not a power of 2: use 8, 16, 32 or 64");
  }
  if (num_primary_blocks <= 0) {
    throw std::invalid_argument("num_primary_blocks=" + std::to_string(num_primary_blocks) +
                                " leaves no room for KV: give the primary pool at least one block");
  }
  if (num_secondary_blocks < 0) {
    throw std::invalid_argument("num_secondary_blocks=" + std::to_string(num_secondary_blocks) +
                                " is negative: use 0 to disable host offloading");
  }
  if (secondary_offload_min_priority < 0 || secondary_offload_min_priority > 100) {
    throw std::invalid_argument("secondary_offload_min_priority=" +
                                std::to_string(secondary_offload_min_priority) + " is outside 0..100");
  }
  if (max_attention_window < 0) {
    throw std::invalid_argument("max_attention_window=" + std::to_string(max_attention_window) +
                                " is negative: use 0 for full attention");
  }
  if (event_buffer_max_size < 0) {
    throw std::invalid_argument("event_buffer_max_size=" + std::to_string(event_buffer_max_size) +
                                " is negative: use 0 to record no events");
  }
}

struct KVCacheManager::Impl {
  struct Sequence {
    std::vector<TokenId> token_ids;
    std::vector<BlockId> block_ids;
    int32_t num_computed_tokens = 0;
  };

  CacheConfig config;
  std::vector<int32_t> refcounts;
  std::vector<BlockId> free_ids;
  std::unordered_map<SequenceId, Sequence> sequences;
  std::vector<CopyOp> copy_ops;
  std::vector<KvCacheEvent> events;
  CacheStats stats;

  explicit Impl(CacheConfig c) : config(c) {
    config.validate();
    refcounts.assign(config.num_primary_blocks, 0);
    for (BlockId b = config.num_primary_blocks - 1; b >= 0; --b) free_ids.push_back(b);
  }

  int32_t blocks_for(int32_t num_tokens) const {
    return (num_tokens + config.tokens_per_block - 1) / config.tokens_per_block;
  }
  Sequence& get(SequenceId id) {
    auto it = sequences.find(id);
    if (it == sequences.end()) throw UnknownSequenceError("unknown sequence id " + std::to_string(id));
    return it->second;
  }
  const Sequence& get(SequenceId id) const {
    auto it = sequences.find(id);
    if (it == sequences.end()) throw UnknownSequenceError("unknown sequence id " + std::to_string(id));
    return it->second;
  }
  void grow(Sequence& seq, int32_t num_tokens) {
    int32_t need = blocks_for(num_tokens) - static_cast<int32_t>(seq.block_ids.size());
    if (need <= 0) return;
    if (need > static_cast<int32_t>(free_ids.size())) {
      throw OutOfBlocksError("need " + std::to_string(need) + " blocks, " +
                             std::to_string(free_ids.size()) + " available");
    }
    for (int32_t i = 0; i < need; ++i) {
      BlockId b = free_ids.back();
      free_ids.pop_back();
      refcounts[b] = 1;
      seq.block_ids.push_back(b);
    }
    stats.alloc_total_blocks += need;
    stats.alloc_new_blocks += need;
  }
};

KVCacheManager::KVCacheManager(CacheConfig config) : impl_(std::make_unique<Impl>(config)) {}
KVCacheManager::KVCacheManager(CacheConfig config, int32_t) : impl_(std::make_unique<Impl>(config)) {}
KVCacheManager::~KVCacheManager() = default;
KVCacheManager::KVCacheManager(KVCacheManager&&) noexcept = default;
KVCacheManager& KVCacheManager::operator=(KVCacheManager&&) noexcept = default;

const CacheConfig& KVCacheManager::config() const { return impl_->config; }

MatchResult KVCacheManager::match_prefix(const SequenceSpec&) const { return {}; }

int32_t KVCacheManager::num_blocks_to_add(const SequenceSpec&, int32_t num_tokens) const {
  return impl_->blocks_for(num_tokens);
}
int32_t KVCacheManager::num_available_blocks() const {
  return static_cast<int32_t>(impl_->free_ids.size());
}
bool KVCacheManager::can_add_sequence(const SequenceSpec& spec, int32_t num_tokens) const {
  return num_blocks_to_add(spec, num_tokens) <= num_available_blocks();
}

AddSequenceResult KVCacheManager::add_sequence(SequenceId seq_id, const SequenceSpec& spec,
                                               int32_t num_tokens) {
  if (impl_->sequences.count(seq_id)) {
    throw std::invalid_argument("sequence id " + std::to_string(seq_id) + " is already known");
  }
  if (spec.token_ids.empty()) throw std::invalid_argument("token_ids is empty");
  if (num_tokens < 1) throw std::invalid_argument("num_tokens must be >= 1");
  Impl::Sequence seq;
  seq.token_ids = spec.token_ids;
  impl_->grow(seq, num_tokens);
  AddSequenceResult r;
  r.num_new_blocks = static_cast<int32_t>(seq.block_ids.size());
  impl_->stats.missed_blocks += static_cast<int64_t>(spec.token_ids.size()) / impl_->config.tokens_per_block;
  impl_->sequences.emplace(seq_id, std::move(seq));
  return r;
}

bool KVCacheManager::can_allocate(SequenceId seq_id, int32_t num_tokens) const {
  const auto& seq = impl_->get(seq_id);
  int32_t need = impl_->blocks_for(num_tokens) - static_cast<int32_t>(seq.block_ids.size());
  return need <= num_available_blocks();
}
void KVCacheManager::allocate(SequenceId seq_id, int32_t num_tokens) {
  impl_->grow(impl_->get(seq_id), num_tokens);
}
void KVCacheManager::append_tokens(SequenceId seq_id, const std::vector<TokenId>& token_ids) {
  auto& seq = impl_->get(seq_id);
  seq.token_ids.insert(seq.token_ids.end(), token_ids.begin(), token_ids.end());
}
void KVCacheManager::mark_computed(SequenceId seq_id, int32_t num_computed_tokens) {
  impl_->get(seq_id).num_computed_tokens = num_computed_tokens;
}
void KVCacheManager::release(SequenceId seq_id) {
  auto& seq = impl_->get(seq_id);
  for (BlockId b : seq.block_ids) {
    if (b != kNoBlock && --impl_->refcounts[b] == 0) impl_->free_ids.push_back(b);
  }
  impl_->sequences.erase(seq_id);
}
bool KVCacheManager::has_sequence(SequenceId seq_id) const { return impl_->sequences.count(seq_id) > 0; }
int32_t KVCacheManager::num_tokens(SequenceId seq_id) const {
  return static_cast<int32_t>(impl_->get(seq_id).token_ids.size());
}
int32_t KVCacheManager::num_computed_tokens(SequenceId seq_id) const {
  return impl_->get(seq_id).num_computed_tokens;
}
std::vector<BlockId> KVCacheManager::block_ids(SequenceId seq_id) const { return impl_->get(seq_id).block_ids; }
std::vector<CopyOp> KVCacheManager::take_copy_ops() { return std::move(impl_->copy_ops); }
std::vector<KvCacheEvent> KVCacheManager::take_events() { return std::move(impl_->events); }
CacheStats KVCacheManager::stats() const {
  CacheStats s = impl_->stats;
  s.primary.num_blocks = impl_->config.num_primary_blocks;
  s.primary.num_free_blocks = static_cast<int32_t>(impl_->free_ids.size());
  s.primary.num_used_blocks = s.primary.num_blocks - s.primary.num_free_blocks;
  s.secondary.num_blocks = impl_->config.num_secondary_blocks;
  s.secondary.num_free_blocks = impl_->config.num_secondary_blocks;
  return s;
}
void KVCacheManager::reset_stats() { impl_->stats = CacheStats{}; }
std::vector<std::string> KVCacheManager::check_invariants() const { return {}; }

}  // namespace kvtool
