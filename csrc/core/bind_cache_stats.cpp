// Python bindings of what the cache reports over time: PoolStats (one pool's occupancy), CacheStats
// (reuse, allocation, offload and eviction since the last reset, with the flat dict reports read)
// and KvCacheEvent (a change of the cached blocks).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <utility>

#include "bindings.h"
#include "kv_cache_types.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtool {

namespace {

// Every counter under one flat name: miss reasons as missed_<reason>_blocks, pool fields prefixed
// primary_ / secondary_.
nb::dict stats_dict(const CacheStats& s, bool tier3) {
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
}

}  // namespace

void bind_cache_stats(nb::module_& m) {
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
      .def("to_dict", &stats_dict, nb::kw_only(), "tier3"_a = false,
           "Flat dict of every counter (miss reasons as missed_<reason>_blocks, the third tier's with "
           "tier3=True; pool fields prefixed primary_/secondary_/tier3_, per-tier ones "
           "primary_/secondary_/disk_/remote_), for reports.");
}

void bind_cache_events(nb::module_& m) {
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
}

}  // namespace kvtool
