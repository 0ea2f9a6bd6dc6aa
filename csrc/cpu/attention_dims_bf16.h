// The decode layout of attention (attention_dims.h) for bfloat16 queries over a bfloat16 cache, on
// AVX512-BF16's dot products of pairs, as the prompt layout has them (attention_rows_bf16.h): a
// decode step's attention computes more than it reads at one token, and the pairs halve its
// instructions. Compiled where Vec::has_bf16_pairs (kernels_avx512_bf16.cpp); products accumulate in
// float32.
//
// Scores: pairs along the head dimension. A query row is kept as the model gave it (its bfloat16
// pairs, unscaled) and a key row is read as it lies, 32 elements a vector, no widening; the scale
// multiplies the scores. Values: pairs along the keys. Each row's weights are rounded to bfloat16 (as
// flash attention rounds P for its bfloat16 product; the softmax's sum keeps them in float32), and
// two keys' value rows are interleaved in-lane into pairs (Vec::interleave_rows), which leaves the
// head dimension of o permuted within each 32 elements (values_lane); the output is put back in order
// once per task.
#pragma once

#include "attention_dims.h"
#include "attention_rows_bf16.h"

namespace kvtool::cpu::KVTOOL_CPU_ISA {

#if defined(__AVX512BF16__)

// The pair vectors (32 bfloat16 elements each) a call holds in registers per row: head_dim chunks of
// at most 128 elements for the scores, 64 for the values (two accumulators a vector there).
constexpr int kMaxScorePairVectors = 4;
constexpr int kMaxValueChunks = 2;

// The second value row of a tile's last pair when its number of keys is odd (its weight is 0, and a
// zero row keeps 0 * whatever lies past the tile out of the sums).
alignas(64) static const uint16_t kZeroValues[32 * kMaxValueChunks] = {};

// s[r][j] (+)= q2[r] . key[j] (times scale on the last chunk) for R rows and NP pair vectors of the
// head dimension from the key pointers plus `offset`.
template <int R, int NP>
static void pair_chunk_scores(const uint32_t* q2, int64_t q_stride, const KeyTile<uint16_t>& tile, int64_t offset,
                              float* s, bool add, float scale) {
  typename Vec::Pairs qv[R][NP];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NP; ++v) qv[r][v] = Vec::load_pairs_raw(q2 + r * q_stride + v * W);
  // Up to two pair vectors a key (head_dim <= 64) chain their products in one accumulator: two chains
  // cost each key three zeroings and three additions more, and a decode layer of SmolLM2-135M
  // (one thread, cache in L2) took 1.06x the time.
  constexpr int kChains = NP <= 2 ? 1 : 2;
  transposed_scores<R, kChains>(tile.num_keys, s, add, scale, tile.ahead,
                                [&](int j, Vec (&acc)[R][2]) __attribute__((always_inline)) {
    const auto* key = reinterpret_cast<const uint32_t*>(tile.key[j] + offset);
    for (int v = 0; v < NP; ++v) {
      const typename Vec::Pairs k = Vec::load_pairs_raw(key + v * W);
      for (int r = 0; r < R; ++r) acc[r][v % kChains] = Vec::dot_pairs(acc[r][v % kChains], qv[r][v], k);
    }
  });
}

