// The prompt layout of attention (attention_rows.h) for bfloat16 queries over a bfloat16 cache, on
// AVX512-BF16's dot products of pairs: each instruction multiplies and adds two elements per lane, so
// a prompt's scores and weighted values take half the instructions of float32 fused multiply-adds,
// and keys are read where the cache holds them, never widened. Compiled where Vec::has_bf16_pairs
// (kernels_avx512_bf16.cpp); products accumulate in float32, as torch's bfloat16 products do.
//
// Scores: s[j][rows] = k[j] . q[rows], pairs along the head dimension: qt2 [head_dim / 2][padded]
// holds each row's (q[2e], q[2e + 1]), and key j's pair (k[j][2e], k[j][2e + 1]) is broadcast
// against it. Values: ot[e][rows] += v[j][e] p[j][rows], pairs along the keys: p2 [tile / 2][padded]
// holds each row's (p[2i], p[2i + 1]) rounded to bfloat16 (as flash attention rounds P for its
// bfloat16 product), and vt2 [tile / 2][head_dim] the pairs (v[2i][e], v[2i + 1][e]), built by
// in-lane interleaves that leave the head dimension permuted (values_lane) within each 32 elements;
// ot follows that order and the output is put back in order once per task.
#pragma once

#include "attention_rows.h"

