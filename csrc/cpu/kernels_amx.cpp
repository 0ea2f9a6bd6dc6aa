// The kernels for AMX (with AVX-512 and AVX512-BF16): a prompt's bfloat16 attention and projections
// on tile products (attention_rows_amx.h, tile_linear_amx.h), everything else as
// kernels_avx512_bf16.cpp. CMakeLists.txt compiles this file alone with kernels_avx512_bf16.cpp's
// flags and -mamx-tile -mamx-bf16; it runs only where the kernel has let the process use the tiles
// (cpu_kernels.cpp).
#define KVTOOL_CPU_ISA amx
#include "vec_avx512.h"
#include "kernels_impl.h"

namespace kvtool::cpu {

const KernelTable& amx_kernels() {
  static constexpr KernelTable table{"amx", amx::Vec::width, amx::rms_norm, amx::silu_mul, amx::rope_store_kv,
                                     amx::attention, amx::merge_attention, amx::sum, amx::linear, amx::argmax,
                                     amx::tile_linear};
  return table;
}

}  // namespace kvtool::cpu