// o[r] = alpha[r] o[r] + sum_j p[r][j] value[j] for R rows over NC chunks of 32 elements (o in
// values_lane order), p [rows][kKeyTile] the weights as bfloat16 (p[r][num_keys] is 0 when num_keys
// is odd: the softmax zeroes the weights past the tile up to a whole vector).
template <int R, int NC>
static void pair_chunk_values(const KeyTile<uint16_t>& tile, int64_t offset, const uint16_t* p, int64_t p_stride,
                              const float* alpha, float* o, int64_t padded_d) {
  Vec acc[R][2 * NC];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2 * NC; ++v) acc[r][v] = Vec::load(o + r * padded_d + v * W) * Vec::set1(alpha[r]);
  // The next tile's asking steps on twice at each pair of value rows, as at each key of the scores.
  TileAhead<uint16_t>* ahead = tile.ahead;
  typename TileAhead<uint16_t>::Cursor cursor = ahead != nullptr ? ahead->cursor : TileAhead<uint16_t>::Cursor{};
  for (int j = 0; j < tile.num_keys; j += 2) {
    if (ahead != nullptr) {
      ahead->step(cursor);
      ahead->step(cursor);
    }
    const uint16_t* first = tile.value[j] + offset;
    const uint16_t* second = j + 1 < tile.num_keys ? tile.value[j + 1] + offset : kZeroValues;
    typename Vec::Pairs low[NC], high[NC];
    for (int c = 0; c < NC; ++c) Vec::interleave_rows(first + 32 * c, second + 32 * c, low[c], high[c]);
    for (int r = 0; r < R; ++r) {
      const typename Vec::Pairs weights = Vec::broadcast_pair(p + r * p_stride + j);
      for (int c = 0; c < NC; ++c) {
        acc[r][2 * c] = Vec::dot_pairs(acc[r][2 * c], low[c], weights);
        acc[r][2 * c + 1] = Vec::dot_pairs(acc[r][2 * c + 1], high[c], weights);
      }
    }
  }
  if (ahead != nullptr) ahead->cursor = cursor;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2 * NC; ++v) acc[r][v].store(o + r * padded_d + v * W);
}

// A tile's scores for every row (scores) or its weighted values (not), each KV head's rows against
// that head's keys or values, up to 4 rows a call.
static void pair_tile_products(const DecodeRows& rows, const KeyTile<uint16_t>& tile, float scale, bool scores) {
  const int64_t d = rows.d;
  const auto* q2 = reinterpret_cast<const uint32_t*>(rows.q);
  const auto* p = reinterpret_cast<const uint16_t*>(rows.s);
  over_head_rows<4>(rows, [&](auto r, int64_t m, int64_t head_offset) {
    constexpr int R = decltype(r)::value;
    if (scores) {
      for (int64_t e0 = 0; e0 < d; e0 += 32 * kMaxScorePairVectors) {
        const bool last = e0 + 32 * kMaxScorePairVectors >= d;
        with_count<kMaxScorePairVectors>(min64(kMaxScorePairVectors, (d - e0) / 32), [&](auto n) {
          pair_chunk_scores<R, decltype(n)::value>(q2 + m * rows.padded_d + e0 / 2, rows.padded_d, tile,
                                                   head_offset + e0, rows.s + m * kKeyTile, e0 > 0,
                                                   last ? scale : 1.0f);
        });
      }
    } else {
      for (int64_t e0 = 0; e0 < d; e0 += 32 * kMaxValueChunks) {
        with_count<kMaxValueChunks>(min64(kMaxValueChunks, (d - e0) / 32), [&](auto n) {
          pair_chunk_values<R, decltype(n)::value>(tile, head_offset + e0, p + m * 2 * kKeyTile, 2 * kKeyTile,
                                                   rows.alpha + m, rows.o + m * rows.padded_d + e0, rows.padded_d);
        });
      }
    }
  });
}

// Each row's weights rounded to bfloat16, into the first half of the row's own scores (a row's
// element j moves from byte 4j to byte 2j: every vector is read before the one it overwrites).
static void round_weights_in_place(const DecodeRows& rows, int num_keys) {
  for (int64_t m = 0; m < rows.rows; ++m) {
    float* s = rows.s + m * kKeyTile;
    auto* p = reinterpret_cast<uint16_t*>(s);
    for (int j = 0; j < round_up(num_keys, W); j += W) Vec::load(s + j).store(p + j);
  }
}

template <typename A>
static void decode_task_pairs(const AttentionArgs& a, const AttentionTask& t, float* scratch) {
  run_decode_task<A, uint16_t>(
      a, t, scratch,
      // The row's bfloat16 elements as they are: head_dim / 2 pairs in the row's first floats.
      [&](const A* src, float* q) { __builtin_memcpy(q, src, a.head_dim * sizeof(uint16_t)); },
      [&](const DecodeRows& rows, const KeyTile<uint16_t>& tile, bool scores) {
        if (!scores) round_weights_in_place(rows, tile.num_keys);
        pair_tile_products(rows, tile, a.scale, scores);
      },
      [](int64_t e) { return values_lane(e); });
}

#endif  // __AVX512BF16__

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
