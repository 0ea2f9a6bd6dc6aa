#include <nanobind/nanobind.h>

namespace nb = nanobind;

namespace kvtool {
void bind_cache_manager(nb::module_& m) { (void)m; }
}  // namespace kvtool
