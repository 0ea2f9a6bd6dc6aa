// The Python module kvtool._core. Each concept binds itself in its own bind_*.cpp file.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

namespace kvtool {
void bind_retention(nb::module_& m);
void bind_retention_clock(nb::module_& m);
void bind_cache_manager(nb::module_& m);
void bind_tiers(nb::module_& m);
void bind_scheduler(nb::module_& m);
}  // namespace kvtool

NB_MODULE(_core, m) {
  m.doc() = "kvtool's C++ host runtime: KV cache manager and scheduler.";
  kvtool::bind_retention(m);  // before the manager and the scheduler, whose methods take RetentionRange
  kvtool::bind_cache_manager(m);
  kvtool::bind_retention_clock(m);
  kvtool::bind_tiers(m);
  kvtool::bind_scheduler(m);
}
