// Python bindings of the KV cache manager: small, ID-based; token ids in and block tables out as
// numpy arrays. Bad input -> ValueError, unknown sequence -> KeyError, too few blocks -> RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstring>
#include <iterator>
#include <string>

#include "kv_cache_manager.h"
#include "numpy_arrays.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtool {

namespace {

// A read-only numpy view of the field of type T at byte offset `offset` of every copy operation,
// striding over the operations owned by the Python object it is read from.
template <typename T>
nb::ndarray<nb::numpy, const T, nb::ndim<1>> field_view(const CopyOpArrays& a, size_t offset) {
  static_assert(sizeof(CopyOp) % sizeof(T) == 0, "a CopyOp spans whole elements of each field");
  const T* first =
      a.ops.empty() ? nullptr : reinterpret_cast<const T*>(reinterpret_cast<const char*>(a.ops.data()) + offset);
  return nb::ndarray<nb::numpy, const T, nb::ndim<1>>(first, {a.ops.size()}, nb::handle(),
                                                      {static_cast<int64_t>(sizeof(CopyOp) / sizeof(T))});
}

const char* pool_name(PoolKind pool) {
  static const char* const names[] = {"PRIMARY", "SECONDARY", "DISK", "REMOTE"};
  return names[static_cast<int>(pool)];
}

// A 32-byte digest from bytes (b"" is all zero).
BlockDigest to_digest(const nb::bytes& b, const char* name) {
  BlockDigest d{};
  if (b.size() == 0) return d;
  if (b.size() != d.size()) {
    throw std::invalid_argument(std::string(name) + " must be 32 bytes (a SHA-256 digest) or empty; got " +
                                std::to_string(b.size()) + " bytes");
  }
  std::memcpy(d.data(), b.c_str(), d.size());
  return d;
}

}  // namespace

