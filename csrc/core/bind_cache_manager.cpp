// Python bindings of the KV cache manager: small, ID-based; token ids in and block tables out as
// numpy arrays. Bad input -> ValueError, unknown sequence -> KeyError, too few blocks -> RuntimeError.
// Its configuration, results, counters and events bind themselves (bind_cache_*.cpp, bind_copy_ops.cpp).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "bindings.h"
#include "kv_cache_manager.h"
#include "numpy_arrays.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtool {

namespace {

using ManagerClass = nb::class_<KVCacheManager>;

// Questions about a prompt that change nothing: what is cached, what adding it would take.
void bind_lookups(ManagerClass& c) {
  c.def(
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
          "Whether add_sequence(..., num_tokens) would find enough blocks.");
}

// A sequence's life: added (sharing its cached prefix), grown, given tokens, computed, released.
void bind_sequences(ManagerClass& c) {
  c.def(
       "add_sequence",
       [](KVCacheManager& self, SequenceId seq_id, IntArrayLike token_ids, int32_t num_tokens,
          IntArrayLike extra_ids, uint64_t lora_task_id, uint64_t cache_salt, int32_t priority,
          std::optional<std::vector<RetentionRange>> retention) {
         return self.add_sequence(
             seq_id,
             to_sequence_spec(token_ids, extra_ids, lora_task_id, cache_salt, priority,
                              retention ? std::move(*retention) : std::vector<RetentionRange>{}),
             num_tokens);
       },
       "seq_id"_a, "token_ids"_a, "num_tokens"_a, nb::kw_only(), "extra_ids"_a = nb::none(),
       "lora_task_id"_a = 0, "cache_salt"_a = 0, "priority"_a = kDefaultPriority, "retention"_a = nb::none(),
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
          "seq_id"_a, "Primary block table as an int32 array; -1 where the sliding window released a block.");
}

// What the manager hands out: the copies to run, its events, its counters and its self-check.
void bind_outputs(ManagerClass& c) {
  c.def(
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

}  // namespace

void bind_cache_manager(nb::module_& m) {
  translate_to_key_error<UnknownSequenceError>();
  ManagerClass c(m, "KVCacheManager",
                 "Block pools, prefix index, reuse, LRU eviction and host offload. Decides where every block "
                 "lives and returns copy operations; never touches KV data.");
  c.def(nb::init<CacheConfig, int32_t>(), "config"_a, nb::kw_only(), "key_hash_bits"_a = KVCacheManager::kFullKeyHashBits,
        "Raises ValueError for a bad config. key_hash_bits < 64 is a test hook that truncates block "
        "key hashes (0: every key collides) to exercise the collision guard.")
      .def_prop_ro("config", &KVCacheManager::config, "The validated configuration (a copy).");
  bind_lookups(c);
  bind_sequences(c);
  bind_outputs(c);
}

}  // namespace kvtool
