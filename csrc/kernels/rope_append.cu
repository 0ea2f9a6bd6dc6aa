// The attention prologue in one launch: per-head RMSNorm of q and k (Qwen3's q_norm / k_norm, when
// given), rotate-half RoPE of q and k, and the KV append (k and v stored at their paged-cache slot).
// Eagerly that is about ten launches per layer (two norms, six RoPE ops, the append's copies).
//
// Input is the fused qkv_proj output row [q heads | k heads | v heads] of each token; the rotated
// queries go to `query` [num_tokens, num_heads, head_dim] (what the attention kernels read), keys
// and values to the cache. Rounding follows the eager ops exactly: the norm's output is rounded to
// the model dtype, then RoPE computes round(round(x * cos) + x_partner * signed_sin) (torch.addcmul
// of the rounded product), with cos / signed_sin the step's tables in the model dtype
// (kvtool.models.llama.rope_cos_sin: signed_sin is sin with its first half negated).
//
// One warp per (token, head row): lane l holds dims [l * E, l * E + E) with E = head_dim / 32, so
// the rotate-half partner of a lane's value (dim i +- head_dim / 2) is the same slot of lane l ^ 16.
// A negative slot (a padding token) stores nothing; its query row is still written.
// Specialization: KVT_HEAD_DIM (64 or 128), KVT_DTYPE_BF16 (common.cuh).
#include "common.cuh"

#ifndef KVT_HEAD_DIM
#error "KVT_HEAD_DIM must be defined (64 or 128)"
#endif

using kvt::half_bits;
using kvt::i64;

namespace {

constexpr int HEAD_DIM = KVT_HEAD_DIM;
constexpr int NUM_WARPS = 4;
constexpr int ELEMS = HEAD_DIM / 32;  // values per lane
constexpr int WORDS = ELEMS / 2;      // 32-bit words per lane

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head_dim must be 64 or 128");

__device__ __forceinline__ void load_row(const half_bits* row, int lane, float* v) {
  const unsigned* words = reinterpret_cast<const unsigned*>(row) + lane * WORDS;
#pragma unroll
  for (int j = 0; j < WORDS; ++j) kvt::unpack2(words[j], v[2 * j], v[2 * j + 1]);
}

__device__ __forceinline__ void store_row(half_bits* row, int lane, const float* v) {
  unsigned* words = reinterpret_cast<unsigned*>(row) + lane * WORDS;
#pragma unroll
  for (int j = 0; j < WORDS; ++j) words[j] = kvt::pack2(v[2 * j], v[2 * j + 1]);
}

__device__ __forceinline__ float rounded(float f) { return kvt::to_float(kvt::from_float(f)); }

}  // namespace

// grid: (num_tokens, ceil((num_heads + 2 * num_kv_heads) / 4)); block: 128 (a warp per head row).
extern "C" __global__ void __launch_bounds__(32 * NUM_WARPS) kvt_rope_append(
    const half_bits* __restrict__ qkv, i64 qkv_stride,  // [num_tokens, (num_heads + 2 kvh) * hd]
    const half_bits* __restrict__ cos, const half_bits* __restrict__ signed_sin, i64 rope_stride,  // [num_tokens, hd]
    const half_bits* __restrict__ q_norm_weight, const half_bits* __restrict__ k_norm_weight,  // [hd] or null
    float eps,
    half_bits* __restrict__ query, i64 query_stride,  // [num_tokens, num_heads, hd], heads contiguous
    const long long* __restrict__ slot_mapping,       // [num_tokens]
    half_bits* __restrict__ kv_cache, i64 block_stride, i64 kv_stride, i64 token_stride,
    i64 head_stride,  // [num_blocks, 2, tpb, kvh, hd] strided
    int num_heads, int num_kv_heads, int tokens_per_block) {
  const int token = blockIdx.x;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int head_row = blockIdx.y * NUM_WARPS + warp;  // q heads, then k heads, then v heads
  if (head_row >= num_heads + 2 * num_kv_heads) return;  // the whole warp
  const long long slot = slot_mapping[token];
  const half_bits* src = qkv + static_cast<i64>(token) * qkv_stride + static_cast<i64>(head_row) * HEAD_DIM;
  half_bits* slot_base = nullptr;
  if (slot >= 0) {
    slot_base = kv_cache + (slot / tokens_per_block) * block_stride +
                static_cast<i64>(slot % tokens_per_block) * token_stride;
  }

  if (head_row >= num_heads + num_kv_heads) {  // a value head: stored as is
    if (slot_base == nullptr) return;
    const int kv_head = head_row - num_heads - num_kv_heads;
    const unsigned* from = reinterpret_cast<const unsigned*>(src) + lane * WORDS;
    unsigned* to = reinterpret_cast<unsigned*>(slot_base + kv_stride + static_cast<i64>(kv_head) * head_stride) +
                   lane * WORDS;
#pragma unroll
    for (int j = 0; j < WORDS; ++j) to[j] = from[j];
    return;
  }

  const bool is_query = head_row < num_heads;
  float x[ELEMS];
  load_row(src, lane, x);
  const half_bits* norm_weight = is_query ? q_norm_weight : k_norm_weight;
  if (norm_weight != nullptr) {  // uniform across the warp: the shuffles below see every lane
    float sum_squares = 0.f;
#pragma unroll
    for (int e = 0; e < ELEMS; ++e) sum_squares += x[e] * x[e];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum_squares += __shfl_xor_sync(0xffffffffu, sum_squares, offset);
    const float inv_rms = rsqrtf(sum_squares / static_cast<float>(HEAD_DIM) + eps);
    float w[ELEMS];
    load_row(norm_weight, lane, w);
#pragma unroll
    for (int e = 0; e < ELEMS; ++e) x[e] = rounded(x[e] * inv_rms * w[e]);
  }

  float c[ELEMS], s[ELEMS], out[ELEMS];
  load_row(cos + static_cast<i64>(token) * rope_stride, lane, c);
  load_row(signed_sin + static_cast<i64>(token) * rope_stride, lane, s);
#pragma unroll
  for (int e = 0; e < ELEMS; ++e) {
    const float partner = __shfl_xor_sync(0xffffffffu, x[e], 16);  // dim i + head_dim/2 (or - for the upper half)
    out[e] = rounded(x[e] * c[e]) + partner * s[e];
  }

  if (is_query) {
    store_row(query + static_cast<i64>(token) * query_stride + static_cast<i64>(head_row) * HEAD_DIM, lane, out);
  } else if (slot_base != nullptr) {
    const int kv_head = head_row - num_heads;
    store_row(slot_base + static_cast<i64>(kv_head) * head_stride, lane, out);
  }
}
