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

// Throws std::invalid_argument naming the range: ranges must be sorted and not overlap, each with
// 0 <= token_start < token_end (or -1: to the end), priority 0..100, duration_ms > 0 (or -1).
void validate_retention(const std::vector<RetentionRange>& ranges);

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

  // Copy operations emitted since the last call, in the order they must run; tier3_keys gets the
  // key of each copy into or out of the third tier, in the same order.
  std::vector<CopyOp> take_copy_ops(std::vector<BlockDigest>* tier3_keys = nullptr);
  std::vector<KvCacheEvent> take_events();

  // ---- retention (TensorRT-LLM's KvCacheRetentionConfig) ----
  // The manager's clock in milliseconds (the engine's, or a simulated one): priorities whose
  // duration ran out by now revert to kDefaultPriority. Never decreases (std::invalid_argument).
  void set_time(int64_t now_ms);
  int64_t time() const;

  // ---- the third tier (docs/architecture.md#kv-cache-rules) ----
  // The keys of the prompt's matchable blocks after its cached chain in the primary and host
  // tiers, for the store to check which it holds (no side effects).
  Tier3Lookup tier3_lookup(const SequenceSpec& spec) const;
  // Stages the first num_present blocks of tier3_lookup's keys (those the store holds) into the
  // host tier: each gets a host block and a fetch (third tier -> host) in the copy operations.
  // The staging stays open until complete_staging; meanwhile add_sequence, allocate and
  // mark_computed throw std::logic_error. Disk: only blocks in the manager's index are staged.
  // Remote: index entries past num_present are dropped (the store no longer holds them).
  StageResult stage_tier3(const SequenceSpec& spec, int32_t num_present);
  // The data plane ran the staging's fetches: those into failed_host_blocks (and the chain after
  // the first of them) are dropped, a miss; the others become host blocks like any.
  void complete_staging(const std::vector<BlockId>& failed_host_blocks);
  bool staging_open() const;
  // The third-tier keys of the prompt's full blocks, first block first (needs a third tier).
  std::vector<BlockDigest> tier3_keys(const SequenceSpec& spec) const;

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
