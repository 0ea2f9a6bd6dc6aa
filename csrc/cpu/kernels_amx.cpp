// The kernels for AMX (with AVX-512 and AVX512-BF16): a prompt's bfloat16 attention and projections
// on tile products (attention_rows_amx.h, tile_linear_amx.h), everything else as
// kernels_avx512_bf16.cpp. CMakeLists.txt compiles this file alone with kernels_avx512_bf16.cpp's
// flags and -mamx-tile -mamx-bf16; it runs only where the kernel has let the process use the tiles
// (cpu_kernels.cpp).
#define KVTOOL_CPU_ISA amx
#include "vec_avx512.h"
#include "kernels_impl.h"

namespace kvtool::cpu {

// A product of a decode step's one to three rows walks four streams of weight rows a thread, a row of
// each in turn: on the family 6 model 207 Xeon (2 cores) one stream a thread left the memory idle
// enough that a bfloat16 decode step of SmolLM2-135M took 1.07x the time (float32 1.02x; paired
// alternations in one process, 26 of 30 and 16 of 20 won; two streams 1.05x, eight 1.06x), and
// bench/cpu_row_prefetch.cpp's four streams read the weights at 1.07-1.11x one stream's rate (0.99-1.33x
// in 20 scratch rounds; results/cpu_decode_rows.md). The other builds keep one: no EPYC measured.
const KernelTable& amx_kernels() {
  static constexpr KernelTable table{"amx", amx::Vec::width, 4, amx::rms_norm, amx::silu_mul, amx::rope_store_kv,
                                     amx::attention, amx::merge_attention, amx::sum, amx::linear, amx::argmax,
                                     amx::draw, amx::tile_linear};
  return table;
}

}  // namespace kvtool::cpu
