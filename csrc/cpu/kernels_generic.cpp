// The kernels for the portable build (one float per lane). CMakeLists.txt compiles this file alone with: no ISA flags.
#define KVTOOL_CPU_ISA generic
#include "vec_generic.h"
#include "kernels_impl.h"

namespace kvtool::cpu {

const KernelTable& generic_kernels() {
  static constexpr KernelTable table{"generic", generic::Vec::width, 1,
                                     generic::rms_norm, generic::silu_mul, generic::rope_store_kv,
                                     generic::attention, generic::merge_attention,
                                     generic::sum, generic::linear, generic::argmax, generic::draw, nullptr};
  return table;
}

}  // namespace kvtool::cpu
