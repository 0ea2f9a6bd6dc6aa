// Python bindings of the third tier: its statistics, lookups and stagings, added to the
// KVCacheManager class bind_cache_manager made (docs/architecture.md#kv-cache-rules).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "kv_cache_manager.h"
#include "numpy_arrays.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtool {

namespace {

nb::bytes to_bytes(const BlockDigest& d) { return nb::bytes(reinterpret_cast<const char*>(d.data()), d.size()); }

nb::list to_bytes_list(const std::vector<BlockDigest>& keys) {
  nb::list out;
  for (const BlockDigest& k : keys) out.append(to_bytes(k));
  return out;
}

// Adds a method to an already bound class.
template <typename F, typename... Extra>
void add_method(nb::handle cls, const char* name, F&& f, const Extra&... extra) {
  cls.attr(name) = nb::cpp_function(std::forward<F>(f), nb::scope(cls), nb::name(name), nb::is_method(), extra...);
}

}  // namespace

void bind_tiers(nb::module_& m) {
  nb::class_<TierStats>(m, "TierStats", "One tier's counters; bytes = tokens * bytes per token.")
      .def_ro("hit_blocks", &TierStats::hit_blocks,
              "Reused blocks served from this tier (third tier: staged into the host tier, then reused).")
      .def_ro("stored_blocks", &TierStats::stored_blocks, "Blocks that arrived: computed, offloaded, spilled, staged.")
      .def_ro("evicted_blocks", &TierStats::evicted_blocks,
              "Blocks dropped from the cache while in this tier (third tier: failed stagings too).")
      .def_ro("num_tokens_in", &TierStats::num_tokens_in, "Token slots copied into this tier.")
      .def_ro("num_tokens_out", &TierStats::num_tokens_out, "Token slots copied out of this tier.")
      .def("__repr__", [](const TierStats& t) {
        return "TierStats(hit_blocks=" + std::to_string(t.hit_blocks) + ", stored_blocks=" +
               std::to_string(t.stored_blocks) + ", evicted_blocks=" + std::to_string(t.evicted_blocks) +
               ", num_tokens_in=" + std::to_string(t.num_tokens_in) + ", num_tokens_out=" +
               std::to_string(t.num_tokens_out) + ")";
      });

  nb::class_<Tier3Stats>(m, "Tier3Stats", "The third tier's traffic.")
      .def_ro("spilled_blocks", &Tier3Stats::spilled_blocks, "Host tier -> third tier.")
      .def_ro("staged_blocks", &Tier3Stats::staged_blocks, "Third tier -> host tier, fetched and confirmed.")
      .def_ro("fetch_failed_blocks", &Tier3Stats::fetch_failed_blocks,
              "Staged, but the fetch failed (or one before it in the chain did): dropped, a miss.")
      .def_ro("lost_blocks", &Tier3Stats::lost_blocks,
              "Remote: in the manager's index, but the store no longer had them at a lookup.")
      .def_ro("discovered_blocks", &Tier3Stats::discovered_blocks,
              "Remote: staged from the store without being in the index (another engine stored them).");

  nb::class_<Tier3Lookup>(m, "Tier3Lookup", "What tier3_lookup found for a prompt.")
      .def_ro("num_local_blocks", &Tier3Lookup::num_local_blocks,
              "Leading prompt blocks in the primary or host tier (shared or onboarded by add_sequence).")
      .def_ro("num_known_blocks", &Tier3Lookup::num_known_blocks,
              "Of the keys, the leading ones the manager's third-tier index holds (disk: exactly those on disk).")
      .def_prop_ro(
          "keys", [](const Tier3Lookup& l) { return to_bytes_list(l.keys); },
          "list[bytes]: keys of the matchable prompt blocks after the local ones, for the store to check.")
      .def("__repr__", [](const Tier3Lookup& l) {
        return "Tier3Lookup(num_local_blocks=" + std::to_string(l.num_local_blocks) +
               ", num_known_blocks=" + std::to_string(l.num_known_blocks) +
               ", num_keys=" + std::to_string(l.keys.size()) + ")";
      });

  nb::class_<StageResult>(m, "StageResult", "What stage_tier3 did.")
      .def_ro("num_local_blocks", &StageResult::num_local_blocks,
              "Leading prompt blocks already in the primary or host tier.")
      .def_ro("num_staged_blocks", &StageResult::num_staged_blocks,
              "Fetches emitted (third tier -> host): run take_copy_ops, then complete_staging.")
      .def_ro("num_lost_blocks", &StageResult::num_lost_blocks,
              "Remote index entries dropped because the store no longer holds them.")
      .def("__repr__", [](const StageResult& r) {
        return "StageResult(num_local_blocks=" + std::to_string(r.num_local_blocks) +
               ", num_staged_blocks=" + std::to_string(r.num_staged_blocks) +
               ", num_lost_blocks=" + std::to_string(r.num_lost_blocks) + ")";
      });

  nb::handle cls = m.attr("KVCacheManager");
  add_method(
      cls, "tier3_lookup",
      [](const KVCacheManager& self, IntArrayLike token_ids, IntArrayLike extra_ids, uint64_t lora_task_id,
         uint64_t cache_salt) {
        return self.tier3_lookup(to_sequence_spec(token_ids, extra_ids, lora_task_id, cache_salt, kDefaultPriority));
      },
      "token_ids"_a, nb::kw_only(), "extra_ids"_a = nb::none(), "lora_task_id"_a = 0, "cache_salt"_a = 0,
      "The keys of the prompt's matchable blocks after its cached chain in the primary and host tiers, for "
      "the store to check which it holds (no side effects). ValueError without a third tier.");
  add_method(
      cls, "stage_tier3",
      [](KVCacheManager& self, IntArrayLike token_ids, int32_t num_present, IntArrayLike extra_ids,
         uint64_t lora_task_id, uint64_t cache_salt, int32_t priority, std::optional<std::vector<RetentionRange>> retention) {
        return self.stage_tier3(
            to_sequence_spec(token_ids, extra_ids, lora_task_id, cache_salt, priority, retention ? std::move(*retention) : std::vector<RetentionRange>{}),
            num_present);
      },
      "token_ids"_a, "num_present"_a, nb::kw_only(), "extra_ids"_a = nb::none(), "lora_task_id"_a = 0,
      "cache_salt"_a = 0, "priority"_a = kDefaultPriority, "retention"_a = nb::none(),
      "Stages the first num_present blocks of tier3_lookup's keys (those the store holds) into the host tier: "
      "each gets a host block and a fetch in take_copy_ops. The staging stays open until complete_staging "
      "(add_sequence, allocate and mark_computed raise RuntimeError meanwhile). Remote: index entries past "
      "num_present are dropped, the store no longer holds them.");
  add_method(
      cls, "complete_staging",
      [](KVCacheManager& self, IntArrayLike failed_host_block_ids) {
        self.complete_staging(to_vector<BlockId>(failed_host_block_ids, "failed_host_block_ids"));
      },
      "failed_host_block_ids"_a,
      "The staging's fetches ran: those into failed_host_block_ids (and the chain after the first of them) are "
      "dropped, a miss; the others are host blocks like any. ValueError for a block that is no fetch of it.");
  add_method(cls, "staging_open", [](const KVCacheManager& self) { return self.staging_open(); },
             "Whether a staging waits for complete_staging.");
  add_method(
      cls, "tier3_keys",
      [](const KVCacheManager& self, IntArrayLike token_ids, IntArrayLike extra_ids, uint64_t lora_task_id,
         uint64_t cache_salt) {
        return to_bytes_list(
            self.tier3_keys(to_sequence_spec(token_ids, extra_ids, lora_task_id, cache_salt, kDefaultPriority)));
      },
      "token_ids"_a, nb::kw_only(), "extra_ids"_a = nb::none(), "lora_task_id"_a = 0, "cache_salt"_a = 0,
      "list[bytes]: the third-tier key of each full prompt block, first block first (SHA-256 chained from the "
      "plan digest: docs/architecture.md#kv-cache-rules).");
}

}  // namespace kvtool
