// Paged context (prefill) attention: FlashAttention-2-style tiled kernel over the paged KV cache.
//
// Each CTA owns BLOCK_M = 128 consecutive new tokens (queries) of one request and one query head.
// It streams the request's keys/values out of the paged cache in tiles of BLOCK_N tokens
// (double-buffered cp.async, block table looked up per key row), computes S = Q K^T and
// O += P V with mma.sync.m16n8k16 tensor-core ops (fp16/bf16 in, fp32 accumulate) and keeps an
// online softmax in fp32. The cached prefix is read from the cache, never recomputed.
//
// Masking: the new tokens of a request are the last query_len of its seq_len tokens (causal,
// aligned bottom-right): the query at position p sees keys k <= p, and with a sliding window W
// only k > p - W. Keys past seq_len and keys in released blocks (block-table entry -1) are never
// read (zero-filled in shared memory) and masked out. A request with no query rows (query_len 0:
// a padding slot of a CUDA graph's batch) returns at once.
//
// Warp layout (FlashAttention-2's tiling): 4 warps x 32 query rows; a warp runs two m16 row
// groups, so every K/V B-fragment ldmatrix feeds 4 mma instead of 2; Q fragments are re-read from
// shared memory per k-step (keeping them in registers would not fit beside the 2 x head_dim/8
// accumulators); K and V land in separate cp.async groups (S = Q K^T starts before V arrives); a
// warp skips the math of tiles none of its rows can see (causal diagonal, window edge, rows past
// query_len); CTAs are remapped so the longest (last) query tiles of every (request, head) start
// first.
//
// Key splits (flash-decoding's split-K, for prefills over a long cached prefix): a launch of few
// CTAs (a 128-token question over a 2,048-token prefix is 32 CTAs, a quarter of an H100's SMs, each
// walking 68 key tiles in turn) splits every request's key range into num_splits runs of
// tiles_per_split tiles; each CTA writes its rows' unnormalized fp32 output and (max, sum) for its
// run, and kvt_paged_context_reduce combines the runs a row's query tile can see. num_splits 1
// writes the output directly.
//
// Specialization: KVT_HEAD_DIM, KVT_TOKENS_PER_BLOCK, KVT_DTYPE_BF16 (common.cuh), KVT_CTX_BLOCK_N
// (keys per tile: 32 at head_dim 128, where a 64-key S tile would spill past 255 registers; 64 at
// head_dim 64) and KVT_CTX_SMEM_BYTES (the launcher's dynamic shared memory, checked below).
#include "common.cuh"

#ifndef KVT_HEAD_DIM
#error "KVT_HEAD_DIM must be defined (64 or 128)"
#endif
#ifndef KVT_TOKENS_PER_BLOCK
#error "KVT_TOKENS_PER_BLOCK must be defined (a power of two)"
#endif
#ifndef KVT_CTX_BLOCK_N
#error "KVT_CTX_BLOCK_N must be defined (keys per tile)"
#endif

