// Python bindings of retention by token range (TensorRT-LLM's TokenRangeRetentionConfig) and the
// cache manager's clock. RetentionRange is bound before the manager and the scheduler, whose
// add_sequence / add_request take a list of them.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>

#include "kv_cache_manager.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtool {

void bind_retention(nb::module_& m) {
  nb::class_<RetentionRange>(
      m, "RetentionRange",
      "Retention of a token range: blocks whose first token lies in [token_start, token_end) get `priority` "
      "(0..100); duration_ms after such a block was last released it reverts to the default priority 35. "
      "Give a sequence's ranges sorted and not overlapping.")
      .def(
          "__init__",
          [](RetentionRange* self, int32_t token_start, std::optional<int32_t> token_end, int32_t priority,
             std::optional<int64_t> duration_ms) {
            new (self) RetentionRange{token_start, token_end.value_or(-1), priority, duration_ms.value_or(-1)};
          },
          "token_start"_a, "token_end"_a.none(), "priority"_a, "duration_ms"_a.none() = nb::none(),
          "token_end None: to the end of the sequence; duration_ms None: the priority never reverts.")
      .def_prop_ro(
          "token_start", [](const RetentionRange& r) { return r.token_start; })
      .def_prop_ro(
          "token_end", [](const RetentionRange& r) { return r.token_end < 0 ? std::nullopt : std::optional<int32_t>(r.token_end); },
          "None: to the end of the sequence.")
      .def_prop_ro("priority", [](const RetentionRange& r) { return r.priority; })
      .def_prop_ro(
          "duration_ms",
          [](const RetentionRange& r) { return r.duration_ms < 0 ? std::nullopt : std::optional<int64_t>(r.duration_ms); },
          "None: the priority never reverts.")
      .def("__repr__", [](const RetentionRange& r) {
        return "RetentionRange(token_start=" + std::to_string(r.token_start) +
               ", token_end=" + (r.token_end < 0 ? std::string("None") : std::to_string(r.token_end)) +
               ", priority=" + std::to_string(r.priority) +
               ", duration_ms=" + (r.duration_ms < 0 ? std::string("None") : std::to_string(r.duration_ms)) + ")";
      });
}

// The manager's clock, added to the KVCacheManager class bind_cache_manager made.
void bind_retention_clock(nb::module_& m) {
  nb::handle cls = m.attr("KVCacheManager");
  cls.attr("set_time") = nb::cpp_function(
      [](KVCacheManager& self, int64_t now_ms) { self.set_time(now_ms); }, nb::scope(cls), nb::name("set_time"),
      nb::is_method(), "now_ms"_a,
      "Sets the manager's clock (milliseconds, the engine's or a simulated one; never earlier than before: "
      "ValueError). Priorities whose duration ran out by now revert to 35.");
  cls.attr("time") = nb::cpp_function([](const KVCacheManager& self) { return self.time(); }, nb::scope(cls),
                                      nb::name("time"), nb::is_method(), "The manager's clock in milliseconds.");
}

}  // namespace kvtool
