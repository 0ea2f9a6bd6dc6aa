// Paged decode attention: one new token per request attends to its whole paged KV sequence.
//
// Memory-bound: the design goal is to read every visible K and V byte exactly once, with many
// 16-byte loads in flight.
//
// Grid (x = kv head * head chunk, y = decode request, z = partition). A CTA handles one KV head
// and HEADS_PER_CTA of the query heads that share it (GQA: K/V are read once for the whole group)
// over one partition of PARTITION_SIZE keys (split-K: long sequences and small batches still fill
// the GPU). Inside a CTA, LANES_PER_KEY = head_dim / 8 lanes share one key (8 dims, one 16-byte
// load each), so a CTA works on 128 / LANES_PER_KEY keys at a time, UNROLL of them per thread in
// flight:
//   pass 1  logits[h][k] = (q_h . K_k) * scale * log2(e)     -> shared memory
//   softmax max / exp2 / sum over the partition                (fp32)
//   pass 2  acc[h][:] += p[h][k] * V_k                        (fp32, per lane 8 dims)
//   reduce the per-key-group accumulators across the CTA.
// With one partition the CTA writes the normalized output directly; otherwise it writes the
// partition's normalized output, max and sum (fp32) and kvt_paged_decode_reduce combines them.
//
// Keys before the sliding window, past seq_len, or in released blocks (-1) are never read.
//
// Specialization: KVT_HEAD_DIM, KVT_TOKENS_PER_BLOCK, KVT_DTYPE_BF16, KVT_HEADS_PER_CTA,
// KVT_PARTITION_SIZE, KVT_DECODE_UNROLL.
#include "common.cuh"

#ifndef KVT_HEAD_DIM
#error "KVT_HEAD_DIM must be defined (64 or 128)"
#endif
#ifndef KVT_TOKENS_PER_BLOCK
#error "KVT_TOKENS_PER_BLOCK must be defined (a power of two)"
#endif
#ifndef KVT_HEADS_PER_CTA
#error "KVT_HEADS_PER_CTA must be defined (query heads per kv head handled by one CTA)"
#endif
#ifndef KVT_PARTITION_SIZE
#define KVT_PARTITION_SIZE 512
#endif
#ifndef KVT_DECODE_UNROLL
#define KVT_DECODE_UNROLL 4
#endif

