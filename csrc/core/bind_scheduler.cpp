// Python bindings of the scheduler: token ids in and block tables out as numpy arrays; a step batch's
// copy operations as the same CopyOpArrays the cache manager returns. Bad input -> ValueError,
// unknown request id -> KeyError, calls out of order (schedule twice) -> RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "numpy_arrays.h"
#include "scheduler.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtool {

namespace {

// The PromptSummary of a list or tuple of exact ints, read where it lies: a pre-check of a 2k-token
// prompt builds no vector of its ids. False when it is something else, or an item is not an exact
// int that fits int32 (the caller converts as add_request does, and reports what is wrong).
bool summarize_int_sequence(PyObject* sequence, int32_t vocab_size, PromptSummary& summary) {
  const bool is_list = PyList_CheckExact(sequence);
  if (!is_list && !PyTuple_CheckExact(sequence)) return false;
  const Py_ssize_t n = is_list ? PyList_GET_SIZE(sequence) : PyTuple_GET_SIZE(sequence);
  summary.num_tokens = static_cast<int64_t>(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = is_list ? PyList_GET_ITEM(sequence, i) : PyTuple_GET_ITEM(sequence, i);
    long long value = 0;
    if (!exact_int_value(item, value) || value < INT32_MIN || value > INT32_MAX) return false;
    if (vocab_size > 0 && !summary.first_outside_vocab && (value < 0 || value >= vocab_size)) {
      summary.first_outside_vocab = static_cast<TokenId>(value);
    }
  }
  return true;
}


// A ScheduledBatch as Python sees it: converted once, so repeated attribute reads copy nothing.
struct PyScheduledBatch {
  int64_t step_id = 0;
  nb::list requests;                        // ScheduledRequest, context chunks first
  CopyOpArrays copy_ops;                    // run these, in order, before the forward
  std::vector<int64_t> paused_request_ids;  // paused this step (MAX_UTILIZATION)
  int32_t num_tokens = 0;                   // tokens computed in the step
};

PyScheduledBatch to_python(ScheduledBatch&& batch) {
  PyScheduledBatch out;
  out.step_id = batch.step_id;
  for (ScheduledRequest& sr : batch.requests) out.requests.append(nb::cast(std::move(sr)));
  out.copy_ops = CopyOpArrays{std::move(batch.copy_ops), std::move(batch.copy_op_keys)};
  out.paused_request_ids = std::move(batch.paused_request_ids);
  out.num_tokens = batch.num_tokens;
  return out;
}

// A 1-D array (any integer dtype) or list of request ids.
std::vector<int64_t> to_request_ids(nb::handle obj) {
  using Array = nb::ndarray<const int64_t, nb::ndim<1>, nb::device::cpu>;
  Array array;
  if (nb::try_cast(obj, array, /*convert=*/false) || nb::try_cast(obj, array, /*convert=*/true)) {
    std::vector<int64_t> out(array.shape(0));
    for (size_t i = 0; i < out.size(); ++i) out[i] = array.data()[static_cast<int64_t>(i) * array.stride(0)];
    return out;
  }
  std::vector<int64_t> out;
  if (nb::try_cast(obj, out, /*convert=*/true)) return out;
  throw std::invalid_argument("request_ids must be a 1-D numpy int64 array or a list of ints; got " +
                              nb::cast<std::string>(nb::repr(nb::type_name(obj.type()))));
}

const char* state_name(RequestState state) {
  static const char* names[] = {"QUEUED", "CONTEXT", "GENERATION", "PAUSED", "FINISHED"};
  return names[static_cast<int>(state)];
}

}  // namespace

