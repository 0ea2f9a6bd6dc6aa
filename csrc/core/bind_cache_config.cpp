// Python bindings of the KV cache's vocabulary and configuration: the pools and event kinds every
// other binding names, and CacheConfig with the C++ defaults.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <string>

#include "bindings.h"
#include "kv_cache_types.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtool {

namespace {

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

void bind_cache_enums(nb::module_& m) {
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
}

void bind_cache_config(nb::module_& m) {
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
}

}  // namespace kvtool
