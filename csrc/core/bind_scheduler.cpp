#include <nanobind/nanobind.h>

namespace nb = nanobind;

namespace kvtool {
void bind_scheduler(nb::module_& m) { (void)m; }
}  // namespace kvtool
