// The kernels for AVX-512 with AVX512-BF16 (a prompt's bfloat16 attention in dot products of pairs,
// attention_rows_bf16.h; everything else as kernels_avx512.cpp). CMakeLists.txt compiles this file
// alone with kernels_avx512.cpp's flags and -mavx512bf16.
#define KVTOOL_CPU_ISA avx512_bf16
#include "vec_avx512.h"
#include "kernels_impl.h"

namespace kvtool::cpu {

const KernelTable& avx512_bf16_kernels() {
  static constexpr KernelTable table{"avx512_bf16", avx512_bf16::Vec::width, 1, avx512_bf16::rms_norm,
                                     avx512_bf16::silu_mul, avx512_bf16::rope_store_kv, avx512_bf16::attention,
                                     avx512_bf16::merge_attention, avx512_bf16::sum, avx512_bf16::linear,
                                     avx512_bf16::argmax, avx512_bf16::draw, nullptr};
  return table;
}

}  // namespace kvtool::cpu