namespace kvtool::cpu::KVTOOL_CPU_ISA {

template <typename A, typename C>
static constexpr bool bf16_pair_products() {
  return Vec::has_bf16_pairs && sizeof(A) == sizeof(uint16_t) && sizeof(C) == sizeof(uint16_t);
}

// Whether a head of head_dim elements takes the pair products: whole 32-element interleaves.
static inline bool pairs_fit(int64_t head_dim) { return head_dim % 32 == 0; }

// The vt2 / ot lane of element e of a head row: within each 32 elements, the 128-bit lane L's
// elements 8L + 0..3 first (the low interleave), then 8L + 4..7 (the high one).
static inline int64_t values_lane(int64_t e) {
  const int64_t chunk = e - e % 32, r = e % 32, lane = r / 8, within = r % 8;
  return chunk + (within < 4 ? 4 * lane + within : 16 + 4 * lane + within - 4);
}

#if defined(__AVX512BF16__)

// s[j][v*W..] = sum_e2 pair(k[j], e2) . qt2[e2][v*W..] for RK keys x NQ row vectors.
template <int RK, int NQ>
static inline void pair_score_block(const uint16_t* const* key, const uint32_t* qt2, int64_t padded, int64_t d,
                                    float* s, int j0, int v0) {
  Vec acc[RK][NQ];
  for (int r = 0; r < RK; ++r)
    for (int n = 0; n < NQ; ++n) acc[r][n] = Vec::zero();
  for (int64_t e2 = 0; e2 < d / 2; ++e2) {
    typename Vec::Pairs q[NQ];
    for (int n = 0; n < NQ; ++n) q[n] = Vec::load_pairs_raw(qt2 + e2 * padded + (v0 + n) * W);
    for (int r = 0; r < RK; ++r) {
      const typename Vec::Pairs k = Vec::broadcast_pair(key[j0 + r] + 2 * e2);
      for (int n = 0; n < NQ; ++n) acc[r][n] = Vec::dot_pairs(acc[r][n], k, q[n]);
    }
  }
  for (int r = 0; r < RK; ++r)
    for (int n = 0; n < NQ; ++n) acc[r][n].store(s + (j0 + r) * padded + (v0 + n) * W);
}

// ot[e][v*W..] += sum_i vt2[i][e] . p2[i][v*W..] for RD lanes of the head dimension x NQ row vectors.
template <int RD, int NQ>
static inline void pair_value_block(const uint32_t* vt2, int num_pairs, const uint32_t* p2, int64_t padded,
                                    int64_t d, float* ot, int64_t e0, int v0) {
  Vec acc[RD][NQ];
  for (int r = 0; r < RD; ++r)
    for (int n = 0; n < NQ; ++n) acc[r][n] = Vec::load(ot + (e0 + r) * padded + (v0 + n) * W);
  for (int i = 0; i < num_pairs; ++i) {
    typename Vec::Pairs p[NQ];
    for (int n = 0; n < NQ; ++n) p[n] = Vec::load_pairs_raw(p2 + i * padded + (v0 + n) * W);
    for (int r = 0; r < RD; ++r) {
      const typename Vec::Pairs v = _mm512_set1_epi32(static_cast<int>(vt2[i * d + e0 + r]));
      for (int n = 0; n < NQ; ++n) acc[r][n] = Vec::dot_pairs(acc[r][n], v, p[n]);
    }
  }
  for (int r = 0; r < RD; ++r)
    for (int n = 0; n < NQ; ++n) acc[r][n].store(ot + (e0 + r) * padded + (v0 + n) * W);
}

// Row vectors per block: kBlockRows (attention_rows.h) where that many are left, then fewer.
template <typename F>
static inline void over_row_vectors(int64_t num_vectors, F&& f) {
  int64_t v = 0;
  for (; v + kBlockRows <= num_vectors; v += kBlockRows) f(std::integral_constant<int, kBlockRows>{}, v);
  for (; v + 2 <= num_vectors; v += 2) f(std::integral_constant<int, 2>{}, v);
  for (; v < num_vectors; ++v) f(std::integral_constant<int, 1>{}, v);
}

// A prompt layout task's scratch in the pair layouts (attention_scratch_floats), laid out afresh:
// what attention_rows_bf16 and attention_rows_amx share; `rest` is free for a layout's own buffers.
struct PairTask {
  int64_t rows, padded, num_vectors;
  float* ot;         // [d][padded], values_lane order
  float* s;          // [kKeyTile][padded]
  float* row_max;    // [padded]
  float* row_sum;    // [padded]
  float* positions;  // [padded]
  uint32_t* qt2;     // [d / 2][padded]
  uint32_t* p2;      // [kKeyTile / 2][padded]
  uint32_t* vt2;     // [kKeyTile / 2][d]
  uint32_t* rest;
};

// The scratch laid out, q's pairs moved into lanes, the running max, sum and output started.
template <typename A>
static PairTask begin_pair_task(const AttentionArgs& a, const AttentionTask& t, float* scratch) {
  const int64_t group = a.num_heads / a.num_kv_heads, d = a.head_dim, nq = t.num_queries;
  PairTask p;
  p.rows = nq * group;
  p.padded = round_up(p.rows, W);
  p.num_vectors = p.padded / W;
  p.ot = scratch;
  p.s = p.ot + d * p.padded;
  p.row_max = p.s + kKeyTile * p.padded;
  p.row_sum = p.row_max + p.padded;
  p.positions = p.row_sum + p.padded;
  p.qt2 = reinterpret_cast<uint32_t*>(p.positions + p.padded);
  p.p2 = p.qt2 + d / 2 * p.padded;
  p.vt2 = p.p2 + kKeyTile / 2 * p.padded;
  p.rest = p.vt2 + kKeyTile / 2 * d;

  // Each row's pairs moved as 32-bit words, their bits as they are (float loads and shuffles).
  rows_into_lanes(p.padded, d / 2, reinterpret_cast<float*>(p.qt2), [&](int64_t m, int64_t e0, int64_t count) {
    return m < p.rows ? load_part(reinterpret_cast<const float*>(task_query<A>(a, t, m)) + e0, count) : Vec::zero();
  });
  for (int64_t m = 0; m < p.padded; ++m) {
    // Padding rows copy the last query's position: finite scores, never NaN; their output is dropped.
    p.positions[m] = static_cast<float>(t.first_position + (m < p.rows ? m % nq : nq - 1));
    p.row_max[m] = kNegInf;
    p.row_sum[m] = 0.0f;
  }
  for (int64_t e = 0; e < d * p.padded; ++e) p.ot[e] = 0.0f;
  return p;
}

// Whether pair i of a tile's num_keys keys holds two keys (an odd tile's last pair holds one).
static inline bool whole_pair(int i, int num_keys) { return 2 * i + 1 < num_keys; }

// Rows [0, num_rows) of vt2 [num_rows][d] for a key tile: pairs of its keys' values, built by
// in-lane interleaves (values_lane order); an odd tile's last pair is (v, 0), and rows past the
// tile's pairs are zeros (a zero weight times a stale value could be NaN).
static void value_pairs(const KeyTile<uint16_t>& tile, int num_keys, int num_rows, int64_t d, uint32_t* vt2) {
  const int num_pairs = (num_keys + 1) / 2;
  for (int i = 0; i < num_rows; ++i) {
    const bool whole = whole_pair(i, num_keys);
    for (int64_t e = 0; e < d; e += 32) {
      typename Vec::Pairs low = _mm512_setzero_si512(), high = _mm512_setzero_si512();
      if (i < num_pairs) {
        const uint16_t* second = whole ? tile.value[2 * i + 1] : tile.value[2 * i];
        Vec::interleave_rows(tile.value[2 * i] + e, second + e, low, high);
        if (!whole) {  // (v, 0): the missing key's half of each pair is zero, never a stale value
          low = _mm512_and_si512(low, _mm512_set1_epi32(0xffff));
          high = _mm512_and_si512(high, _mm512_set1_epi32(0xffff));
        }
      }
      Vec::store_pairs(low, vt2 + i * d + e);
      Vec::store_pairs(high, vt2 + i * d + e + 16);
    }
  }
}

// The tile's (num_keys + 1) / 2 rows of p2 and vt2, its weights in s: pairs of keys; an odd tile's
// last pair is (key, 0) with weight 0.
static void tile_pairs(const KeyTile<uint16_t>& tile, int num_keys, int64_t d, const PairTask& p) {
  const int num_pairs = (num_keys + 1) / 2;
  for (int i = 0; i < num_pairs; ++i) {
    const bool whole = whole_pair(i, num_keys);
    for (int64_t v = 0; v < p.num_vectors; ++v) {
      const Vec first = Vec::load(p.s + 2 * i * p.padded + v * W);
      const Vec second = whole ? Vec::load(p.s + (2 * i + 1) * p.padded + v * W) : Vec::zero();
      Vec::store_pairs(Vec::round_to_pairs(first, second), p.p2 + i * p.padded + v * W);
    }
  }
  value_pairs(tile, num_keys, num_pairs, d, p.vt2);
}

// The task's output rows (or its share's partial output), ot put back in order.
template <typename A>
static void end_pair_task(const AttentionArgs& a, const AttentionTask& t, const PairTask& p) {
  write_rows_from_lanes<A>(a, t, p.row_max, p.row_sum, [&](int64_t e) { return p.ot + values_lane(e) * p.padded; });
}

template <typename A>
static void attention_rows_bf16(const AttentionArgs& a, const AttentionTask& t, float* scratch) {
  const int64_t d = a.head_dim;
  const PairTask p = begin_pair_task<A>(a, t, scratch);
  TilesAhead<uint16_t> tiles(a, t);
  for (int64_t k0 = t.key_begin; k0 < t.key_end; k0 += kKeyTile) {
    const int num_keys = static_cast<int>(min64(kKeyTile, t.key_end - k0));
    const KeyTile<uint16_t>& tile = tiles.start(k0, rows_tile_steps(p.num_vectors, num_keys, d));
    over_row_vectors(p.num_vectors, [&](auto nq_vectors, int64_t v) {
      constexpr int NQ = decltype(nq_vectors)::value;
      int j = 0;
      for (; j + kBlockKeys <= num_keys; j += kBlockKeys) {
        pair_score_block<kBlockKeys, NQ>(tile.key, p.qt2, p.padded, d, p.s, j, static_cast<int>(v));
        tiles.step();
      }
      for (; j < num_keys; ++j) pair_score_block<1, NQ>(tile.key, p.qt2, p.padded, d, p.s, j, static_cast<int>(v));
    });
    rows_softmax(a, t, k0, num_keys, p.padded, a.scale, p.positions, p.s, p.row_max, p.row_sum, p.ot);
    const int num_pairs = (num_keys + 1) / 2;
    tile_pairs(tile, num_keys, d, p);
    over_row_vectors(p.num_vectors, [&](auto nq_vectors, int64_t v) {
      constexpr int NQ = decltype(nq_vectors)::value;
      int64_t e = 0;
      for (; e + kValueDims <= d; e += kValueDims) {
        pair_value_block<kValueDims, NQ>(p.vt2, num_pairs, p.p2, p.padded, d, p.ot, e, static_cast<int>(v));
        tiles.step();
      }
      for (; e < d; ++e) pair_value_block<1, NQ>(p.vt2, num_pairs, p.p2, p.padded, d, p.ot, e, static_cast<int>(v));
    });
    tiles.finish();
  }
  end_pair_task<A>(a, t, p);
}

#endif  // __AVX512BF16__

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
