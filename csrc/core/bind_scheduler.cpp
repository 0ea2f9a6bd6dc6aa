// Python bindings of the Scheduler: token ids in as numpy arrays or lists, a step's batch out as the
// ScheduledBatch of bind_scheduler_results.cpp. Bad input -> ValueError, unknown request id ->
// KeyError, calls out of order (schedule twice) -> RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "bind_scheduler_results.h"
#include "bindings.h"
#include "numpy_arrays.h"
#include "scheduler.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtool {

namespace {

using SchedulerClass = nb::class_<Scheduler>;

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

// request_problem's reading of a prompt: exact ints summarized in place, anything else converted.
PromptSummary summarize(const Scheduler& self, IntArrayLike token_ids, IntArrayLike extra_ids, int32_t priority) {
  const int32_t vocab_size = self.config().vocab_size;
  PromptSummary summary;
  if (!summarize_int_sequence(token_ids.ptr(), vocab_size, summary)) {
    SequenceSpec prompt;
    prompt.token_ids = to_vector<TokenId>(token_ids, "token_ids");
    summary = summarize_prompt(prompt, vocab_size);
  }
  summary.num_extra_ids =
      extra_ids.is_none() ? 0 : static_cast<int64_t>(to_vector<ExtraId>(extra_ids, "extra_ids").size());
  summary.priority = priority;
  return summary;
}

// A request's way in and out: queued (or checked without queuing), finished early, removed.
void bind_requests(SchedulerClass& c) {
  c.def(
       "add_request",
       [](Scheduler& self, int64_t request_id, IntArrayLike token_ids, int32_t max_new_tokens,
          IntArrayLike extra_ids,
          uint64_t lora_task_id, uint64_t cache_salt, int32_t priority,
          std::optional<std::vector<RetentionRange>> retention) {
         self.add_request(request_id,
                          to_sequence_spec(token_ids, extra_ids, lora_task_id, cache_salt, priority,
                                           retention ? std::move(*retention) : std::vector<RetentionRange>{}),
                          max_new_tokens);
       },
       "request_id"_a, "token_ids"_a, "max_new_tokens"_a, nb::kw_only(), "extra_ids"_a = nb::none(),
       "lora_task_id"_a = 0, "cache_salt"_a = 0, "priority"_a = kDefaultPriority, "retention"_a = nb::none(),
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
            return self.request_problem(summarize(self, token_ids, extra_ids, priority), max_new_tokens);
          },
          "token_ids"_a, "max_new_tokens"_a, nb::kw_only(), "extra_ids"_a = nb::none(), "priority"_a = kDefaultPriority,
          "Why add_request would refuse this prompt (the message calls it 'request'), or None when it would "
          "queue it; changes nothing. A known request id is not checked.")
      .def("finish_request", &Scheduler::finish_request, "request_id"_a,
           "Finishes a request early (EOS, stop string, abort) and releases its blocks; no-op when "
           "already finished. KeyError for an unknown id.")
      .def("remove_request", &Scheduler::remove_request, "request_id"_a,
           "Forgets a request, finishing it first if it is not: its stats and generated tokens are dropped "
           "and its id becomes unknown. A long-lived caller removes each request once it has read what it "
           "needs. KeyError for an unknown id.");
}

// One step: the batch out, the sampled tokens back.
void bind_steps(SchedulerClass& c) {
  c.def(
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
          "released). ValueError when request_ids are not the batch's sampling requests.");
}

// What the scheduler holds: its queues, each request's state, its configuration and cache manager.
void bind_queries(SchedulerClass& c) {
  c.def("has_unfinished_requests", &Scheduler::has_unfinished_requests)
      .def("num_queued_requests", &Scheduler::num_queued_requests, "Waiting requests, paused ones included.")
      .def("num_running_requests", &Scheduler::num_running_requests, "Requests holding blocks (context or generation).")
      .def("num_requests", &Scheduler::num_requests,
           "Requests the scheduler keeps a record of: unfinished ones and finished ones not removed yet.")
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

}  // namespace

void bind_scheduler(nb::module_& m) {
  translate_to_key_error<UnknownRequestError>();
  SchedulerClass c(m, "Scheduler",
                   "Request states, capacity policy, micro-batch limits and chunked context over a "
                   "KV cache manager it owns. Each step: schedule() -> run the batch -> complete_step().");
  c.def(nb::init<CacheConfig, SchedulerConfig>(), "cache_config"_a, "scheduler_config"_a,
        "Raises ValueError for a bad configuration.");
  bind_requests(c);
  bind_steps(c);
  bind_queries(c);
}

}  // namespace kvtool