namespace {

using namespace kvt;

constexpr int HEAD_DIM = KVT_HEAD_DIM;
constexpr int TOKENS_PER_BLOCK = KVT_TOKENS_PER_BLOCK;
constexpr int HEADS = KVT_HEADS_PER_CTA;
constexpr int PARTITION_SIZE = KVT_PARTITION_SIZE;
constexpr int NUM_THREADS = 128;
constexpr int NUM_WARPS = NUM_THREADS / 32;
constexpr int LANES_PER_KEY = HEAD_DIM / 8;
constexpr int KEY_GROUPS = NUM_THREADS / LANES_PER_KEY;  // keys processed side by side
constexpr int GROUPS_PER_WARP = 32 / LANES_PER_KEY;
constexpr int UNROLL = KVT_DECODE_UNROLL;  // 16-byte K or V loads per thread in flight
constexpr int KEYS_PER_STEP = KEY_GROUPS * UNROLL;
// pass-2 cross-warp reduction buffer [NUM_WARPS][HEADS][HEAD_DIM] aliases the logits.
constexpr int LOGITS_FLOATS = HEADS * PARTITION_SIZE;
constexpr int REDUCE_FLOATS = NUM_WARPS * HEADS * HEAD_DIM;
constexpr int SCRATCH_FLOATS = LOGITS_FLOATS > REDUCE_FLOATS ? LOGITS_FLOATS : REDUCE_FLOATS;

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head_dim must be 64 or 128");
static_assert((TOKENS_PER_BLOCK & (TOKENS_PER_BLOCK - 1)) == 0, "tokens_per_block must be a power of two");
static_assert(HEADS >= 1 && HEADS <= 16, "heads per CTA must be in 1..16");
static_assert(PARTITION_SIZE % KEY_GROUPS == 0, "partition size must be a multiple of the key groups");
static_assert(SCRATCH_FLOATS * 4 <= 40 * 1024, "decode shared memory must stay under the static limit");

// Sum of `x` over the LANES_PER_KEY lanes that share a key (an aligned group of lanes).
__device__ __forceinline__ float key_group_sum(float x) {
#pragma unroll
  for (int offset = LANES_PER_KEY / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

}  // namespace

// grid: (num_kv_heads * (group_size / HEADS), num_decode_seqs, num_partitions); block: 128.
// Decode request i is sequence seq_offset + i of the metadata; its token is row query_start_loc[seq].
// partial_*: [num_decode_seqs, num_heads, num_partitions(, head_dim)] fp32, unused when
// num_partitions == 1 (may be null then).
extern "C" __global__ void __launch_bounds__(NUM_THREADS) kvt_paged_decode_attention(
    const half_bits* __restrict__ query, i64 q_token_stride, i64 q_head_stride,  // [num_tokens, num_heads, hd]
    const half_bits* __restrict__ kv_cache, i64 block_stride, i64 kv_stride, i64 token_stride,
    i64 head_stride,                                               // [num_blocks, 2, tpb, kvh, hd] strided
    const int* __restrict__ block_tables, i64 block_table_stride,  // [num_seqs, max_blocks], -1 padded
    const int* __restrict__ query_start_loc,                       // [num_seqs + 1]
    const int* __restrict__ seq_lens,                              // [num_seqs]
    int seq_offset,
    half_bits* __restrict__ out, i64 out_token_stride, i64 out_head_stride,  // [num_tokens, num_heads, hd]
    float* __restrict__ partial_out, float* __restrict__ partial_max, float* __restrict__ partial_sum,
    int num_heads, int num_kv_heads, float scale_log2, int sliding_window) {
  __shared__ float scratch[SCRATCH_FLOATS];
  __shared__ float warp_stats[NUM_WARPS][HEADS];
  __shared__ float head_max[HEADS];
  __shared__ float head_sum[HEADS];

  const int decode_index = blockIdx.y;
  const int seq = seq_offset + decode_index;
  const int group_size = num_heads / num_kv_heads;
  const int chunks_per_kv_head = group_size / HEADS;
  const int kv_head = blockIdx.x / chunks_per_kv_head;
  const int head0 = kv_head * group_size + (blockIdx.x % chunks_per_kv_head) * HEADS;
  const int seq_len = seq_lens[seq];
  const int token = query_start_loc[seq];
  const int partition = blockIdx.z;
  const int num_partitions = gridDim.z;

  const int p_begin = partition * PARTITION_SIZE;
  if (p_begin >= seq_len) return;  // past this request's end: the reduce never reads it
  const int p_end = min(p_begin + PARTITION_SIZE, seq_len);
  const int window_begin = sliding_window > 0 ? max(0, seq_len - sliding_window) : 0;
  const int k_begin = max(p_begin, window_begin);  // keys [k_begin, p_end) are visible

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int key_group = tid / LANES_PER_KEY;
  const int sub = tid % LANES_PER_KEY;  // this lane's 8 dims: [8 * sub, 8 * sub + 8)

  const int* block_table = block_tables + static_cast<i64>(seq) * block_table_stride;
  const half_bits* k_base = kv_cache + static_cast<i64>(kv_head) * head_stride + sub * 8;
  const half_bits* v_base = k_base + kv_stride;

  // ---- q (pre-scaled into the log2 domain), 8 dims per lane ----
  float q[HEADS][8];
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
    const uint4 raw = *reinterpret_cast<const uint4*>(query + static_cast<i64>(token) * q_token_stride +
                                                      static_cast<i64>(head0 + h) * q_head_stride + sub * 8);
    unpack8(raw, q[h]);
#pragma unroll
    for (int j = 0; j < 8; ++j) q[h][j] *= scale_log2;
  }

  // ---- pass 1: logits. The loop trip count is uniform across the CTA (shuffles need the warp). ----
  for (int step = k_begin; step < p_end; step += KEYS_PER_STEP) {
    uint4 kv[UNROLL];
    bool ok[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int key = step + u * KEY_GROUPS + key_group;
      const int block = key < p_end ? block_table[key / TOKENS_PER_BLOCK] : -1;
      ok[u] = block >= 0;
      kv[u] = make_uint4(0u, 0u, 0u, 0u);
      if (ok[u])
        kv[u] = *reinterpret_cast<const uint4*>(k_base + static_cast<i64>(block) * block_stride +
                                                static_cast<i64>(key % TOKENS_PER_BLOCK) * token_stride);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int key = step + u * KEY_GROUPS + key_group;
      float k[8];
      unpack8(kv[u], k);
#pragma unroll
      for (int h = 0; h < HEADS; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) dot += q[h][j] * k[j];
        dot = key_group_sum(dot);
        if (sub == 0 && key < p_end) scratch[h * PARTITION_SIZE + (key - p_begin)] = ok[u] ? dot : neg_inf();
      }
    }
  }
  __syncthreads();

