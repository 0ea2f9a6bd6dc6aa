// SiLU-gated product of the MLP (SwiGLU): out = silu(gate) * up, where gate_up = [gate | up] is the
// fused gate_up_proj's output row. One launch instead of three eager ops (silu, the product, and
// the chunk's views feeding them); fp32 math, one rounding.
//
// 16-byte vectors (8 values) per thread; rows start 16-byte aligned and intermediate_size is a
// multiple of 8 (the launcher checks). Specialization: KVT_DTYPE_BF16 (common.cuh).
#include "common.cuh"

using kvt::half_bits;
using kvt::i64;

namespace {

constexpr int NUM_THREADS = 256;

// g * sigmoid(g), with e^-g = 2^(-g log2 e) (ex2.approx: +inf for very negative g gives -0, the limit).
__device__ __forceinline__ float silu(float g) { return g / (1.f + kvt::fast_exp2(-1.4426950408889634f * g)); }

}  // namespace

// grid: (num_tokens, ceil(intermediate_size / 8 / 256)); block: 256.
extern "C" __global__ void __launch_bounds__(NUM_THREADS) kvt_silu_mul(
    const half_bits* __restrict__ gate_up, i64 gate_up_stride,  // [num_tokens, 2 * intermediate]
    half_bits* __restrict__ out, i64 out_stride,                // [num_tokens, intermediate]
    int intermediate) {
  const int token = blockIdx.x;
  const int v = blockIdx.y * NUM_THREADS + threadIdx.x;  // this thread's 16-byte vector of the row
  if (v >= intermediate / 8) return;
  const half_bits* row = gate_up + static_cast<i64>(token) * gate_up_stride;
  float g[8], u[8];
  kvt::unpack8(reinterpret_cast<const uint4*>(row)[v], g);
  kvt::unpack8(reinterpret_cast<const uint4*>(row + intermediate)[v], u);
  reinterpret_cast<uint4*>(out + static_cast<i64>(token) * out_stride)[v] =
      make_uint4(kvt::pack2(silu(g[0]) * u[0], silu(g[1]) * u[1]), kvt::pack2(silu(g[2]) * u[2], silu(g[3]) * u[3]),
                 kvt::pack2(silu(g[4]) * u[4], silu(g[5]) * u[5]), kvt::pack2(silu(g[6]) * u[6], silu(g[7]) * u[7]));
}
