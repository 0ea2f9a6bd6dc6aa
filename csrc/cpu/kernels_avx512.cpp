// The kernels for AVX-512 (F, BW, VL, DQ) + FMA. CMakeLists.txt compiles this file alone with: -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma.
#define KVTOOL_CPU_ISA avx512
#include "vec_avx512.h"
#include "kernels_impl.h"

namespace kvtool::cpu {

const KernelTable& avx512_kernels() {
  static constexpr KernelTable table{"avx512", avx512::Vec::width, 1,
                                     avx512::rms_norm, avx512::silu_mul, avx512::rope_store_kv,
                                     avx512::attention, avx512::merge_attention,
                                     avx512::sum, avx512::linear, avx512::argmax, avx512::draw, nullptr};
  return table;
}

}  // namespace kvtool::cpu