namespace {

using namespace kvt;

constexpr int HEAD_DIM = KVT_HEAD_DIM;
constexpr int TOKENS_PER_BLOCK = KVT_TOKENS_PER_BLOCK;
constexpr int NUM_WARPS = 4;
constexpr int NUM_THREADS = 32 * NUM_WARPS;
constexpr int ROWS_PER_WARP = 32;
constexpr int BLOCK_M = ROWS_PER_WARP * NUM_WARPS;  // query rows per CTA
constexpr int BLOCK_N = KVT_CTX_BLOCK_N;  // keys per tile
// Shared-memory rows are padded by 16 bytes: the 8 row addresses of one ldmatrix phase then fall
// on 8 distinct 16-byte bank groups (no bank conflicts) for head_dim 64 and 128.
constexpr int SMEM_ROW = HEAD_DIM + 8;
constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;  // 16-byte chunks
constexpr int K_STEPS = HEAD_DIM / 16;       // mma k-steps of S = Q K^T
constexpr int S_TILES = BLOCK_N / 8;         // n8 tiles of S per warp
constexpr int O_TILES = HEAD_DIM / 8;        // n8 tiles of O per warp

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head_dim must be 64 or 128");
static_assert((TOKENS_PER_BLOCK & (TOKENS_PER_BLOCK - 1)) == 0, "tokens_per_block must be a power of two");
static_assert(BLOCK_N % 16 == 0 && BLOCK_N >= 16, "BLOCK_N must be a multiple of 16");

// Key tiles [begin, end) the query tile starting at row m0 (rows rows) of a request with ctx_len
// cached tokens can see: causal up to its last row, from its first row's window start. The reduce
// recomputes it to know which splits wrote a row's partials.
struct KeyTiles {
  int begin;
  int end;
};
__device__ __forceinline__ KeyTiles visible_key_tiles(int ctx_len, int m0, int rows, int sliding_window) {
  const int key_end = ctx_len + m0 + rows;
  const int key_begin = sliding_window > 0 ? max(0, ctx_len + m0 - sliding_window + 1) : 0;
  return {key_begin / BLOCK_N, (key_end + BLOCK_N - 1) / BLOCK_N};
}

// The split holding key tile n (the last split takes any tiles past num_splits * tiles_per_split).
__device__ __forceinline__ int split_of_tile(int n, int tiles_per_split, int num_splits) {
  return min(n / tiles_per_split, num_splits - 1);
}

struct SharedStorage {
  half_bits q[BLOCK_M * SMEM_ROW];
  half_bits k[2][BLOCK_N * SMEM_ROW];
  half_bits v[2][BLOCK_N * SMEM_ROW];
  int key_ok[2][BLOCK_N];  // 1 where the key row holds real data (inside seq_len, block >= 0)
};

// The launcher computes the dynamic shared memory size with the same formula and passes it in:
// a mismatch is a compile error, not a silent out-of-bounds access.
#ifdef KVT_CTX_SMEM_BYTES
static_assert(sizeof(SharedStorage) == KVT_CTX_SMEM_BYTES, "launcher and kernel disagree on shared memory");
#endif

}  // namespace

