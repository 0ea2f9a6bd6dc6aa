// Python bindings of the scheduler's vocabulary and configuration: the capacity and chunking
// policies and request states (TensorRT-LLM's names), and SchedulerConfig with the C++ defaults.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.h"
#include "scheduler.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtool {

namespace {

void bind_scheduler_enums(nb::module_& m) {
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
}

std::string config_repr(const SchedulerConfig& c) {
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
}

}  // namespace

void bind_scheduler_config(nb::module_& m) {
  bind_scheduler_enums(m);
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
      .def("__repr__", &config_repr);
}

}  // namespace kvtool
