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

template <typename A>
static void attention_rows_bf16(const AttentionArgs& a, const AttentionTask& t, float* scratch) {
  const int64_t group = a.num_heads / a.num_kv_heads, d = a.head_dim, nq = t.num_queries;
  const int64_t rows = nq * group, padded = round_up(rows, W), num_vectors = padded / W;
  // The prompt layout's scratch (attention_scratch_floats), laid out afresh.
  float* ot = scratch;                                              // [d][padded], values_lane order
  float* s = ot + d * padded;                                       // [kKeyTile][padded]
  float* row_max = s + kKeyTile * padded;
  float* row_sum = row_max + padded;
  float* positions = row_sum + padded;
  auto* qt2 = reinterpret_cast<uint32_t*>(positions + padded);      // [d / 2][padded]
  uint32_t* p2 = qt2 + d / 2 * padded;                              // [kKeyTile / 2][padded]
  uint32_t* vt2 = p2 + kKeyTile / 2 * padded;                       // [kKeyTile / 2][d]

  // Each row's pairs moved as 32-bit words, their bits as they are (float loads and shuffles).
  rows_into_lanes(padded, d / 2, reinterpret_cast<float*>(qt2), [&](int64_t m, int64_t e0, int64_t count) {
    return m < rows ? load_part(reinterpret_cast<const float*>(task_query<A>(a, t, m)) + e0, count) : Vec::zero();
  });
  for (int64_t m = 0; m < padded; ++m) {
    // Padding rows copy the last query's position: finite scores, never NaN; their output is dropped.
    positions[m] = static_cast<float>(t.first_position + (m < rows ? m % nq : nq - 1));
    row_max[m] = kNegInf;
    row_sum[m] = 0.0f;
  }
  for (int64_t e = 0; e < d * padded; ++e) ot[e] = 0.0f;

  TilesAhead<uint16_t> tiles(a, t);
  for (int64_t k0 = t.key_begin; k0 < t.key_end; k0 += kKeyTile) {
    const int num_keys = static_cast<int>(min64(kKeyTile, t.key_end - k0));
    const KeyTile<uint16_t>& tile = tiles.start(k0, rows_tile_steps(num_vectors, num_keys, d));
    over_row_vectors(num_vectors, [&](auto nq_vectors, int64_t v) {
      constexpr int NQ = decltype(nq_vectors)::value;
      int j = 0;
      for (; j + kBlockKeys <= num_keys; j += kBlockKeys) {
        pair_score_block<kBlockKeys, NQ>(tile.key, qt2, padded, d, s, j, static_cast<int>(v));
        tiles.step();
      }
      for (; j < num_keys; ++j) pair_score_block<1, NQ>(tile.key, qt2, padded, d, s, j, static_cast<int>(v));
    });
    rows_softmax(a, t, k0, num_keys, padded, a.scale, positions, s, row_max, row_sum, ot);

    // Weights and values in pairs of keys; an odd tile's last pair is (key, 0) with weight 0.
    const int num_pairs = (num_keys + 1) / 2;
    for (int i = 0; i < num_pairs; ++i) {
      const bool whole = 2 * i + 1 < num_keys;
      for (int64_t v = 0; v < num_vectors; ++v) {
        const Vec first = Vec::load(s + 2 * i * padded + v * W);
        const Vec second = whole ? Vec::load(s + (2 * i + 1) * padded + v * W) : Vec::zero();
        Vec::store_pairs(Vec::round_to_pairs(first, second), p2 + i * padded + v * W);
      }
      for (int64_t e = 0; e < d; e += 32) {
        typename Vec::Pairs low, high;
        const uint16_t* second = whole ? tile.value[2 * i + 1] : tile.value[2 * i];
        Vec::interleave_rows(tile.value[2 * i] + e, second + e, low, high);
        if (!whole) {  // (v, 0): the missing key's half of each pair is zero, never a stale value
          low = _mm512_and_si512(low, _mm512_set1_epi32(0xffff));
          high = _mm512_and_si512(high, _mm512_set1_epi32(0xffff));
        }
        Vec::store_pairs(low, vt2 + i * d + e);
        Vec::store_pairs(high, vt2 + i * d + e + 16);
      }
    }
    over_row_vectors(num_vectors, [&](auto nq_vectors, int64_t v) {
      constexpr int NQ = decltype(nq_vectors)::value;
      int64_t e = 0;
      for (; e + kValueDims <= d; e += kValueDims) {
        pair_value_block<kValueDims, NQ>(vt2, num_pairs, p2, padded, d, ot, e, static_cast<int>(v));
        tiles.step();
      }
      for (; e < d; ++e) pair_value_block<1, NQ>(vt2, num_pairs, p2, padded, d, ot, e, static_cast<int>(v));
    });
    tiles.finish();
  }
  if (t.partial >= 0) {
    write_task_output<A>(a, t, row_max, row_sum,
                         [&](int64_t m, int64_t e) { return ot[values_lane(e) * padded + m]; });
  } else {
    write_rows_from_lanes<A>(a, t, row_sum, [&](int64_t e) { return ot + values_lane(e) * padded; });
  }
}

#endif  // __AVX512BF16__

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