// grid: (ceil(max_query_len / BLOCK_M), num_heads, num_context_seqs * num_splits), but the CTA's
// (query tile, head, split, request) comes from its linear launch index: heads vary fastest (the
// query heads of one GQA group run side by side and share K/V in L2), then splits, query tiles
// slowest and reversed, so the tiles with the most keys (the last ones under the causal mask)
// launch first and the short ones fill in the tail. block: 128 threads; dynamic shared memory:
// sizeof(SharedStorage). With num_splits > 1 the output goes to partial_acc
// [num_tokens, num_heads, num_splits, HEAD_DIM] and partial_ml [num_tokens, num_heads, num_splits, 2]
// (max in the log2 domain, sum), fp32, for kvt_paged_context_reduce.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 2) kvt_paged_context_attention(
    const half_bits* __restrict__ query, i64 q_token_stride, i64 q_head_stride,  // [num_tokens, num_heads, hd]
    const half_bits* __restrict__ kv_cache, i64 block_stride, i64 kv_stride, i64 token_stride,
    i64 head_stride,                                          // [num_blocks, 2, tpb, kvh, hd] strided
    const int* __restrict__ block_tables, i64 block_table_stride,  // [num_seqs, max_blocks], -1 padded
    const int* __restrict__ query_start_loc,                       // [num_seqs + 1]
    const int* __restrict__ seq_lens,                              // [num_seqs]
    half_bits* __restrict__ out, i64 out_token_stride, i64 out_head_stride,  // [num_tokens, num_heads, hd]
    float* __restrict__ partial_acc, float* __restrict__ partial_ml, int tiles_per_split, int num_splits,
    int num_heads, int num_kv_heads, float scale_log2, int sliding_window) {
  extern __shared__ uint4 smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  constexpr int GROUPS = 2;  // m16 row groups per warp

  const unsigned per_tile = gridDim.y * gridDim.z;  // CTAs per query-tile index
  const unsigned linear = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int m_tile = static_cast<int>(gridDim.x - 1 - linear / per_tile);
  const unsigned rest = linear % per_tile;
  const int head = static_cast<int>(rest % gridDim.y);
  const int seq = static_cast<int>(rest / gridDim.y) / num_splits;
  const int split = static_cast<int>(rest / gridDim.y) % num_splits;

  const int q_begin = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_begin;
  const int m0 = m_tile * BLOCK_M;
  if (m0 >= q_len) return;  // whole CTA: this request has fewer query tiles
  const int seq_len = seq_lens[seq];
  const int ctx_len = seq_len - q_len;  // tokens cached before this chunk
  if (ctx_len < 0) return;              // inconsistent metadata: leave the output untouched
  const int kv_head = head / (num_heads / num_kv_heads);
  const int rows = min(BLOCK_M, q_len - m0);

  // Key tiles any query of this tile can see, cut to this CTA's split.
  const KeyTiles visible = visible_key_tiles(ctx_len, m0, rows, sliding_window);
  int tile_begin = visible.begin;
  int tile_end = visible.end;
  if (num_splits > 1) {
    tile_begin = max(tile_begin, split * tiles_per_split);
    if (split < num_splits - 1) tile_end = min(tile_end, (split + 1) * tiles_per_split);
    if (tile_begin >= tile_end) return;  // the reduce reads no partials of this split for these rows
  }

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int group = lane >> 2;   // mma groupID: fragment row
  const int quad = lane & 3;     // mma threadID_in_group: fragment column pair
  const int mat = lane >> 3;     // ldmatrix: which 8x8 matrix this lane addresses
  const int mat_row = lane & 7;  // ldmatrix: which row of it

  const int* block_table = block_tables + static_cast<i64>(seq) * block_table_stride;
  const half_bits* kv_head_base = kv_cache + static_cast<i64>(kv_head) * head_stride;

  // ---- Q tile -> shared (rows past the request's queries are zero) ----
  for (int idx = tid; idx < BLOCK_M * CHUNKS_PER_ROW; idx += NUM_THREADS) {
    const int r = idx / CHUNKS_PER_ROW;
    const int c = idx % CHUNKS_PER_ROW;
    const bool valid = r < rows;
    const half_bits* src = valid ? query + static_cast<i64>(q_begin + m0 + r) * q_token_stride +
                                       static_cast<i64>(head) * q_head_stride + c * 8
                                 : query;
    cp_async_16(&smem.q[r * SMEM_ROW + c * 8], src, valid);
  }
  cp_async_commit();

  // ---- K (is_v = false, plus the key-validity flags) or V of tile n -> shared buffer `buf` ----
  auto load_tile = [&](int n, int buf, bool is_v) {
    for (int idx = tid; idx < BLOCK_N * CHUNKS_PER_ROW; idx += NUM_THREADS) {
      const int r = idx / CHUNKS_PER_ROW;
      const int c = idx % CHUNKS_PER_ROW;
      const int key = n * BLOCK_N + r;
      const int block = key < seq_len ? block_table[key / TOKENS_PER_BLOCK] : -1;
      const bool valid = block >= 0;
      const half_bits* src = kv_head_base;
      if (valid) {
        src = kv_head_base + static_cast<i64>(block) * block_stride +
              static_cast<i64>(key % TOKENS_PER_BLOCK) * token_stride + (is_v ? kv_stride : 0) + c * 8;
      }
      if (is_v) {
        cp_async_16(&smem.v[buf][r * SMEM_ROW + c * 8], src, valid);
      } else {
        cp_async_16(&smem.k[buf][r * SMEM_ROW + c * 8], src, valid);
        if (c == 0) smem.key_ok[buf][r] = valid ? 1 : 0;
      }
    }
  };

  // cp.async groups, oldest first: Q, K(begin), V(begin), then per tile n one K(n+1) and one V(n+1)
  // group (empty past the last tile, so "wait until one group is pending" always means the same).
  load_tile(tile_begin, 0, false);
  cp_async_commit();
  load_tile(tile_begin, 0, true);
  cp_async_commit();

  float acc[GROUPS][O_TILES][4];
#pragma unroll
  for (int g = 0; g < GROUPS; ++g)
#pragma unroll
    for (int i = 0; i < O_TILES; ++i) acc[g][i][0] = acc[g][i][1] = acc[g][i][2] = acc[g][i][3] = 0.f;
  // Running max (log2 domain) and partial row sums; index 2 * g + h is row 16 g + 8 h + `group`.
  float row_max[2 * GROUPS], row_sum[2 * GROUPS];
#pragma unroll
  for (int r = 0; r < 2 * GROUPS; ++r) {
    row_max[r] = neg_inf();
    row_sum[r] = 0.f;
  }
  const int warp_first_pos = ctx_len + m0 + warp * ROWS_PER_WARP;
  const int warp_last_pos = warp_first_pos + ROWS_PER_WARP - 1;
  const bool warp_has_rows = warp * ROWS_PER_WARP < rows;

  for (int n = tile_begin; n < tile_end; ++n) {
    const int buf = (n - tile_begin) & 1;
    const int tile_first_key = n * BLOCK_N;
    const int tile_last_key = tile_first_key + BLOCK_N - 1;

    cp_async_wait<1>();  // Q and K(n) have landed (V(n) may be in flight)
    __syncthreads();     // ... for every thread; and everyone is done with K(n-1) and V(n-1)
    if (n + 1 < tile_end) load_tile(n + 1, buf ^ 1, false);
    cp_async_commit();

    // A warp whose rows see no key of this tile skips its math: a wholly masked tile would leave
    // its state unchanged anyway (alpha = 1, p = 0).
    const bool active = warp_has_rows && tile_first_key <= warp_last_pos &&
                        (sliding_window <= 0 || tile_last_key > warp_first_pos - sliding_window);

    // ---- S = Q K^T for this warp's 32 rows x BLOCK_N keys (raw, unscaled) ----
    // This lane's ldmatrix row addresses (shared state space, bytes) for k-step 0 of row group 0 /
    // key 0 / dim 0; the unrolled loops add constants.
    const unsigned q_lane_addr =
        smem_addr(&smem.q[(warp * ROWS_PER_WARP + (mat & 1) * 8 + mat_row) * SMEM_ROW + (mat >> 1) * 8]);
    const unsigned k_lane_addr = smem_addr(&smem.k[buf][((mat >> 1) * 8 + mat_row) * SMEM_ROW + (mat & 1) * 8]);
    const unsigned v_lane_addr = smem_addr(&smem.v[buf][((mat & 1) * 8 + mat_row) * SMEM_ROW + (mat >> 1) * 8]);
    float s[GROUPS][S_TILES][4];
#pragma unroll
    for (int g = 0; g < GROUPS; ++g)
#pragma unroll
      for (int i = 0; i < S_TILES; ++i) s[g][i][0] = s[g][i][1] = s[g][i][2] = s[g][i][3] = 0.f;
    if (active) {
#pragma unroll
      for (int kk = 0; kk < K_STEPS; ++kk) {
        unsigned qa[GROUPS][4];
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) {
          // matrices: 0 = rows 0-7 / k 0-7, 1 = rows 8-15 / k 0-7, 2 = rows 0-7 / k 8-15, 3 = rows 8-15 / k 8-15
          ldmatrix_x4_shared(qa[g][0], qa[g][1], qa[g][2], qa[g][3],
                             q_lane_addr + (g * 16 * SMEM_ROW + kk * 16) * 2);
        }
#pragma unroll
        for (int np = 0; np < S_TILES / 2; ++np) {
          // matrices: 0 = keys 0-7 / dims 0-7, 1 = keys 0-7 / dims 8-15, 2 = keys 8-15 / dims 0-7, 3 = keys 8-15 / dims 8-15
          unsigned b0, b1, b2, b3;
          ldmatrix_x4_shared(b0, b1, b2, b3, k_lane_addr + (np * 16 * SMEM_ROW + kk * 16) * 2);
#pragma unroll
          for (int g = 0; g < GROUPS; ++g) {
            mma_16816(s[g][2 * np], qa[g][0], qa[g][1], qa[g][2], qa[g][3], b0, b1);
            mma_16816(s[g][2 * np + 1], qa[g][0], qa[g][1], qa[g][2], qa[g][3], b2, b3);
          }
        }
      }
    }

    cp_async_wait<1>();  // V(n) has landed (K(n+1) may be in flight)
    __syncthreads();
    if (n + 1 < tile_end) load_tile(n + 1, buf ^ 1, true);
    cp_async_commit();
    if (!active) continue;

    // ---- mask, online softmax in the log2 domain ----
    // Interior tiles (every key real and visible to all 32 rows of this warp) skip the per-element
    // mask. The max is taken over the raw scores (scale_log2 > 0, so scaling keeps the order) and
    // p = 2^(s * scale_log2 - max) is one fma + ex2.
    bool all_keys_ok = true;
#pragma unroll
    for (int r = lane; r < BLOCK_N; r += 32) all_keys_ok = all_keys_ok && smem.key_ok[buf][r];
    const bool interior = __all_sync(0xffffffffu, all_keys_ok) && tile_last_key <= warp_first_pos &&
                          (sliding_window <= 0 ||
                           tile_first_key > warp_first_pos + ROWS_PER_WARP - 1 - sliding_window);
    float tile_max[2 * GROUPS];
#pragma unroll
    for (int r = 0; r < 2 * GROUPS; ++r) tile_max[r] = neg_inf();
    if (interior) {
#pragma unroll
      for (int g = 0; g < GROUPS; ++g)
#pragma unroll
        for (int i = 0; i < S_TILES; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) tile_max[2 * g + (e >> 1)] = fmaxf(tile_max[2 * g + (e >> 1)], s[g][i][e]);
    } else {
#pragma unroll
      for (int g = 0; g < GROUPS; ++g) {
#pragma unroll
        for (int i = 0; i < S_TILES; ++i) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = i * 8 + quad * 2 + (e & 1);
            const int key = tile_first_key + col;
            const int pos = warp_first_pos + g * 16 + (e >> 1) * 8 + group;
            const bool visible =
                smem.key_ok[buf][col] && key <= pos && (sliding_window <= 0 || key > pos - sliding_window);
            s[g][i][e] = visible ? s[g][i][e] : neg_inf();
            tile_max[2 * g + (e >> 1)] = fmaxf(tile_max[2 * g + (e >> 1)], s[g][i][e]);
          }
        }
      }
    }
    float alpha[2 * GROUPS], base[2 * GROUPS];
