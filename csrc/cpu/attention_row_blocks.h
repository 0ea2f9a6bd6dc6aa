// The prompt layout of attention on the vector unit with a block of query rows in registers (the
// AVX2 and AVX-512 builds; head_dim a whole number of vectors): what a task of many rows (a prompt
// chunk, a hit's new tokens, decode rows sharing a prefix) runs where neither AMX tiles nor
// AVX512-BF16 pair products take it: a float32 cache on every x86 CPU, a bfloat16 one on those
// without native bfloat16 products (row_blocks_fit: on AVX2 not every task). The portable build
// keeps attention_rows.h.
//
// Both products are register-blocked as a GEMM is. A block of 64 keys is transposed once a task, keys
// along the lanes (kt [head_dim][64]); a block of 6 rows takes its scores [6][64] in 24 registers,
// each query element broadcast against 4 vectors of keys, and keeps them there through the masking
// and the softmax; its weighted values then accumulate [6][64 head dims] in 24 more, each weight
// broadcast against a value row read from the cache as it lies. AVX2's 16 registers take the scores
// 2 vectors of keys a pass (12 accumulators), the 6 x 8 vectors of a block's scores then held on the
// stack through the softmax, and the values 2 head vectors a pass. Rows whose queries precede a block
// (the causal upper triangle) skip it. The rows-in-lanes layout kept its scores and outputs in memory
// ([keys][rows], [head_dim][rows]), a vector loaded or stored for every four multiply-adds. On the
// family 6 model 207 Xeon, alternated call by call in one process (two threads, SmolLM2-135M's
// shapes): a 1,053-token float32 prompt's layer 0.86x the time (amx build) and 0.89x (avx512; a
// bfloat16 cache there too), a 32-token hit over 1,024 cached tokens 0.83-0.88x, 8 decode rows
// sharing a 1,024-token prefix 0.78-0.84x, a whole float32 miss step 0.98x
// (results/cpu_attention.md).
#pragma once

#include "attention_rows.h"
#include "kernels_common.h"

namespace kvtool::cpu::KVTOOL_CPU_ISA {

// Rows a block, key vectors a block of keys (two key tiles: 64 keys), key vectors a pass of the
// scores and head-dimension vectors a pass of the weighted values: on AVX-512 a block's 6 x 4 scores
// stay in registers from their products through the softmax, and its value sums are 6 x 4 registers
// beside 4 value vectors and a broadcast weight (29 of its 32 registers); on AVX2 a pass is 6 x 2
// beside 2 and 1 (15 of 16).
constexpr int kRowBlock = 6;
constexpr int kRowBlockKeys = 2 * kKeyTile;
constexpr int kRowBlockVectors = kRowBlockKeys / W;
constexpr int kScoreVectors = W >= 16 ? 4 : 2;
constexpr int kValueVectors = W >= 16 ? 4 : 2;

// Whether task t takes the blocks: head_dim whole vectors, and on AVX2 (8 lanes, where a block's key
// transpose and softmax weigh more) not where the task's rows fill the rows-in-lanes layout's
// register blocks exactly (kBlockRows row vectors: 24 rows, 48, ...). On the family 25 model
// 17 EPYC, AVX2 blocks against that layout (alternated in one process, two threads): a 1,053-token
// prompt's layer (tasks of 126 rows) 0.886x the time; hits' tasks of 18, 27 or 126 rows 0.86-0.95x;
// but tasks of 24 and 72 rows (a 32-token hit's) 1.03x, of 24 rows (8 decode rows sharing a prefix)
// 1.02x, of 48 rows 0.99x (results/cpu_attention.md).
static inline bool row_blocks_fit(const AttentionArgs& a, const AttentionTask& t) {
  const int64_t rows = static_cast<int64_t>(t.num_queries) * (a.num_heads / a.num_kv_heads);
  return a.head_dim % W == 0 && (W >= 16 || rows % (kBlockRows * W) != 0);
}

#if defined(__AVX2__)
static_assert(kRowBlockVectors % kScoreVectors == 0, "a block of keys is whole passes of the scores");
static_assert(kRowBlock <= W, "a block's rows are rescaled as the lanes of one vector");

#if defined(__AVX512DQ__)
// e^x for a weight's exponent x = score - the row's max (<= 0; -inf where masked): 2^(x log2 e) as
// x log2 e = n + f, n = floor (vreduceps leaves f exactly), 2^f by a degree-5 polynomial (relative
// error 1.6e-7, about Vec::exp's) and 2^n by vscalefps: 8 instructions where Vec::exp takes 17. An
// exponent below -87 (a weight under 2^-125) gives exactly 0, as Vec::exp does below its range,
// rather than a denormal, which the value products would take at a fraction of their speed
// (vscalefps alone already gives 0 for a masked score's -inf).
static inline Vec weight_exp(Vec x) {
  const __m512 y = _mm512_mul_ps(x.v, _mm512_set1_ps(kLog2e));
  const __mmask16 weighs = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-125.0f), _CMP_GT_OQ);
  const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.8775727e-3f), f, _mm512_set1_ps(8.9893444e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5826318e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4015361e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9315308e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999994e-1f));
  return {_mm512_maskz_scalef_ps(weighs, p, y)};
}
#else
// AVX2 has neither vreduceps nor vscalefps: Vec::exp, which gives 0 below its range too.
static inline Vec weight_exp(Vec x) { return Vec::exp(x); }
#endif

