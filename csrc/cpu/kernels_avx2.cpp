// The kernels for AVX2 + FMA. CMakeLists.txt compiles this file alone with: -mavx2 -mfma -mf16c.
#define KVTOOL_CPU_ISA avx2
#include "vec_avx2.h"
#include "kernels_impl.h"

namespace kvtool::cpu {

const KernelTable& avx2_kernels() {
  static constexpr KernelTable table{"avx2", avx2::Vec::width, 1,
                                     avx2::rms_norm, avx2::silu_mul, avx2::rope_store_kv,
                                     avx2::attention, avx2::merge_attention,
                                     avx2::sum, avx2::linear, avx2::argmax, avx2::draw, nullptr};
  return table;
}

}  // namespace kvtool::cpu