  // ---- softmax statistics over the visible keys [k_begin, p_end) of the partition ----
  const int lo = k_begin - p_begin;
  const int hi = p_end - p_begin;
  {
    float local_max[HEADS];
#pragma unroll
    for (int h = 0; h < HEADS; ++h) local_max[h] = neg_inf();
    for (int j = lo + tid; j < hi; j += NUM_THREADS) {
#pragma unroll
      for (int h = 0; h < HEADS; ++h) local_max[h] = fmaxf(local_max[h], scratch[h * PARTITION_SIZE + j]);
    }
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
      const float m = warp_max(local_max[h]);
      if (lane == 0) warp_stats[warp][h] = m;
    }
    __syncthreads();
    if (tid < HEADS) {
      float m = warp_stats[0][tid];
#pragma unroll
      for (int w = 1; w < NUM_WARPS; ++w) m = fmaxf(m, warp_stats[w][tid]);
      head_max[tid] = m;
    }
    __syncthreads();
    float local_sum[HEADS];
#pragma unroll
    for (int h = 0; h < HEADS; ++h) local_sum[h] = 0.f;
    for (int j = lo + tid; j < hi; j += NUM_THREADS) {
#pragma unroll
      for (int h = 0; h < HEADS; ++h) {
        const float m = head_max[h] == neg_inf() ? 0.f : head_max[h];  // all masked: exp2(-inf) = 0
        const float e = fast_exp2(scratch[h * PARTITION_SIZE + j] - m);
        scratch[h * PARTITION_SIZE + j] = e;
        local_sum[h] += e;
      }
    }
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
      const float s = warp_sum(local_sum[h]);
      if (lane == 0) warp_stats[warp][h] = s;
    }
    __syncthreads();
    if (tid < HEADS) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < NUM_WARPS; ++w) s += warp_stats[w][tid];
      head_sum[tid] = s;
    }
    // head_sum is read after the next __syncthreads only.
  }

  // ---- pass 2: acc[h][:] = sum_k p[h][k] * V_k over this thread's keys ----
  float acc[HEADS][8];
#pragma unroll
  for (int h = 0; h < HEADS; ++h)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[h][j] = 0.f;

  for (int step = k_begin; step < p_end; step += KEYS_PER_STEP) {
    uint4 vv[UNROLL];
    bool ok[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int key = step + u * KEY_GROUPS + key_group;
      const int block = key < p_end ? block_table[key / TOKENS_PER_BLOCK] : -1;
      ok[u] = block >= 0;
      vv[u] = make_uint4(0u, 0u, 0u, 0u);
      if (ok[u])
        vv[u] = *reinterpret_cast<const uint4*>(v_base + static_cast<i64>(block) * block_stride +
                                                static_cast<i64>(key % TOKENS_PER_BLOCK) * token_stride);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (!ok[u]) continue;  // p = 0 there, and the value was never loaded
      const int key = step + u * KEY_GROUPS + key_group;
      float v[8];
      unpack8(vv[u], v);
#pragma unroll
      for (int h = 0; h < HEADS; ++h) {
        const float p = scratch[h * PARTITION_SIZE + (key - p_begin)];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[h][j] += p * v[j];
      }
    }
  }

  // ---- reduce the key groups: first inside each warp, then across warps via shared memory ----