// o [R][d] (rows d apart), head dims [e0, e0 + DV * W): scaled by alpha[r], plus the block's weighted
// values (p [R][kRowBlockKeys] weights).
template <int R, int DV>
static inline void block_values(const float* const* value, int num_keys, const float* p, const float* alpha,
                                float* o, int64_t d, int64_t e0) {
  Vec acc[R][DV];
  for (int r = 0; r < R; ++r) {
    Vec scale = Vec::set1(alpha[r]);
    for (int v = 0; v < DV; ++v) acc[r][v] = Vec::load(o + r * d + e0 + v * W) * scale;
  }
  for (int j = 0; j < num_keys; ++j) {
    Vec x[DV];
    for (int v = 0; v < DV; ++v) x[v] = Vec::load(value[j] + e0 + v * W);
    for (int r = 0; r < R; ++r) {
      Vec w = Vec::set1(p[r * kRowBlockKeys + j]);
      for (int v = 0; v < DV; ++v) acc[r][v] = Vec::fma(w, x[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < DV; ++v) acc[r][v].store(o + r * d + e0 + v * W);
}

// What a block of rows needs of its task and the current block of keys.
struct KeyBlock {
  const float* kt;            // [d][kRowBlockKeys]
  const float* const* value;  // the block's value rows, float32
  const Vec* key_positions;   // [kRowBlockVectors]: each lane's key position; +inf past the block's keys
  int64_t k0;
  int num_keys;
};

// Rows [m0, m0 + R) of the task over one block of keys: scores (in registers), the online softmax
// (each row's running max and its sum of weights, kept as W lanes row_sums [rows][W] added up once
// at the end; its output so far rescaled), weighted values. A row that has seen no visible key yet
// keeps max -inf, and its weights come out 0 rather than NaN.
template <int R>
static inline void row_block(const AttentionArgs& a, const AttentionTask& t, const KeyBlock& keys, int64_t m0,
                             const float* q, float* o, float* row_max, float* row_sums, float* p) {
  const int64_t d = a.head_dim, window = a.sliding_window;
  float position[R];
  float first = __builtin_inff(), last = -__builtin_inff();
  for (int r = 0; r < R; ++r) {
    position[r] = static_cast<float>(t.first_position + (m0 + r) % t.num_queries);
    first = position[r] < first ? position[r] : first;
    last = position[r] > last ? position[r] : last;
  }
  const float keys_first = static_cast<float>(keys.k0), keys_last = static_cast<float>(keys.k0 + keys.num_keys - 1);
  if (keys_first > last) return;  // every key after every row's query
  if (window > 0 && keys_last <= first - static_cast<float>(window)) return;  // before every row's window

  Vec s[R][kRowBlockVectors];  // [rows][keys]: in registers on AVX-512 (one pass), on the stack on AVX2
  for (int v0 = 0; v0 < kRowBlockVectors; v0 += kScoreVectors) {
    Vec acc[R][kScoreVectors];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kScoreVectors; ++v) acc[r][v] = Vec::zero();
    const float* k = keys.kt + v0 * W;
    for (int64_t e = 0; e < d; ++e, k += kRowBlockKeys) {
      Vec key[kScoreVectors];
      for (int v = 0; v < kScoreVectors; ++v) key[v] = Vec::load(k + v * W);
      for (int r = 0; r < R; ++r) {
        Vec x = Vec::set1(q[(m0 + r) * d + e]);
        for (int v = 0; v < kScoreVectors; ++v) acc[r][v] = Vec::fma(x, key[v], acc[r][v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kScoreVectors; ++v) s[r][v0 + v] = acc[r][v];
  }
  const bool masked = keys.num_keys < kRowBlockKeys || keys_last > first ||
                      (window > 0 && keys_first <= last - static_cast<float>(window));
  if (masked) {
    for (int r = 0; r < R; ++r) {
      const Vec query_position = Vec::set1(position[r]);
      for (int v = 0; v < kRowBlockVectors; ++v) {
        typename Vec::Mask visible = Vec::le(keys.key_positions[v], query_position);
        if (window > 0) {
          visible = Vec::mask_and(visible, Vec::gt(keys.key_positions[v],
                                                   query_position - Vec::set1(static_cast<float>(window))));
        }
        s[r][v] = Vec::select(visible, s[r][v], Vec::set1(kNegInf));
      }
    }
  }
  // Every row's new max and rescaling at once (one vector exp for the block).
  alignas(64) float block_max[W], shift[W], alpha[W];
  for (int r = 0; r < R; ++r) {
    Vec m = s[r][0];
    for (int v = 1; v < kRowBlockVectors; ++v) m = Vec::max(m, s[r][v]);
    block_max[r] = m.reduce_max();
  }
  const Rescale rescaled = rescale(Vec::load_n(row_max + m0, R), Vec::load_n(block_max, R));
  rescaled.max.store_n(row_max + m0, R);
  rescaled.shift.store(shift);
  rescaled.alpha.store(alpha);
  for (int r = 0; r < R; ++r) {
    float* sums = row_sums + (m0 + r) * W;
    const Vec row_shift_r = Vec::set1(shift[r]);
    Vec sum = Vec::load(sums) * Vec::set1(alpha[r]);
    for (int v = 0; v < kRowBlockVectors; ++v) {
      const Vec weight = weight_exp(s[r][v] - row_shift_r);
      weight.store(p + r * kRowBlockKeys + v * W);
      sum = sum + weight;
    }
    sum.store(sums);
  }
  for (int64_t e0 = 0; e0 < d; e0 += kValueVectors * W) {
    with_count<kValueVectors>(min64(kValueVectors, (d - e0) / W), [&](auto dv) {
      block_values<R, decltype(dv)::value>(keys.value, keys.num_keys, p, alpha, o + m0 * d, d, e0);
    });
  }
}

template <typename A, typename C>
static void attention_row_blocks(const AttentionArgs& a, const AttentionTask& t, float* scratch) {
  const int64_t group = a.num_heads / a.num_kv_heads, d = a.head_dim, rows = t.num_queries * group;
  float* q = scratch;                           // [rows][d], scaled
  float* o = q + rows * d;                      // [rows][d], unnormalised
  float* row_max = o + rows * d;                // [rows]
  float* row_sums = row_max + rows;             // [rows][W]: each row's sum of weights, W lanes of it
  float* kt = row_sums + rows * W;              // [d][kRowBlockKeys]
  float* p = kt + d * kRowBlockKeys;            // [kRowBlock][kRowBlockKeys]: a block's weights
  float* vbuf = p + kRowBlock * kRowBlockKeys;  // [kRowBlockKeys][d]: values widened from a bfloat16 cache

  const Vec scale = Vec::set1(a.scale);
  for (int64_t m = 0; m < rows; ++m) {
    const A* query = task_query<A>(a, t, m);
    for (int64_t e = 0; e < d; e += W) (Vec::load(query + e) * scale).store(q + m * d + e);
    row_max[m] = kNegInf;
    Vec::zero().store(row_sums + m * W);
  }
  for (int64_t e = 0; e < rows * d; e += W) Vec::zero().store(o + e);

  alignas(64) float lane_index[W];
  for (int i = 0; i < W; ++i) lane_index[i] = static_cast<float>(i);
  Vec key_positions[kRowBlockVectors];
  const C* key[kRowBlockKeys];
  const float* value[kRowBlockKeys];
  TilesAhead<C> tiles(a, t);
  const int64_t num_blocks = (rows + kRowBlock - 1) / kRowBlock;
  for (int64_t k0 = t.key_begin; k0 < t.key_end; k0 += kRowBlockKeys) {
    // The block's two tiles; the second's start asks for the next block's first tile over the rows.
    int num_keys = 0;
    for (int half = 0; half < 2 && k0 + half * kKeyTile < t.key_end; ++half) {
      if (half == 1) tiles.finish();
      const KeyTile<C>& tile = tiles.start(k0 + half * kKeyTile, half == 0 ? 1 : num_blocks);
      for (int j = 0; j < tile.num_keys; ++j, ++num_keys) {
        key[num_keys] = tile.key[j];
        if constexpr (sizeof(C) == sizeof(float)) {
          value[num_keys] = tile.value[j];
        } else {
          copy_converted(tile.value[j], vbuf + num_keys * d, d);
          value[num_keys] = vbuf + num_keys * d;
        }
      }
    }
    // kt [d][kRowBlockKeys]: key j's element e at kt[e * kRowBlockKeys + j], keys past the block's zeros.
    rows_into_lanes(kRowBlockKeys, d, kt, [&](int64_t j, int64_t e0, int64_t count) {
      return j < num_keys ? load_part(key[j] + e0, count) : Vec::zero();
    });
    for (int v = 0; v < kRowBlockVectors; ++v) {
      const Vec index = Vec::load(lane_index) + Vec::set1(static_cast<float>(v * W));
      key_positions[v] = Vec::select(Vec::le(index, Vec::set1(static_cast<float>(num_keys - 1))),
                                     index + Vec::set1(static_cast<float>(k0)), Vec::set1(__builtin_inff()));
    }
    const KeyBlock block{kt, value, key_positions, k0, num_keys};
    for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
      with_count<kRowBlock>(min64(kRowBlock, rows - m0), [&](auto n) {
        row_block<decltype(n)::value>(a, t, block, m0, q, o, row_max, row_sums, p);
      });
      tiles.step();
    }
    tiles.finish();
  }

  for (int64_t m = 0; m < rows; ++m) {
    const float* sums = o + m * d;
    const float row_sum = Vec::load(row_sums + m * W).reduce_add();
    if (t.partial >= 0) {
      const PartialRow partial = partial_row(a, t, rows, m);
      for (int64_t e = 0; e < d; e += W) Vec::load(sums + e).store(partial.out + e);
      partial.stats[0] = row_max[m];
      partial.stats[1] = row_sum;
      continue;
    }
    A* out = task_output<A>(a, t, m);
    const Vec inv_sum = Vec::set1(1.0f / row_sum);
    for (int64_t e = 0; e < d; e += W) (Vec::load(sums + e) * inv_sum).store(out + e);
  }
}
#endif

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