#pragma unroll
    for (int r = 0; r < 2 * GROUPS; ++r) {
      // The 4 threads of a group hold the same rows: reduce across them.
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float new_max = fmaxf(row_max[r], tile_max[r] * scale_log2);
      // A row that has seen no visible key yet keeps max -inf: subtract 0 instead (no inf - inf).
      base[r] = new_max == neg_inf() ? 0.f : new_max;
      alpha[r] = fast_exp2(row_max[r] - base[r]);  // exp2(-inf) = 0 on the first visible tile
      row_max[r] = new_max;
      row_sum[r] *= alpha[r];
    }
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) {
#pragma unroll
      for (int i = 0; i < S_TILES; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 2 * g + (e >> 1);
          s[g][i][e] = fast_exp2(fmaf(s[g][i][e], scale_log2, -base[r]));
          row_sum[r] += s[g][i][e];
        }
      }
#pragma unroll
      for (int i = 0; i < O_TILES; ++i) {
        acc[g][i][0] *= alpha[2 * g];
        acc[g][i][1] *= alpha[2 * g];
        acc[g][i][2] *= alpha[2 * g + 1];
        acc[g][i][3] *= alpha[2 * g + 1];
      }
    }

    // ---- O += P V: the S accumulators of two adjacent n8 tiles are one A fragment ----
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      unsigned pa[GROUPS][4];
#pragma unroll
      for (int g = 0; g < GROUPS; ++g) {
        pa[g][0] = pack2(s[g][2 * kk][0], s[g][2 * kk][1]);
        pa[g][1] = pack2(s[g][2 * kk][2], s[g][2 * kk][3]);
        pa[g][2] = pack2(s[g][2 * kk + 1][0], s[g][2 * kk + 1][1]);
        pa[g][3] = pack2(s[g][2 * kk + 1][2], s[g][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < O_TILES / 2; ++dp) {
        // transposed matrices: 0 = keys 0-7 / dims 0-7, 1 = keys 8-15 / dims 0-7,
        //                      2 = keys 0-7 / dims 8-15, 3 = keys 8-15 / dims 8-15
        unsigned b0, b1, b2, b3;
        ldmatrix_x4_trans_shared(b0, b1, b2, b3, v_lane_addr + (kk * 16 * SMEM_ROW + dp * 16) * 2);
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) {
          mma_16816(acc[g][2 * dp], pa[g][0], pa[g][1], pa[g][2], pa[g][3], b0, b1);
          mma_16816(acc[g][2 * dp + 1], pa[g][0], pa[g][1], pa[g][2], pa[g][3], b2, b3);
        }
      }
    }
  }

  // ---- normalize and store ----
