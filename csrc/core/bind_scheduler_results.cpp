// Python bindings of what the scheduler returns: a step's ScheduledBatch of ScheduledRequests (token
// ids and block tables as numpy arrays, copies as CopyOpArrays) and a request's RequestStats.
#include "bind_scheduler_results.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"

namespace nb = nanobind;

namespace kvtool {

PyScheduledBatch to_python(ScheduledBatch&& batch) {
  PyScheduledBatch out;
  out.step_id = batch.step_id;
  for (ScheduledRequest& sr : batch.requests) out.requests.append(nb::cast(std::move(sr)));
  out.copy_ops = CopyOpArrays{std::move(batch.copy_ops), std::move(batch.copy_op_keys)};
  out.paused_request_ids = std::move(batch.paused_request_ids);
  out.num_tokens = batch.num_tokens;
  return out;
}

std::optional<DecodeRows> decode_rows(const PyScheduledBatch& batch) {
  std::vector<const ScheduledRequest*> rows;
  size_t max_blocks = 0;
  for (nb::handle item : batch.requests) {
    const auto& request = nb::cast<const ScheduledRequest&>(item);
    if (request.token_ids.size() != 1 || !request.samples) return std::nullopt;
    rows.push_back(&request);
    max_blocks = std::max(max_blocks, request.block_ids.size());
  }
  if (rows.empty()) return std::nullopt;
  const size_t num_rows = rows.size();
  std::vector<int64_t> token_ids(num_rows), positions(num_rows);
  auto* block_tables = new std::vector<int32_t>(num_rows * max_blocks, -1);
  nb::capsule owner(block_tables, [](void* p) noexcept { delete static_cast<std::vector<int32_t>*>(p); });
  for (size_t i = 0; i < num_rows; ++i) {
    token_ids[i] = rows[i]->token_ids[0];
    positions[i] = rows[i]->num_cached_tokens;
    std::copy(rows[i]->block_ids.begin(), rows[i]->block_ids.end(), block_tables->begin() + i * max_blocks);
  }
  return DecodeRows{to_numpy(std::move(token_ids)), to_numpy(std::move(positions)),
                    {block_tables->data(), {num_rows, max_blocks}, owner}};
}

namespace {

const char* state_name(RequestState state) {
  static const char* names[] = {"QUEUED", "CONTEXT", "GENERATION", "PAUSED", "FINISHED"};
  return names[static_cast<int>(state)];
}

void bind_scheduled_request(nb::module_& m) {
  nb::class_<ScheduledRequest>(m, "ScheduledRequest", "One request's share of a step.")
      .def_ro("request_id", &ScheduledRequest::request_id)
      .def_ro("is_context", &ScheduledRequest::is_context,
              "True for a context chunk, False for one generation token.")
      .def_ro("num_cached_tokens", &ScheduledRequest::num_cached_tokens,
              "Tokens whose KV is cached before the step = position of the first new token.")
      .def_prop_ro(
          "token_ids", [](const ScheduledRequest& r) { return to_numpy(std::vector<TokenId>(r.token_ids)); },
          nb::rv_policy::automatic,
          "int32 [num_new_tokens]: the tokens to compute in this step.")
      .def_prop_ro(
          "block_ids", [](const ScheduledRequest& r) { return to_numpy(std::vector<BlockId>(r.block_ids)); },
          nb::rv_policy::automatic,
          "int32 [num_blocks]: primary block table covering num_cached_tokens + len(token_ids) tokens "
          "(-1 where a sliding window released a block).")
      .def_prop_ro("num_tokens", [](const ScheduledRequest& r) { return r.token_ids.size(); },
                   "len(token_ids): tokens computed in this step.")
      .def_ro("samples", &ScheduledRequest::samples,
              "Produces a token this step (last context chunk, or generation).")
      .def("__repr__", [](const ScheduledRequest& r) {
        return "ScheduledRequest(request_id=" + std::to_string(r.request_id) +
               ", is_context=" + (r.is_context ? "True" : "False") +
               ", num_cached_tokens=" + std::to_string(r.num_cached_tokens) +
               ", num_tokens=" + std::to_string(r.token_ids.size()) +
               ", num_blocks=" + std::to_string(r.block_ids.size()) +
               ", samples=" + (r.samples ? "True" : "False") + ")";
      });
}

void bind_scheduled_batch(nb::module_& m) {
  nb::class_<PyScheduledBatch>(m, "ScheduledBatch", "What the runtime executes in one step.")
      .def_ro("step_id", &PyScheduledBatch::step_id)
      .def_ro("requests", &PyScheduledBatch::requests, "list[ScheduledRequest]: context chunks first, then generation.")
      .def_ro("copy_ops", &PyScheduledBatch::copy_ops, nb::rv_policy::reference_internal,
              "CopyOpArrays to run, in order, before the forward (even when requests is empty).")
      .def_ro("paused_request_ids", &PyScheduledBatch::paused_request_ids,
              "list[int]: requests paused this step (MAX_UTILIZATION).")
      .def_ro("num_tokens", &PyScheduledBatch::num_tokens, "Tokens computed in the step.")
      .def("__len__", [](const PyScheduledBatch& p) { return nb::len(p.requests); })
      .def("decode_rows", &decode_rows,
           "DecodeRows of a step whose every request has one new token and samples (a decode step), in the "
           "order of requests; None for any other step.")
      .def("__repr__", [](const PyScheduledBatch& p) {
        return "ScheduledBatch(step_id=" + std::to_string(p.step_id) + ", num_requests=" +
               std::to_string(nb::len(p.requests)) + ", num_tokens=" + std::to_string(p.num_tokens) +
               ", num_copy_ops=" + std::to_string(p.copy_ops.size()) +
               ", num_paused=" + std::to_string(p.paused_request_ids.size()) + ")";
      });
}

void bind_decode_rows(nb::module_& m) {
  nb::class_<DecodeRows>(m, "DecodeRows", "A decode step's rows as the arrays a decode kernel reads.")
      // Properties, not def_ro: an array that owns its data cannot take reference_internal.
      .def_prop_ro("token_ids", [](const DecodeRows& r) { return r.token_ids; }, nb::rv_policy::automatic,
                   "int64 [num_rows]: each row's new token.")
      .def_prop_ro("positions", [](const DecodeRows& r) { return r.positions; }, nb::rv_policy::automatic,
                   "int64 [num_rows]: the tokens each row has cached.")
      .def_prop_ro("block_tables", [](const DecodeRows& r) { return r.block_tables; }, nb::rv_policy::automatic,
                   "int32 [num_rows, max_blocks]: each row's block table, -1 padded.");
}

void bind_request_stats(nb::module_& m) {
  nb::class_<RequestStats>(m, "RequestStats", "Per-request outcome for reports (reuse figures at first admission).")
      .def_ro("request_id", &RequestStats::request_id)
      .def_ro("state", &RequestStats::state)
      .def_ro("num_prompt_tokens", &RequestStats::num_prompt_tokens)
      .def_ro("num_generated_tokens", &RequestStats::num_generated_tokens)
      .def_ro("num_reused_tokens", &RequestStats::num_reused_tokens, "Prompt tokens taken from the cache.")
      .def_ro("num_reused_blocks", &RequestStats::num_reused_blocks, "Full blocks shared.")
      .def_ro("num_onboarded_blocks", &RequestStats::num_onboarded_blocks, "Of those, brought back from host.")
      .def_ro("num_early_reused_blocks", &RequestStats::num_early_reused_blocks,
              "Of those, computed by a request that was still running.")
      .def_ro("missed", &RequestStats::missed, "MissReasons of the full prompt blocks not reused.")
      .def_ro("num_pauses", &RequestStats::num_pauses, "Times paused (MAX_UTILIZATION).")
      .def("__repr__", [](const RequestStats& s) {
        return "RequestStats(request_id=" + std::to_string(s.request_id) + ", state=" + state_name(s.state) +
               ", num_prompt_tokens=" + std::to_string(s.num_prompt_tokens) +
               ", num_generated_tokens=" + std::to_string(s.num_generated_tokens) +
               ", num_reused_tokens=" + std::to_string(s.num_reused_tokens) +
               ", num_reused_blocks=" + std::to_string(s.num_reused_blocks) +
               ", num_onboarded_blocks=" + std::to_string(s.num_onboarded_blocks) +
               ", num_early_reused_blocks=" + std::to_string(s.num_early_reused_blocks) +
               ", num_missed_blocks=" + std::to_string(s.missed.total()) +
               ", num_pauses=" + std::to_string(s.num_pauses) + ")";
      });
}

}  // namespace

void bind_scheduler_results(nb::module_& m) {
  bind_scheduled_request(m);
  bind_decode_rows(m);
  bind_scheduled_batch(m);
  bind_request_stats(m);
}

}  // namespace kvtool