void bind_cache_manager(nb::module_& m) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const UnknownSequenceError& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    }
  });

  nb::enum_<PoolKind>(m, "PoolKind",
                      "Where a block lives: PRIMARY (GPU/CPU pool), SECONDARY (host tier), or the third tier: DISK "
                      "(files of this engine) or REMOTE (a store shared by engines).")
      .value("PRIMARY", PoolKind::kPrimary)
      .value("SECONDARY", PoolKind::kSecondary)
      .value("DISK", PoolKind::kDisk)
      .value("REMOTE", PoolKind::kRemote);

  nb::enum_<KvCacheEventKind>(m, "KvCacheEventKind", "What happened to a cached block.")
      .value("STORED", KvCacheEventKind::kStored)
      .value("REMOVED", KvCacheEventKind::kRemoved)
      .value("OFFLOADED", KvCacheEventKind::kOffloaded)
      .value("ONBOARDED", KvCacheEventKind::kOnboarded);

  constexpr CacheConfig defaults{};  // the binding's defaults are the C++ ones
  nb::class_<CacheConfig>(m, "CacheConfig",
                          "Sizes (in blocks) and switches of the KV cache. Validated by KVCacheManager.")
      .def(
          "__init__",
          [](CacheConfig* self, int32_t tokens_per_block, int32_t num_primary_blocks,
             int32_t num_secondary_blocks, bool enable_block_reuse, bool enable_partial_reuse,
             int32_t secondary_offload_min_priority, int32_t max_attention_window,
             int32_t event_buffer_max_size, int32_t num_tier3_blocks, PoolKind tier3_pool, nb::bytes plan_digest) {
            new (self) CacheConfig{tokens_per_block,      num_primary_blocks,
                                   num_secondary_blocks,  enable_block_reuse,
                                   enable_partial_reuse,  secondary_offload_min_priority,
                                   max_attention_window,  event_buffer_max_size,
                                   num_tier3_blocks,      tier3_pool,
                                   to_digest(plan_digest, "plan_digest")};
          },
          nb::kw_only(), "tokens_per_block"_a = defaults.tokens_per_block,
          "num_primary_blocks"_a = defaults.num_primary_blocks, "num_secondary_blocks"_a = defaults.num_secondary_blocks,
          "enable_block_reuse"_a = defaults.enable_block_reuse, "enable_partial_reuse"_a = defaults.enable_partial_reuse,
          "secondary_offload_min_priority"_a = defaults.secondary_offload_min_priority,
          "max_attention_window"_a = defaults.max_attention_window,
          "event_buffer_max_size"_a = defaults.event_buffer_max_size,
          "num_tier3_blocks"_a = defaults.num_tier3_blocks, "tier3_pool"_a = defaults.tier3_pool,
          "plan_digest"_a = nb::bytes(""))
      .def_rw("tokens_per_block", &CacheConfig::tokens_per_block, "Tokens per block, a power of 2.")
      .def_rw("num_primary_blocks", &CacheConfig::num_primary_blocks, "Blocks of the primary pool (> 0).")
      .def_rw("num_secondary_blocks", &CacheConfig::num_secondary_blocks,
              "Blocks of the host tier; 0 disables offloading.")
      .def_rw("enable_block_reuse", &CacheConfig::enable_block_reuse)
      .def_rw("enable_partial_reuse", &CacheConfig::enable_partial_reuse)
      .def_rw("secondary_offload_min_priority", &CacheConfig::secondary_offload_min_priority,
              "Evicted primary blocks of at least this priority are offloaded, others dropped.")
      .def_rw("max_attention_window", &CacheConfig::max_attention_window,
              "Sliding window in tokens; 0 attends to the whole sequence.")
      .def_rw("event_buffer_max_size", &CacheConfig::event_buffer_max_size,
              "KV cache events kept (oldest dropped); 0 records none.")
      .def_rw("num_tier3_blocks", &CacheConfig::num_tier3_blocks,
              "Blocks of the third tier (disk slots or remote index entries); 0: none. Needs a host tier.")
      .def_rw("tier3_pool", &CacheConfig::tier3_pool, "PoolKind.DISK (private files) or PoolKind.REMOTE (shared store).")
      .def_prop_rw(
          "plan_digest",
          [](const CacheConfig& c) { return nb::bytes(reinterpret_cast<const char*>(c.plan_digest.data()), c.plan_digest.size()); },
          [](CacheConfig& c, nb::bytes b) { c.plan_digest = to_digest(b, "plan_digest"); },
          "32-byte identity of the KV (model, dtype, shapes) in every third-tier key; required for REMOTE.")
      .def("validate", &CacheConfig::validate, "Raises ValueError naming a bad field.")
      .def("__repr__", [](const CacheConfig& c) {
        return "CacheConfig(tokens_per_block=" + std::to_string(c.tokens_per_block) +
               ", num_primary_blocks=" + std::to_string(c.num_primary_blocks) +
               ", num_secondary_blocks=" + std::to_string(c.num_secondary_blocks) +
               ", enable_block_reuse=" + (c.enable_block_reuse ? "True" : "False") +
               ", enable_partial_reuse=" + (c.enable_partial_reuse ? "True" : "False") +
               ", secondary_offload_min_priority=" + std::to_string(c.secondary_offload_min_priority) +
               ", max_attention_window=" + std::to_string(c.max_attention_window) +
               ", event_buffer_max_size=" + std::to_string(c.event_buffer_max_size) + ")";
      });

  nb::class_<CopyOp>(m, "CopyOp", "One block copy the runtime runs before the next forward.")
      .def_ro("src_pool", &CopyOp::src_pool)
      .def_ro("src_block_id", &CopyOp::src_block_id)
      .def_ro("dst_pool", &CopyOp::dst_pool)
      .def_ro("dst_block_id", &CopyOp::dst_block_id)
      .def_ro("num_tokens", &CopyOp::num_tokens, "Tokens from the start of the block.")
      .def("__repr__", [](const CopyOp& op) {
        return std::string("CopyOp(") + pool_name(op.src_pool) + ":" + std::to_string(op.src_block_id) +
               " -> " + pool_name(op.dst_pool) + ":" + std::to_string(op.dst_block_id) +
               ", num_tokens=" + std::to_string(op.num_tokens) + ")";
      });

  nb::class_<CopyOpArrays>(
      m, "CopyOpArrays",
      "Copy operations as a struct of 1-D numpy arrays; index i of each array is operation i, in "
      "the order the operations must run. Pools are PoolKind values (0 primary, 1 secondary).")
      .def_prop_ro(
          "src_pool",
          [](const CopyOpArrays& a) { return field_view<uint8_t>(a, offsetof(CopyOp, src_pool)); },
          nb::rv_policy::reference_internal, "uint8 [num_ops]")
      .def_prop_ro(
          "src_block_ids", [](const CopyOpArrays& a) { return field_view<int32_t>(a, offsetof(CopyOp, src_block_id)); },
          nb::rv_policy::reference_internal, "int32 [num_ops]")
      .def_prop_ro(
          "dst_pool",
          [](const CopyOpArrays& a) { return field_view<uint8_t>(a, offsetof(CopyOp, dst_pool)); },
          nb::rv_policy::reference_internal, "uint8 [num_ops]")
      .def_prop_ro(
          "dst_block_ids", [](const CopyOpArrays& a) { return field_view<int32_t>(a, offsetof(CopyOp, dst_block_id)); },
          nb::rv_policy::reference_internal, "int32 [num_ops]")
      .def_prop_ro(
          "num_tokens", [](const CopyOpArrays& a) { return field_view<int32_t>(a, offsetof(CopyOp, num_tokens)); },
          nb::rv_policy::reference_internal, "int32 [num_ops]: tokens from the start of each block")
      .def_prop_ro(
          "tier3_keys",
          [](const CopyOpArrays& a) {
            nb::list keys;
            for (const BlockDigest& k : a.tier3_keys) keys.append(nb::bytes(reinterpret_cast<const char*>(k.data()), k.size()));
            return keys;
          },
          "list[bytes]: the 32-byte key of each operation into or out of the third tier (DISK / REMOTE), in "
          "operation order.")
      .def("__len__", [](const CopyOpArrays& a) { return a.size(); })
      .def(
          "to_list", [](const CopyOpArrays& a) { return a.ops; },
          "The operations as a list of CopyOp (for tests and debugging).");

  nb::class_<MatchResult>(m, "MatchResult", "A side-effect-free prefix lookup.")
      .def_ro("num_matched_tokens", &MatchResult::num_matched_tokens,
              "Prompt tokens whose KV can be taken from the cache (full blocks + partial copy).")
      .def_ro("num_matched_blocks", &MatchResult::num_matched_blocks, "Full blocks that would be shared.")
      .def_ro("num_secondary_blocks", &MatchResult::num_secondary_blocks,
              "Of those, blocks in the host tier (would be onboarded).")
      .def_ro("num_partial_tokens", &MatchResult::num_partial_tokens,
              "Tokens of a partially matching block (copied, not shared). add_sequence computes them "
              "instead when the copy's evictable source would leave too few blocks.")
      .def("__repr__", [](const MatchResult& r) {
        return "MatchResult(num_matched_tokens=" + std::to_string(r.num_matched_tokens) +
               ", num_matched_blocks=" + std::to_string(r.num_matched_blocks) +
               ", num_secondary_blocks=" + std::to_string(r.num_secondary_blocks) +
               ", num_partial_tokens=" + std::to_string(r.num_partial_tokens) + ")";
      });

  nb::class_<MissReasons> miss_reasons(
      m, "MissReasons",
      "Missed full prompt blocks by reason. Each missed block counts under exactly one reason, so the "
      "fields sum to total (rules: docs/architecture.md#kv-cache-rules).");
  const char* const miss_reason_docs[] = {
      "No block with its key, nor its tokens under another identity, was ever stored (as far as the "
      "manager remembers: at least the last 2 x (primary + secondary blocks) keys dropped or stored).",
      "Cached, then dropped from the primary pool without an offload (no host tier, host tier full with "
      "nothing evictable, or priority below secondary_offload_min_priority).",
      "Offloaded, then dropped from the host (secondary) tier.",
      "The same tokens (from the prompt's start) were stored under another cache salt, LoRA task id or "
      "extra ids.",
      "The block after the shared chain, which got a partial-reuse copy of its first tokens.",
      "Cached, but it holds the prompt's last token, which is always computed (a prompt of whole blocks).",
      "Block reuse is disabled: every full prompt block.",
  };
  static_assert(std::size(kMissReasonFields) == std::size(miss_reason_docs), "one docstring per reason");
  for (size_t k = 0; k < std::size(kMissReasonFields); ++k) {
    miss_reasons.def_ro(kMissReasonFields[k].name, kMissReasonFields[k].count, miss_reason_docs[k]);
  }
  const char* const tier3_miss_reason_docs[] = {
      "Spilled to the disk tier, then dropped from it.",
      "Spilled to the remote store, then dropped from the manager's index or gone from the store.",
      "Staging it from the third tier failed (read error, store down or slow, a value that does not verify).",
      "In the third tier, but not staged into the host tier before the request was added.",
  };
  static_assert(std::size(kTier3MissReasonFields) == std::size(tier3_miss_reason_docs), "one docstring per reason");
  for (size_t k = 0; k < std::size(kTier3MissReasonFields); ++k) {
    miss_reasons.def_ro(kTier3MissReasonFields[k].name, kTier3MissReasonFields[k].count, tier3_miss_reason_docs[k]);
  }
  miss_reasons.def(nb::init<>(), "Every count 0.")
      .def_prop_ro("total", &MissReasons::total, "Missed blocks, every reason.")
      .def(
          "to_dict",
          [](const MissReasons& r, bool tier3) {
            nb::dict d;
            for (const auto& field : kMissReasonFields) d[field.name] = r.*field.count;
            for (const auto& field : kTier3MissReasonFields) {
              if (tier3) d[field.name] = r.*field.count;
            }
            return d;
          },
          nb::kw_only(), "tier3"_a = false,
          "{reason: blocks}, every reason in declaration order; the third tier's too with tier3=True.")
      .def("__eq__",
           [](const MissReasons& a, const MissReasons& b) {
             for (const auto& field : kMissReasonFields) {
               if (a.*field.count != b.*field.count) return false;
             }
             for (const auto& field : kTier3MissReasonFields) {
               if (a.*field.count != b.*field.count) return false;
             }
             return true;
           }, nb::is_operator())
      .def("__repr__", [](const MissReasons& r) {
        std::string out = "MissReasons(";
        for (const auto& field : kMissReasonFields) {
          if (out.back() != '(') out += ", ";
          out += std::string(field.name) + "=" + std::to_string(r.*field.count);
        }
        for (const auto& field : kTier3MissReasonFields) {  // shown only when a third tier missed some
          if (r.*field.count != 0) out += ", " + std::string(field.name) + "=" + std::to_string(r.*field.count);
        }
        return out + ")";
      });

  nb::class_<AddSequenceResult>(m, "AddSequenceResult", "What add_sequence did for one sequence.")
      .def_ro("num_reused_tokens", &AddSequenceResult::num_reused_tokens,
              "Prompt tokens not to compute (shared full blocks + partial copy).")
      .def_ro("num_reused_blocks", &AddSequenceResult::num_reused_blocks, "Full blocks shared.")
      .def_ro("num_onboarded_blocks", &AddSequenceResult::num_onboarded_blocks,
              "Of the shared blocks, those brought back from the host tier.")
      .def_ro("num_partial_tokens", &AddSequenceResult::num_partial_tokens,
              "Tokens copied from a partially matching block.")
      .def_ro("num_early_reused_blocks", &AddSequenceResult::num_early_reused_blocks,
              "Shared blocks whose computing sequence was still running.")
      .def_ro("num_new_blocks", &AddSequenceResult::num_new_blocks,
              "Blocks allocated fresh (including the partial copy target).")
      .def_ro("missed", &AddSequenceResult::missed,
              "MissReasons of the prompt's full blocks not shared (decided before this call evicted anything).")
      .def("__repr__", [](const AddSequenceResult& r) {
        return "AddSequenceResult(num_reused_tokens=" + std::to_string(r.num_reused_tokens) +
               ", num_reused_blocks=" + std::to_string(r.num_reused_blocks) +
               ", num_onboarded_blocks=" + std::to_string(r.num_onboarded_blocks) +
               ", num_partial_tokens=" + std::to_string(r.num_partial_tokens) +
               ", num_early_reused_blocks=" + std::to_string(r.num_early_reused_blocks) +
               ", num_new_blocks=" + std::to_string(r.num_new_blocks) +
               ", num_missed_blocks=" + std::to_string(r.missed.total()) + ")";
      });

  nb::class_<PoolStats>(m, "PoolStats", "Block counts of one pool; free + cached + used = num_blocks.")
      .def_ro("num_blocks", &PoolStats::num_blocks)
      .def_ro("num_free_blocks", &PoolStats::num_free_blocks, "Hold nothing.")
      .def_ro("num_cached_blocks", &PoolStats::num_cached_blocks, "Unreferenced but matchable (evictable).")
      .def_ro("num_used_blocks", &PoolStats::num_used_blocks, "Referenced by at least one sequence.")
      .def("__repr__", [](const PoolStats& s) {
        return "PoolStats(num_blocks=" + std::to_string(s.num_blocks) +
               ", num_free_blocks=" + std::to_string(s.num_free_blocks) +
               ", num_cached_blocks=" + std::to_string(s.num_cached_blocks) +
               ", num_used_blocks=" + std::to_string(s.num_used_blocks) + ")";
      });

  nb::class_<CacheStats>(m, "CacheStats", "Counters since construction or reset_stats(), and pool occupancy.")
      .def_ro("reused_blocks", &CacheStats::reused_blocks)
      .def_ro("missed_blocks", &CacheStats::missed_blocks, "Prompt full blocks that had to be computed.")
      .def_ro("missed", &CacheStats::missed, "The missed blocks by reason (MissReasons; total == missed_blocks).")
      .def_ro("cache_hit_rate", &CacheStats::cache_hit_rate, "reused / (reused + missed); 0 when both are 0.")
      .def_ro("early_reused_blocks", &CacheStats::early_reused_blocks,
              "Reused while their computing sequence was still running.")
      .def_ro("partial_reused_blocks", &CacheStats::partial_reused_blocks)
      .def_ro("alloc_total_blocks", &CacheStats::alloc_total_blocks, "Blocks handed to sequences, reused or new.")
      .def_ro("alloc_new_blocks", &CacheStats::alloc_new_blocks)
      .def_ro("offloaded_blocks", &CacheStats::offloaded_blocks, "Primary -> secondary.")
      .def_ro("onboarded_blocks", &CacheStats::onboarded_blocks, "Secondary -> primary.")
      .def_ro("evicted_blocks", &CacheStats::evicted_blocks, "Dropped from the cache (either tier).")
      .def_ro("num_offloaded_tokens", &CacheStats::num_offloaded_tokens,
              "Token slots copied primary -> secondary (bytes = tokens * bytes per token).")
      .def_ro("num_onboarded_tokens", &CacheStats::num_onboarded_tokens,
              "Token slots copied secondary -> primary.")
      .def_ro("primary", &CacheStats::primary)
      .def_ro("secondary", &CacheStats::secondary)
      .def_ro("tier3", &CacheStats::tier3, "The third tier's slots (disk) or index entries (remote).")
      .def_ro("tier3_traffic", &CacheStats::tier3_traffic, "Spills, stagings and failures of the third tier.")
      .def(
          "tier", [](const CacheStats& s, PoolKind pool) { return s.tiers[static_cast<int>(pool)]; }, "pool"_a,
          "TierStats of one tier: hits, arrivals, evictions, token slots copied in and out.")
      .def(
          "to_dict",
          [](const CacheStats& s, bool tier3) {
            nb::dict d;
            d["reused_blocks"] = s.reused_blocks;
            d["missed_blocks"] = s.missed_blocks;
            for (const auto& field : kMissReasonFields) {
              d[("missed_" + std::string(field.name) + "_blocks").c_str()] = s.missed.*field.count;
            }
            for (const auto& field : kTier3MissReasonFields) {
              if (tier3) d[("missed_" + std::string(field.name) + "_blocks").c_str()] = s.missed.*field.count;
            }
            d["cache_hit_rate"] = s.cache_hit_rate;
            d["early_reused_blocks"] = s.early_reused_blocks;
            d["partial_reused_blocks"] = s.partial_reused_blocks;
            d["alloc_total_blocks"] = s.alloc_total_blocks;
            d["alloc_new_blocks"] = s.alloc_new_blocks;
            d["offloaded_blocks"] = s.offloaded_blocks;
            d["onboarded_blocks"] = s.onboarded_blocks;
            d["evicted_blocks"] = s.evicted_blocks;
            d["num_offloaded_tokens"] = s.num_offloaded_tokens;
            d["num_onboarded_tokens"] = s.num_onboarded_tokens;
            for (const auto& [prefix, pool] : {std::pair<const char*, const PoolStats*>{"primary", &s.primary},
                                               {"secondary", &s.secondary}}) {
              const std::string p(prefix);
              d[(p + "_num_blocks").c_str()] = pool->num_blocks;
              d[(p + "_num_free_blocks").c_str()] = pool->num_free_blocks;
              d[(p + "_num_cached_blocks").c_str()] = pool->num_cached_blocks;
              d[(p + "_num_used_blocks").c_str()] = pool->num_used_blocks;
            }
            d["tier3_num_blocks"] = s.tier3.num_blocks;
            d["tier3_num_free_blocks"] = s.tier3.num_free_blocks;
            d["tier3_num_cached_blocks"] = s.tier3.num_cached_blocks;
            for (int pool = 0; pool < kNumPools; ++pool) {
              const std::string p = pool == 0 ? "primary" : pool == 1 ? "secondary" : pool == 2 ? "disk" : "remote";
              const TierStats& t = s.tiers[pool];
              d[(p + "_hit_blocks").c_str()] = t.hit_blocks;
              d[(p + "_stored_blocks").c_str()] = t.stored_blocks;
              d[(p + "_evicted_blocks").c_str()] = t.evicted_blocks;
              d[(p + "_num_tokens_in").c_str()] = t.num_tokens_in;
              d[(p + "_num_tokens_out").c_str()] = t.num_tokens_out;
            }
            d["spilled_blocks"] = s.tier3_traffic.spilled_blocks;
            d["staged_blocks"] = s.tier3_traffic.staged_blocks;
            d["fetch_failed_blocks"] = s.tier3_traffic.fetch_failed_blocks;
            d["lost_blocks"] = s.tier3_traffic.lost_blocks;
            d["discovered_blocks"] = s.tier3_traffic.discovered_blocks;
            return d;
          },
          nb::kw_only(), "tier3"_a = false,
          "Flat dict of every counter (miss reasons as missed_<reason>_blocks, the third tier's with "
          "tier3=True; pool fields prefixed primary_/secondary_/tier3_, per-tier ones "
          "primary_/secondary_/disk_/remote_), for reports.");

  nb::class_<KvCacheEvent>(m, "KvCacheEvent", "A change of the cached blocks (for KV-aware routers).")
      .def_ro("event_id", &KvCacheEvent::event_id)
      .def_ro("kind", &KvCacheEvent::kind)
      .def_ro("block_hash", &KvCacheEvent::block_hash)
      .def_ro("parent_hash", &KvCacheEvent::parent_hash, "0 for a block at the root.")
      .def_ro("token_ids", &KvCacheEvent::token_ids, "The block's tokens (STORED events only).")
      .def("__repr__", [](const KvCacheEvent& e) {
        static const char* names[] = {"STORED", "REMOVED", "OFFLOADED", "ONBOARDED"};
        return "KvCacheEvent(event_id=" + std::to_string(e.event_id) + ", kind=" +
               names[static_cast<int>(e.kind)] + ", block_hash=" + std::to_string(e.block_hash) +
               ", parent_hash=" + std::to_string(e.parent_hash) + ")";
      });

  nb::class_<KVCacheManager>(
      m, "KVCacheManager",
      "Block pools, prefix index, reuse, LRU eviction and host offload. Decides where every block "
      "lives and returns copy operations; never touches KV data.")
      .def(nb::init<CacheConfig, int32_t>(), "config"_a, nb::kw_only(), "key_hash_bits"_a = KVCacheManager::kFullKeyHashBits,
           "Raises ValueError for a bad config. key_hash_bits < 64 is a test hook that truncates block "
           "key hashes (0: every key collides) to exercise the collision guard.")
      .def_prop_ro("config", &KVCacheManager::config, "The validated configuration (a copy).")
      .def(
          "match_prefix",
          [](const KVCacheManager& self, IntArrayLike token_ids, IntArrayLike extra_ids, uint64_t lora_task_id,
             uint64_t cache_salt) {
            return self.match_prefix(to_sequence_spec(token_ids, extra_ids, lora_task_id, cache_salt, kDefaultPriority));
          },
          "token_ids"_a, nb::kw_only(), "extra_ids"_a = nb::none(), "lora_task_id"_a = 0, "cache_salt"_a = 0,
          "Longest cached chain for this prompt, without side effects. The last prompt token is never matched.")
      .def(
          "num_blocks_to_add",
          [](const KVCacheManager& self, IntArrayLike token_ids, int32_t num_tokens, IntArrayLike extra_ids,
             uint64_t lora_task_id, uint64_t cache_salt) {
            return self.num_blocks_to_add(
                to_sequence_spec(token_ids, extra_ids, lora_task_id, cache_salt, kDefaultPriority), num_tokens);
          },
          "token_ids"_a, "num_tokens"_a, nb::kw_only(), "extra_ids"_a = nb::none(), "lora_task_id"_a = 0,
          "cache_salt"_a = 0,
          "Primary blocks add_sequence would take out of num_available_blocks() for num_tokens tokens.")
      .def("num_available_blocks", &KVCacheManager::num_available_blocks,
           "Primary blocks that can be handed out now: free plus evictable cached ones.")
      .def(
          "can_add_sequence",
          [](const KVCacheManager& self, IntArrayLike token_ids, int32_t num_tokens, IntArrayLike extra_ids,
             uint64_t lora_task_id, uint64_t cache_salt) {
            return self.can_add_sequence(
                to_sequence_spec(token_ids, extra_ids, lora_task_id, cache_salt, kDefaultPriority), num_tokens);
          },
          "token_ids"_a, "num_tokens"_a, nb::kw_only(), "extra_ids"_a = nb::none(), "lora_task_id"_a = 0,
          "cache_salt"_a = 0,
          "Whether add_sequence(..., num_tokens) would find enough blocks.")
      .def(
          "add_sequence",
          [](KVCacheManager& self, SequenceId seq_id, IntArrayLike token_ids, int32_t num_tokens,
             IntArrayLike extra_ids, uint64_t lora_task_id, uint64_t cache_salt, int32_t priority,
             std::optional<std::vector<RetentionRange>> retention) {
            return self.add_sequence(
                seq_id, to_sequence_spec(token_ids, extra_ids, lora_task_id, cache_salt, priority, retention ? std::move(*retention) : std::vector<RetentionRange>{}),
                num_tokens);
          },
          "seq_id"_a, "token_ids"_a, "num_tokens"_a, nb::kw_only(), "extra_ids"_a = nb::none(),
          "lora_task_id"_a = 0, "cache_salt"_a = 0, "priority"_a = kDefaultPriority,
          "retention"_a = nb::none(),
          "Registers a sequence with prompt token_ids (1-D int32 array or list; extra_ids: one uint64 "
          "per token or None), shares its longest cached prefix (onboarding host blocks, copying a "
          "partially matching block) and allocates blocks to hold num_tokens (>= 1) tokens. "
          "priority (0..100) is the retention priority of the blocks it computes, retention (RetentionRange "
          "list) that of token ranges, shared blocks included. Raises ValueError "
          "for bad input or a known seq_id, RuntimeError when blocks lack (nothing changes then).")
      .def("can_allocate", &KVCacheManager::can_allocate, "seq_id"_a, "num_tokens"_a,
           "Whether allocate(seq_id, num_tokens) would find enough blocks. KeyError for an unknown id.")
      .def("allocate", &KVCacheManager::allocate, "seq_id"_a, "num_tokens"_a,
           "Grows the block table to hold num_tokens tokens in total. RuntimeError when blocks lack.")
      .def(
          "append_tokens",
          [](KVCacheManager& self, SequenceId seq_id, IntArrayLike token_ids) {
            self.append_tokens(seq_id, to_vector<TokenId>(token_ids, "token_ids"));
          },
          "seq_id"_a, "token_ids"_a,
          "Appends generated tokens (extra id 0), so blocks they fill become reusable once computed.")
      .def("mark_computed", &KVCacheManager::mark_computed, "seq_id"_a, "num_computed_tokens"_a,
           "KV of the first num_computed_tokens tokens is written: full blocks among them become "
           "matchable at once; with a sliding window, blocks wholly outside it are released.")
      .def("release", &KVCacheManager::release, "seq_id"_a,
           "Drops the sequence; its computed full blocks stay matchable until evicted.")
      .def("has_sequence", &KVCacheManager::has_sequence, "seq_id"_a)
      .def("num_tokens", &KVCacheManager::num_tokens, "seq_id"_a, "Tokens known: prompt + appended.")
      .def("num_computed_tokens", &KVCacheManager::num_computed_tokens, "seq_id"_a)
      .def(
          "block_ids",
          [](const KVCacheManager& self, SequenceId seq_id) { return to_numpy(self.block_ids(seq_id)); },
          "seq_id"_a, "Primary block table as an int32 array; -1 where the sliding window released a block.")
      .def(
          "take_copy_ops",
          [](KVCacheManager& self) {
            CopyOpArrays out;
            out.ops = self.take_copy_ops(&out.tier3_keys);
            return out;
          },
          "Copy operations emitted since the last call, as CopyOpArrays, in the order they must run.")
      .def("take_events", &KVCacheManager::take_events, "KV cache events recorded since the last call.")
      .def("stats", &KVCacheManager::stats, "Counters and pool occupancy.")
      .def("reset_stats", &KVCacheManager::reset_stats, "Zeroes the counters; the cache is kept.")
      .def("check_invariants", &KVCacheManager::check_invariants,
           "Empty list when every invariant holds; otherwise one message per violation.");
}

}  // namespace kvtool