#pragma unroll
  for (int r = 0; r < 2 * GROUPS; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
  }
  if (num_splits > 1) {
    // Unnormalized rows and their (max, sum): a row that saw no key of this split writes (-inf, 0).
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = warp * ROWS_PER_WARP + g * 16 + h * 8 + group;
        if (r < rows) {
          const i64 slot = (static_cast<i64>(q_begin + m0 + r) * num_heads + head) * num_splits + split;
          float* dst = partial_acc + slot * HEAD_DIM + quad * 2;
#pragma unroll
          for (int i = 0; i < O_TILES; ++i)
            *reinterpret_cast<float2*>(dst + i * 8) = make_float2(acc[g][i][2 * h], acc[g][i][2 * h + 1]);
          if (quad == 0)
            *reinterpret_cast<float2*>(partial_ml + slot * 2) = make_float2(row_max[2 * g + h], row_sum[2 * g + h]);
        }
      }
    }
    return;
  }
  half_bits* out_head = out + static_cast<i64>(head) * out_head_stride + quad * 2;
#pragma unroll
  for (int g = 0; g < GROUPS; ++g) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp * ROWS_PER_WARP + g * 16 + h * 8 + group;
      const float inv = row_sum[2 * g + h] > 0.f ? 1.f / row_sum[2 * g + h] : 0.f;
      if (r < rows) {
        half_bits* dst = out_head + static_cast<i64>(q_begin + m0 + r) * out_token_stride;
#pragma unroll
        for (int i = 0; i < O_TILES; ++i)
          *reinterpret_cast<unsigned*>(dst + i * 8) = pack2(acc[g][i][2 * h] * inv, acc[g][i][2 * h + 1] * inv);
      }
    }
  }
}

// Combines the key splits of kvt_paged_context_attention: for each row, the splits its query tile
// saw, each weighted by 2^(its max - the rows' max) (flash-decoding's reduce), normalized once.
// grid: (max_query_len, num_context_seqs); block: 128 threads, warp w combining heads w, w + 4, ...
// (32 lanes x HEAD_DIM / 32 dims). Rows past a request's query_len (a graph's padding) return.
constexpr int REDUCE_THREADS = 128;
constexpr int DIMS_PER_LANE = HEAD_DIM / 32;

extern "C" __global__ void __launch_bounds__(REDUCE_THREADS) kvt_paged_context_reduce(
    const float* __restrict__ partial_acc, const float* __restrict__ partial_ml,  // as the kernel above
    const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
    half_bits* __restrict__ out, i64 out_token_stride, i64 out_head_stride,  // [num_tokens, num_heads, hd]
    int tiles_per_split, int num_splits, int num_heads, int sliding_window) {
  const int seq = blockIdx.y;
  const int row = blockIdx.x;  // query row within the request
  const int q_begin = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_begin;
  if (row >= q_len) return;
  const int ctx_len = seq_lens[seq] - q_len;
  if (ctx_len < 0) return;  // as the kernel above: inconsistent metadata leaves the output untouched
  const int m0 = row / BLOCK_M * BLOCK_M;
  const KeyTiles visible = visible_key_tiles(ctx_len, m0, min(BLOCK_M, q_len - m0), sliding_window);
  const int split_begin = split_of_tile(visible.begin, tiles_per_split, num_splits);
  const int split_last = split_of_tile(visible.end - 1, tiles_per_split, num_splits);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const i64 token = q_begin + row;
  for (int head = warp; head < num_heads; head += REDUCE_THREADS / 32) {
    const i64 slots = (token * num_heads + head) * num_splits;
    // Two passes of independent loads (no split's read waits for another's): the max over the
    // splits in which the row saw a key, then the weighted sums. Every split of the range wrote
    // every row of the tile (a row that saw no key of it: max -inf, sum 0, output 0).
    float row_max = neg_inf();
#pragma unroll 4
    for (int s = split_begin; s <= split_last; ++s) {
      const float2 ml = *reinterpret_cast<const float2*>(partial_ml + (slots + s) * 2);
      row_max = ml.y > 0.f ? fmaxf(row_max, ml.x) : row_max;
    }
    float row_sum = 0.f, o[DIMS_PER_LANE];
#pragma unroll
    for (int d = 0; d < DIMS_PER_LANE; ++d) o[d] = 0.f;
#pragma unroll 4
    for (int s = split_begin; s <= split_last; ++s) {
      const float2 ml = *reinterpret_cast<const float2*>(partial_ml + (slots + s) * 2);
      const float weight = ml.y > 0.f ? fast_exp2(ml.x - row_max) : 0.f;
      row_sum += ml.y * weight;
      const float* acc = partial_acc + (slots + s) * HEAD_DIM + lane * DIMS_PER_LANE;
#pragma unroll
      for (int d = 0; d < DIMS_PER_LANE; ++d) o[d] += acc[d] * weight;
    }
    const float inv = row_sum > 0.f ? 1.f / row_sum : 0.f;
    half_bits* dst = out + token * out_token_stride + static_cast<i64>(head) * out_head_stride + lane * DIMS_PER_LANE;
#pragma unroll
    for (int d = 0; d < DIMS_PER_LANE; d += 2)
      *reinterpret_cast<unsigned*>(dst + d) = pack2(o[d] * inv, o[d + 1] * inv);
  }
}
