// Value types shared by the KV cache manager, the scheduler and the Python bindings.
#pragma once

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvtool {

using TokenId = int32_t;
using ExtraId = uint64_t;   // p-tuning style id per input token, 0 for a normal token
using BlockId = int32_t;
using SequenceId = int64_t;

inline constexpr BlockId kNoBlock = -1;       // a block-table slot released by the sliding window
inline constexpr int32_t kDefaultPriority = 35;

// Where a block lives. The third tier is one of kDisk (files private to this engine: the manager
// owns its index) or kRemote (a store shared by engines: the manager's index is only what it
// believes the store holds), chosen by CacheConfig.tier3_pool.
enum class PoolKind : uint8_t { kPrimary = 0, kSecondary = 1, kDisk = 2, kRemote = 3 };
inline constexpr int kNumPools = 4;

// A tier-3 block key: SHA-256 chained over the plan identity and every block of the prefix
// (block_digest.h). Equal keys mean identical KV; the store keeps it with the value to verify.
using BlockDigest = std::array<uint8_t, 32>;

// Retention of a token range (TensorRT-LLM's TokenRangeRetentionConfig): the blocks whose first
// token lies in [token_start, token_end) get `priority`; `duration_ms` after such a block was last
// released it reverts to kDefaultPriority. Docs: docs/architecture.md#kv-cache-rules.
struct RetentionRange {
  int32_t token_start = 0;
  int32_t token_end = -1;      // -1: to the end of the sequence
  int32_t priority = kDefaultPriority;  // 0..100
  int64_t duration_ms = -1;    // -1: never reverts; else > 0
};

// Sizes and switches of the KV cache. Counts are in blocks; bytes are the runtime's business.
struct CacheConfig {
  int32_t tokens_per_block = 32;         // a power of 2
  int32_t num_primary_blocks = 0;        // > 0
  int32_t num_secondary_blocks = 0;      // host tier; 0 disables offloading
  bool enable_block_reuse = true;
  bool enable_partial_reuse = true;
  int32_t secondary_offload_min_priority = kDefaultPriority;  // 0..100
  int32_t max_attention_window = 0;      // 0: every token attends to the whole sequence
  int32_t event_buffer_max_size = 0;     // 0: no KV cache events are recorded
  // The third tier: blocks evicted from the host tier spill there and are staged back into it.
  int32_t num_tier3_blocks = 0;          // disk slots / remote index entries; 0: no third tier
  PoolKind tier3_pool = PoolKind::kDisk; // kDisk or kRemote
  BlockDigest plan_digest{};             // identity of the KV (model, dtype, shapes) in every tier-3 key

  bool has_tier3() const { return num_tier3_blocks > 0; }
  // Throws std::invalid_argument naming the field, what is wrong and the fix.
  void validate() const;
};

// What identifies the blocks of a sequence: its tokens plus everything that changes their KV.
struct SequenceSpec {
  std::vector<TokenId> token_ids;   // the prompt
  std::vector<ExtraId> extra_ids;   // empty, or one per prompt token
  uint64_t lora_task_id = 0;
  uint64_t cache_salt = 0;
  int32_t priority = kDefaultPriority;  // retention priority 0..100 of the blocks this sequence computes
  // Token ranges with their own priority (and duration): sorted, non-overlapping. A block outside
  // every range takes `priority`, without a duration.
  std::vector<RetentionRange> retention;
};

// One block copy for the runtime to execute before the next forward, in emission order. A copy
// into or out of the third tier carries its block's key (in the order of such copies, beside the
// operations); a remote block has no slot (block id kNoBlock): the key names it.
struct CopyOp {
  PoolKind src_pool = PoolKind::kPrimary;
  BlockId src_block_id = kNoBlock;
  PoolKind dst_pool = PoolKind::kPrimary;
  BlockId dst_block_id = kNoBlock;
  int32_t num_tokens = 0;  // tokens from the start of the block; tokens_per_block for a whole block
};

// Result of a side-effect-free prefix lookup.
struct MatchResult {
  int32_t num_matched_tokens = 0;      // prompt tokens whose KV can be taken from the cache
  int32_t num_matched_blocks = 0;      // full blocks that would be shared
  int32_t num_secondary_blocks = 0;    // of those, how many sit in the host tier (need onboarding)
  int32_t num_partial_tokens = 0;      // tokens of a partially matching block (copied, not shared)
};

// Why missed full prompt blocks were not reused: each missed block counts under exactly one
// reason, so the fields sum to the missed blocks (rules: docs/architecture.md#kv-cache-rules).
struct MissReasons {
  int64_t never_seen = 0;       // no block with its key, nor its tokens under another identity, was stored
  int64_t evicted_primary = 0;  // cached, then dropped from the primary pool without an offload
  int64_t evicted_host = 0;     // offloaded, then dropped from the host (secondary) pool
  int64_t identity = 0;         // its tokens were stored under another cache salt / LoRA task id / extra ids
  int64_t partial = 0;          // the block after the shared chain, which got a partial-reuse copy
  int64_t last_token = 0;       // cached, but it holds the prompt's last token, which is always computed
  int64_t reuse_off = 0;        // block reuse is disabled
  // The third tier's reasons (0 without one):
  int64_t evicted_disk = 0;     // spilled to the disk tier, then dropped from it
  int64_t evicted_remote = 0;   // spilled to the remote store, then dropped from the index or gone from the store
  int64_t fetch_failed = 0;     // staging it from the third tier failed (read error, store down, timeout, bad value)
  int64_t not_staged = 0;       // in the third tier, but not staged into the host tier before the request came

  int64_t total() const {
    return never_seen + evicted_primary + evicted_host + identity + partial + last_token + reuse_off + evicted_disk +
           evicted_remote + fetch_failed + not_staged;
  }
  MissReasons& operator+=(const MissReasons& o) {
    never_seen += o.never_seen;
    evicted_primary += o.evicted_primary;
    evicted_host += o.evicted_host;
    identity += o.identity;
    partial += o.partial;
    last_token += o.last_token;
    reuse_off += o.reuse_off;
    evicted_disk += o.evicted_disk;
    evicted_remote += o.evicted_remote;
    fetch_failed += o.fetch_failed;
    not_staged += o.not_staged;
    return *this;
  }
};

// The reasons by name, in declaration order (reports name them so: missed_<name>_blocks). The
// third tier's are listed apart, so that reports without a third tier keep their columns.
struct MissReasonField {
  const char* name;
  int64_t MissReasons::*count;
};
inline constexpr MissReasonField kMissReasonFields[] = {
    {"never_seen", &MissReasons::never_seen}, {"evicted_primary", &MissReasons::evicted_primary},
    {"evicted_host", &MissReasons::evicted_host}, {"identity", &MissReasons::identity},
    {"partial", &MissReasons::partial},         {"last_token", &MissReasons::last_token},
    {"reuse_off", &MissReasons::reuse_off},
};
inline constexpr MissReasonField kTier3MissReasonFields[] = {
    {"evicted_disk", &MissReasons::evicted_disk},
    {"evicted_remote", &MissReasons::evicted_remote},
    {"fetch_failed", &MissReasons::fetch_failed},
    {"not_staged", &MissReasons::not_staged},
};

// What add_sequence did for one sequence.
struct AddSequenceResult {
  int32_t num_reused_tokens = 0;       // prompt tokens not to compute (full blocks + partial copy)
  int32_t num_reused_blocks = 0;       // full blocks shared
  int32_t num_onboarded_blocks = 0;    // of those, brought back from the host tier
  int32_t num_partial_tokens = 0;      // tokens copied from a partially matching block
  int32_t num_early_reused_blocks = 0; // reused blocks whose computing sequence was still running
  int32_t num_new_blocks = 0;          // blocks allocated fresh (including the partial copy target)
  MissReasons missed;                  // the prompt's full blocks not shared, by reason
};

struct PoolStats {
  int32_t num_blocks = 0;
  int32_t num_free_blocks = 0;     // never used since last eviction: hold nothing
  int32_t num_cached_blocks = 0;   // unreferenced but matchable (evictable)
  int32_t num_used_blocks = 0;     // referenced by at least one sequence
};

// What happened in one tier since construction or reset_stats(). Bytes = tokens * bytes per token.
struct TierStats {
  int64_t hit_blocks = 0;      // reused blocks served from this tier (third tier: staged, then reused)
  int64_t stored_blocks = 0;   // blocks that arrived (computed, offloaded, spilled, staged)
  int64_t evicted_blocks = 0;  // blocks dropped from the cache while in this tier
  int64_t num_tokens_in = 0;   // token slots copied into this tier
  int64_t num_tokens_out = 0;  // token slots copied out of it
};

// The third tier's traffic (0 without one).
struct Tier3Stats {
  int64_t spilled_blocks = 0;       // host -> third tier
  int64_t staged_blocks = 0;        // third tier -> host, fetched and confirmed
  int64_t fetch_failed_blocks = 0;  // staged, but the fetch failed (dropped: a miss, never a wrong token)
  int64_t lost_blocks = 0;          // remote: in the index, but the store no longer had them at a lookup
  int64_t discovered_blocks = 0;    // remote: found in the store without being in the index (another engine's)
};

struct CacheStats {
  int64_t reused_blocks = 0;
  int64_t missed_blocks = 0;        // prompt full blocks that had to be computed
  MissReasons missed;               // the same blocks by reason (missed.total() == missed_blocks)
  double cache_hit_rate = 0.0;      // reused / (reused + missed)
  int64_t early_reused_blocks = 0;  // reused while their computing sequence was still running
  int64_t partial_reused_blocks = 0;
  int64_t alloc_total_blocks = 0;   // blocks handed to sequences, reused or new
  int64_t alloc_new_blocks = 0;
  int64_t offloaded_blocks = 0;     // primary -> secondary
  int64_t onboarded_blocks = 0;     // secondary -> primary
  int64_t evicted_blocks = 0;       // dropped from the cache (from either tier)
  int64_t num_offloaded_tokens = 0; // token slots copied each way (bytes = tokens * bytes_per_token)
  int64_t num_onboarded_tokens = 0;
  PoolStats primary;
  PoolStats secondary;
  PoolStats tier3;                  // the disk slots or remote index entries
  TierStats tiers[kNumPools];       // by PoolKind
  Tier3Stats tier3_traffic;
};

// What tier3_lookup found for a prompt (no side effects): the blocks after its cached chain in the
// primary and host tiers that the third tier may hold, for the store to check.
struct Tier3Lookup {
  int32_t num_local_blocks = 0;     // leading prompt blocks in the primary or host tier
  int32_t num_known_blocks = 0;     // of the keys, the leading ones the manager's index holds in the third tier
  std::vector<BlockDigest> keys;    // keys of the matchable prompt blocks after the local ones
};

// What stage_tier3 did.
struct StageResult {
  int32_t num_local_blocks = 0;     // leading prompt blocks already in the primary or host tier
  int32_t num_staged_blocks = 0;    // fetches emitted (third tier -> host), to confirm with complete_staging
  int32_t num_lost_blocks = 0;      // remote index entries dropped: the store no longer holds them
};

enum class KvCacheEventKind : uint8_t { kStored = 0, kRemoved = 1, kOffloaded = 2, kOnboarded = 3 };

struct KvCacheEvent {
  int64_t event_id = 0;
  KvCacheEventKind kind = KvCacheEventKind::kStored;
  uint64_t block_hash = 0;
  uint64_t parent_hash = 0;       // 0 for a block at the root
  std::vector<TokenId> token_ids; // filled for kStored
};

// A sequence id the manager does not know (Python: KeyError naming the id).
class UnknownSequenceError : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

// Not enough primary blocks for a request (Python: RuntimeError with the numbers).
class OutOfBlocksError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace kvtool
