// The KV cache manager: block pools, the prefix index, reuse, LRU eviction and host offload.
// It decides where every block lives and returns copy operations; it never touches KV data.
// Rules: docs/architecture.md#kv-cache-rules
// Errors: std::invalid_argument (bad input), UnknownSequenceError (unknown id),
// OutOfBlocksError (too few blocks; nothing changed).
#pragma once

#include <memory>
#include <vector>

#include "kv_cache_types.h"

namespace kvtool {

class KVCacheManager {
 public:
  explicit KVCacheManager(CacheConfig config);  // validates config
  // Test hook: keep only the low key_hash_bits bits of every block key hash (0..64; 0 makes every
  // key collide), to show that the collision guard never reuses wrong KV.
  KVCacheManager(CacheConfig config, int32_t key_hash_bits);
  static constexpr int32_t kFullKeyHashBits = 64;  // production
  ~KVCacheManager();
  KVCacheManager(KVCacheManager&&) noexcept;
  KVCacheManager& operator=(KVCacheManager&&) noexcept;

  const CacheConfig& config() const;

  // Longest cached chain for spec (no side effects). The last prompt token is never matched.
  // num_partial_tokens is what a partial copy could take; add_sequence may compute them instead.
  MatchResult match_prefix(const SequenceSpec& spec) const;

  // Blocks add_sequence would take out of num_available_blocks() to hold num_tokens tokens
  // (reused blocks that other sequences already hold are not counted).
  int32_t num_blocks_to_add(const SequenceSpec& spec, int32_t num_tokens) const;
  // Primary blocks that can be handed out now without touching a referenced block: free ones plus
  // cached ones that are unreferenced and have no referenced descendant (evictable, leaves first).
  // Only handing blocks out lowers it.
  int32_t num_available_blocks() const;

  bool can_add_sequence(const SequenceSpec& spec, int32_t num_tokens) const;
  // Registers a sequence, shares its longest cached prefix (onboarding host blocks, copying a
  // partially matching block) and allocates blocks for num_tokens (>= 1) tokens.
  // Throws std::invalid_argument for a bad spec or known id, std::runtime_error if blocks lack.
  AddSequenceResult add_sequence(SequenceId seq_id, const SequenceSpec& spec, int32_t num_tokens);
  // Same; takes the token ids over instead of copying them.
  AddSequenceResult add_sequence(SequenceId seq_id, SequenceSpec&& spec, int32_t num_tokens);

  // Makes the sequence's block table cover num_tokens tokens in total (never shrinks it).
  bool can_allocate(SequenceId seq_id, int32_t num_tokens) const;
  void allocate(SequenceId seq_id, int32_t num_tokens);

  // Appends generated tokens, so blocks they fill get keys (reusable by later turns / resume).
  void append_tokens(SequenceId seq_id, const std::vector<TokenId>& token_ids);

  // KV of the first num_computed_tokens tokens is in the cache: full blocks among them become
  // matchable at once (early reuse). With a sliding window, blocks wholly outside it are released.
  // num_computed_tokens never decreases and stays within the known tokens and the block table.
  void mark_computed(SequenceId seq_id, int32_t num_computed_tokens);

  // Drops the sequence's references; its computed full blocks stay matchable until evicted.
  void release(SequenceId seq_id);

  bool has_sequence(SequenceId seq_id) const;
  int32_t num_tokens(SequenceId seq_id) const;           // tokens known (prompt + appended)
  int32_t num_computed_tokens(SequenceId seq_id) const;
  std::vector<BlockId> block_ids(SequenceId seq_id) const;  // primary block table, kNoBlock where released

  // Copy operations emitted since the last call, in the order they must run.
  std::vector<CopyOp> take_copy_ops();
  std::vector<KvCacheEvent> take_events();

  CacheStats stats() const;
  // Zeroes the counters (reuse, allocation, offload, eviction); the cache itself is kept.
  void reset_stats();
  // Empty when every invariant holds; otherwise one message per violation.
  std::vector<std::string> check_invariants() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtool
