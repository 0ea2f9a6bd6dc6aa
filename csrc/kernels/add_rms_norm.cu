// Residual add + RMSNorm in one pass (vLLM's fused_add_rms_norm), in place:
//
//   residual = x + residual                      (rounded to the model dtype, as `x + residual` is)
//   x        = residual * rsqrt(mean(residual^2) + eps) * weight   (fp32 math, one rounding)
//
// A decoder layer does this twice (before attention and before the MLP) and the model once more
// (the final norm): two eager ops become one launch. Both results match the unfused torch ops
// (`x + residual`, then F.rms_norm) up to the last bit of the final rounding.
//
// One CTA per token row, 16-byte vectors (8 values) per thread; the row's sum of squares is a block
// reduction. Rows must start 16-byte aligned and hidden_size be a multiple of 8 (the launcher checks).
// Specialization: KVT_DTYPE_BF16 (common.cuh); sizes are runtime arguments.
#include "common.cuh"

using kvt::half_bits;
using kvt::i64;

namespace {

constexpr int NUM_THREADS = 256;
constexpr int NUM_WARPS = NUM_THREADS / 32;

}  // namespace

// grid: (num_tokens); block: 256.
extern "C" __global__ void __launch_bounds__(NUM_THREADS) kvt_add_rms_norm(
    half_bits* __restrict__ x, i64 x_stride,                // [num_tokens, hidden]: in the sublayer output, out normed
    half_bits* __restrict__ residual, i64 residual_stride,  // [num_tokens, hidden]: in the stream, out x + residual
    const half_bits* __restrict__ weight,                   // [hidden]
    int hidden, float eps) {
  __shared__ float warp_sums[NUM_WARPS];
  const int token = blockIdx.x;
  const int num_vectors = hidden / 8;
  uint4* x_row = reinterpret_cast<uint4*>(x + static_cast<i64>(token) * x_stride);
  uint4* r_row = reinterpret_cast<uint4*>(residual + static_cast<i64>(token) * residual_stride);
  const uint4* w_row = reinterpret_cast<const uint4*>(weight);

  // Pass 1: the sum, rounded and stored; squares of the rounded values (what the norm then reads).
  float sum_squares = 0.f;
  for (int v = threadIdx.x; v < num_vectors; v += NUM_THREADS) {
    float a[8], b[8];
    kvt::unpack8(x_row[v], a);
    kvt::unpack8(r_row[v], b);
    unsigned packed[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      packed[j] = kvt::pack2(a[2 * j] + b[2 * j], a[2 * j + 1] + b[2 * j + 1]);
      float lo, hi;
      kvt::unpack2(packed[j], lo, hi);
      sum_squares += lo * lo + hi * hi;
    }
    r_row[v] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum_squares += __shfl_xor_sync(0xffffffffu, sum_squares, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum_squares;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < NUM_WARPS; ++w) total += warp_sums[w];
  const float inv_rms = rsqrtf(total / static_cast<float>(hidden) + eps);

  // Pass 2: each thread re-reads the residual vectors it wrote itself (no barrier needed).
  for (int v = threadIdx.x; v < num_vectors; v += NUM_THREADS) {
    float r[8], w[8];
    kvt::unpack8(r_row[v], r);
    kvt::unpack8(w_row[v], w);
    x_row[v] = make_uint4(kvt::pack2(r[0] * inv_rms * w[0], r[1] * inv_rms * w[1]),
                          kvt::pack2(r[2] * inv_rms * w[2], r[3] * inv_rms * w[3]),
                          kvt::pack2(r[4] * inv_rms * w[4], r[5] * inv_rms * w[5]),
                          kvt::pack2(r[6] * inv_rms * w[6], r[7] * inv_rms * w[7]));
  }
}
