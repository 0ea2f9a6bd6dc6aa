// Python bindings of what a prefix lookup and add_sequence report: MatchResult, MissReasons (why
// each full prompt block was not reused) and AddSequenceResult.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstddef>
#include <iterator>
#include <string>

#include "bindings.h"
#include "kv_cache_types.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtool {

namespace {

void bind_match_result(nb::module_& m) {
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
}

void bind_miss_reasons(nb::module_& m) {
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
}

void bind_add_sequence_result(nb::module_& m) {
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
}

}  // namespace

void bind_cache_results(nb::module_& m) {
  bind_match_result(m);
  bind_miss_reasons(m);
  bind_add_sequence_result(m);
}

}  // namespace kvtool