void bind_scheduler(nb::module_& m) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const UnknownRequestError& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    }
  });

  nb::enum_<CapacitySchedulerPolicy>(m, "CapacitySchedulerPolicy",
                                     "How many requests hold KV cache blocks (TensorRT-LLM's names).")
      .value("GUARANTEED_NO_EVICT", CapacitySchedulerPolicy::kGuaranteedNoEvict,
             "Admit only if the whole lifetime fits beside every running request; never pause.")
      .value("MAX_UTILIZATION", CapacitySchedulerPolicy::kMaxUtilization,
             "Admit while the next step fits; pause the most recently started request when blocks lack.")
      .value("STATIC_BATCH", CapacitySchedulerPolicy::kStaticBatch,
             "Admit a new batch only when no request is running.");

  nb::enum_<ContextChunkingPolicy>(m, "ContextChunkingPolicy", "Which context advances first when chunked.")
      .value("FIRST_COME_FIRST_SERVED", ContextChunkingPolicy::kFirstComeFirstServed,
             "The oldest context takes as much of the token budget as it can.")
      .value("EQUAL_PROGRESS", ContextChunkingPolicy::kEqualProgress,
             "Every context advances one block before any advances a second.");

  nb::enum_<RequestState>(m, "RequestState", "QUEUED -> CONTEXT -> GENERATION -> FINISHED; PAUSED re-queued.")
      .value("QUEUED", RequestState::kQueued)
      .value("CONTEXT", RequestState::kContext)
      .value("GENERATION", RequestState::kGeneration)
      .value("PAUSED", RequestState::kPaused)
      .value("FINISHED", RequestState::kFinished);

  constexpr SchedulerConfig defaults{};  // the binding's defaults are the C++ ones
  nb::class_<SchedulerConfig>(m, "SchedulerConfig", "Capacity policy, context chunking and per-step limits.")
      .def(
          "__init__",
          [](SchedulerConfig* self, CapacitySchedulerPolicy capacity_scheduler_policy,
             ContextChunkingPolicy context_chunking_policy, bool enable_chunked_context, int32_t max_batch_size,
             int32_t max_num_tokens, int32_t max_seq_len, bool enable_in_batch_prefix_reuse, int32_t vocab_size) {
            new (self) SchedulerConfig{capacity_scheduler_policy, context_chunking_policy, enable_chunked_context,
                                       max_batch_size,           max_num_tokens,          max_seq_len,
                                       enable_in_batch_prefix_reuse, vocab_size};
          },
          nb::kw_only(), "capacity_scheduler_policy"_a = defaults.capacity_scheduler_policy,
          "context_chunking_policy"_a = defaults.context_chunking_policy,
          "enable_chunked_context"_a = defaults.enable_chunked_context, "max_batch_size"_a = defaults.max_batch_size,
          "max_num_tokens"_a = defaults.max_num_tokens, "max_seq_len"_a = defaults.max_seq_len,
          "enable_in_batch_prefix_reuse"_a = defaults.enable_in_batch_prefix_reuse, "vocab_size"_a = defaults.vocab_size)
      .def_rw("capacity_scheduler_policy", &SchedulerConfig::capacity_scheduler_policy)
      .def_rw("context_chunking_policy", &SchedulerConfig::context_chunking_policy)
      .def_rw("enable_chunked_context", &SchedulerConfig::enable_chunked_context)
      .def_rw("max_batch_size", &SchedulerConfig::max_batch_size, "Requests per step.")
      .def_rw("max_num_tokens", &SchedulerConfig::max_num_tokens,
              "Tokens per step: context-chunk tokens + one per generating request.")
      .def_rw("max_seq_len", &SchedulerConfig::max_seq_len, "Prompt + generated tokens of one request.")
      .def_rw("enable_in_batch_prefix_reuse", &SchedulerConfig::enable_in_batch_prefix_reuse,
              "Hold a queued request back while a running context computes prompt blocks it could reuse.")
      .def_rw("vocab_size", &SchedulerConfig::vocab_size,
              "> 0: add_request refuses a prompt token id outside [0, vocab_size); 0: ids are not checked.")
      .def("validate", &SchedulerConfig::validate, "Raises ValueError naming a bad field.")
      .def("__repr__", [](const SchedulerConfig& c) {
        static const char* policies[] = {"GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH"};
        static const char* chunking[] = {"FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS"};
        return std::string("SchedulerConfig(capacity_scheduler_policy=") +
               policies[static_cast<int>(c.capacity_scheduler_policy)] +
               ", context_chunking_policy=" + chunking[static_cast<int>(c.context_chunking_policy)] +
               ", enable_chunked_context=" + (c.enable_chunked_context ? "True" : "False") +
               ", max_batch_size=" + std::to_string(c.max_batch_size) +
               ", max_num_tokens=" + std::to_string(c.max_num_tokens) +
               ", max_seq_len=" + std::to_string(c.max_seq_len) +
               ", enable_in_batch_prefix_reuse=" + (c.enable_in_batch_prefix_reuse ? "True" : "False") +
               ", vocab_size=" + std::to_string(c.vocab_size) + ")";
      });

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

  nb::class_<PyScheduledBatch>(m, "ScheduledBatch", "What the runtime executes in one step.")
      .def_ro("step_id", &PyScheduledBatch::step_id)
      .def_ro("requests", &PyScheduledBatch::requests, "list[ScheduledRequest]: context chunks first, then generation.")
      .def_ro("copy_ops", &PyScheduledBatch::copy_ops, nb::rv_policy::reference_internal,
              "CopyOpArrays to run, in order, before the forward (even when requests is empty).")
      .def_ro("paused_request_ids", &PyScheduledBatch::paused_request_ids,
              "list[int]: requests paused this step (MAX_UTILIZATION).")
      .def_ro("num_tokens", &PyScheduledBatch::num_tokens, "Tokens computed in the step.")
      .def("__len__", [](const PyScheduledBatch& p) { return nb::len(p.requests); })
      .def("__repr__", [](const PyScheduledBatch& p) {
        return "ScheduledBatch(step_id=" + std::to_string(p.step_id) + ", num_requests=" +
               std::to_string(nb::len(p.requests)) + ", num_tokens=" + std::to_string(p.num_tokens) +
               ", num_copy_ops=" + std::to_string(p.copy_ops.size()) +
               ", num_paused=" + std::to_string(p.paused_request_ids.size()) + ")";
      });

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

  nb::class_<Scheduler>(m, "Scheduler",
                        "Request states, capacity policy, micro-batch limits and chunked context over a "
                        "KV cache manager it owns. Each step: schedule() -> run the batch -> complete_step().")
      .def(nb::init<CacheConfig, SchedulerConfig>(), "cache_config"_a, "scheduler_config"_a,
           "Raises ValueError for a bad configuration.")
      .def(
          "add_request",
          [](Scheduler& self, int64_t request_id, IntArrayLike token_ids, int32_t max_new_tokens,
             IntArrayLike extra_ids,
             uint64_t lora_task_id, uint64_t cache_salt, int32_t priority, std::optional<std::vector<RetentionRange>> retention) {
            self.add_request(request_id,
                             to_sequence_spec(token_ids, extra_ids, lora_task_id, cache_salt, priority, retention ? std::move(*retention) : std::vector<RetentionRange>{}),
                             max_new_tokens);
          },
          "request_id"_a, "token_ids"_a, "max_new_tokens"_a, nb::kw_only(), "extra_ids"_a = nb::none(),
          "lora_task_id"_a = 0, "cache_salt"_a = 0, "priority"_a = kDefaultPriority,
          "retention"_a = nb::none(),
          "Queues a request: prompt token_ids (1-D int32 array or list), extra_ids (one uint64 per prompt "
          "token, 0 for a normal token, or None), retention priority 0..100 and token ranges with their own "
          "(RetentionRange list). Raises ValueError naming the "
          "request for an empty prompt, a token id outside [0, vocab_size), prompt + max_new_tokens > max_seq_len, a prompt longer than "
          "max_num_tokens without chunked context, a request larger than the primary pool, wrong "
          "extra_ids length or a known id.")
      .def(
          "request_problem",
          [](const Scheduler& self, IntArrayLike token_ids, int32_t max_new_tokens, IntArrayLike extra_ids,
             int32_t priority) {
            const int32_t vocab_size = self.config().vocab_size;
            PromptSummary summary;
            if (!summarize_int_sequence(token_ids.ptr(), vocab_size, summary)) {
              SequenceSpec prompt;
              prompt.token_ids = to_vector<TokenId>(token_ids, "token_ids");
              summary = summarize_prompt(prompt, vocab_size);
            }
            summary.num_extra_ids = extra_ids.is_none()
                                        ? 0
                                        : static_cast<int64_t>(to_vector<ExtraId>(extra_ids, "extra_ids").size());
            summary.priority = priority;
            return self.request_problem(summary, max_new_tokens);
          },
          "token_ids"_a, "max_new_tokens"_a, nb::kw_only(), "extra_ids"_a = nb::none(), "priority"_a = kDefaultPriority,
          "Why add_request would refuse this prompt (the message calls it 'request'), or None when it would "
          "queue it; changes nothing. A known request id is not checked.")
      .def("finish_request", &Scheduler::finish_request, "request_id"_a,
           "Finishes a request early (EOS, stop string, abort) and releases its blocks; no-op when "
           "already finished. KeyError for an unknown id.")
      .def(
          "schedule", [](Scheduler& self) { return to_python(self.schedule()); },
          "Schedules the next step. Run its copy_ops, then the forward of its requests, then call "
          "complete_step. RuntimeError if the previous non-empty batch was not completed.")
      .def(
          "complete_step",
          [](Scheduler& self, IntArrayLike request_ids, IntArrayLike token_ids) {
            return self.complete_step(to_request_ids(request_ids), to_vector<TokenId>(token_ids, "token_ids"));
          },
          "request_ids"_a, "token_ids"_a,
          "Reports the last batch: request_ids (int64) of the requests that sampled and their sampled "
          "token_ids (int32). Returns the ids of requests that reached max_new_tokens (finished, blocks "
          "released). ValueError when request_ids are not the batch's sampling requests.")
      .def("has_unfinished_requests", &Scheduler::has_unfinished_requests)
      .def("num_queued_requests", &Scheduler::num_queued_requests, "Waiting requests, paused ones included.")
      .def("num_running_requests", &Scheduler::num_running_requests, "Requests holding blocks (context or generation).")
      .def("request_state", &Scheduler::request_state, "request_id"_a, "KeyError for an unknown id.")
      .def("request_stats", &Scheduler::request_stats, "request_id"_a, "KeyError for an unknown id.")
      .def(
          "generated_token_ids",
          [](const Scheduler& self, int64_t request_id) { return to_numpy(self.generated_token_ids(request_id)); },
          "request_id"_a, "int32 array of the tokens the request generated so far. KeyError for an unknown id.")
      .def_prop_ro(
          "config", [](const Scheduler& self) { return self.config(); }, "The validated SchedulerConfig (a copy).")
      .def_prop_ro(
          "cache_manager", [](Scheduler& self) -> KVCacheManager& { return self.cache_manager(); },
          nb::rv_policy::reference_internal,
          "The KVCacheManager the scheduler owns (stats(), reset_stats(), check_invariants(), ...); "
          "valid while the scheduler lives.");
}

}  // namespace kvtool