#pragma unroll
  for (int h = 0; h < HEADS; ++h)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int offset = LANES_PER_KEY; offset < 32; offset *= 2)
        acc[h][j] += __shfl_xor_sync(0xffffffffu, acc[h][j], offset);
  __syncthreads();  // logits are dead: reuse the scratch as [NUM_WARPS][HEADS][HEAD_DIM]
  if (lane < LANES_PER_KEY) {
#pragma unroll
    for (int h = 0; h < HEADS; ++h)
#pragma unroll
      for (int j = 0; j < 8; ++j) scratch[(warp * HEADS + h) * HEAD_DIM + sub * 8 + j] = acc[h][j];
  }
  __syncthreads();

  for (int idx = tid; idx < HEADS * HEAD_DIM; idx += NUM_THREADS) {
    const int h = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) total += scratch[(w * HEADS + h) * HEAD_DIM + d];
    const float sum = head_sum[h];
    const float value = sum > 0.f ? total / sum : 0.f;
    const int qh = head0 + h;
    if (num_partitions == 1) {
      out[static_cast<i64>(token) * out_token_stride + static_cast<i64>(qh) * out_head_stride + d] =
          from_float(value);
    } else {
      const i64 row = (static_cast<i64>(decode_index) * num_heads + qh) * num_partitions + partition;
      partial_out[row * HEAD_DIM + d] = value;
      if (d == 0) {
        partial_max[row] = head_max[h];
        partial_sum[row] = sum;
      }
    }
  }
}

// Combines the partitions of each (decode request, query head): weights l_s * 2^(m_s - M).
// grid: (num_heads, num_decode_seqs); block: HEAD_DIM. A sequence of seq_len 0 (a CUDA graph's
// padding slot) has no partition and no output row: nothing is written for it.
// A small batch has many partitions (32 for a 4k sequence in 128-key partitions, 256 at 32k): the
// threads read the partitions' (max, sum) side by side, HEAD_DIM at a time, and the weights go
// through shared memory, so no thread walks the partials one dependent load after another (the
// H100 run's batch-1 decode took 22 us a layer for 17 MB of KV).
extern "C" __global__ void __launch_bounds__(HEAD_DIM) kvt_paged_decode_reduce(
    const float* __restrict__ partial_out, const float* __restrict__ partial_max,
    const float* __restrict__ partial_sum, const int* __restrict__ query_start_loc,
    const int* __restrict__ seq_lens, int seq_offset, half_bits* __restrict__ out, i64 out_token_stride,
    i64 out_head_stride, int num_heads, int num_partitions) {
  constexpr int REDUCE_WARPS = HEAD_DIM / 32;
  __shared__ float warp_maxes[REDUCE_WARPS];
  __shared__ float weights[HEAD_DIM];  // one chunk of partitions' weights
  const int head = blockIdx.x;
  const int decode_index = blockIdx.y;
  const int seq = seq_offset + decode_index;
  const int d = threadIdx.x;
  const int seq_len = seq_lens[seq];
  if (seq_len <= 0) return;
  const int used = min(num_partitions, (seq_len + PARTITION_SIZE - 1) / PARTITION_SIZE);
  const i64 base = (static_cast<i64>(decode_index) * num_heads + head) * num_partitions;

  // The largest max of a partition with any weight: each thread takes every HEAD_DIM-th partition.
  float local_max = neg_inf();
  for (int s = d; s < used; s += HEAD_DIM)
    if (partial_sum[base + s] > 0.f) local_max = fmaxf(local_max, partial_max[base + s]);
  local_max = warp_max(local_max);
  if (d % 32 == 0) warp_maxes[d / 32] = local_max;
  __syncthreads();
  float global_max = warp_maxes[0];
#pragma unroll
  for (int w = 1; w < REDUCE_WARPS; ++w) global_max = fmaxf(global_max, warp_maxes[w]);

  float numerator = 0.f;
  float denominator = 0.f;
  for (int first = 0; first < used; first += HEAD_DIM) {
    float weight = 0.f;  // empty partitions (before the window) carry none and are never read
    if (first + d < used) {
      const float l = partial_sum[base + first + d];
      if (l > 0.f) weight = l * fast_exp2(partial_max[base + first + d] - global_max);
    }
    __syncthreads();  // every thread is done with the previous chunk's weights
    weights[d] = weight;
    __syncthreads();
    const int count = min(HEAD_DIM, used - first);
#pragma unroll 8
    for (int j = 0; j < count; ++j) {
      const float w = weights[j];  // the same for every thread: no divergence
      if (w > 0.f) {
        numerator += w * partial_out[(base + first + j) * HEAD_DIM + d];
        denominator += w;
      }
    }
  }
  const int token = query_start_loc[seq];
  out[static_cast<i64>(token) * out_token_stride + static_cast<i64>(head) * out_head_stride + d] =
      from_float(denominator > 0.f ? numerator / denominator : 0.f);
}
