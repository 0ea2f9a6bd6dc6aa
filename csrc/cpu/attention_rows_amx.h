// The prompt layout of attention for bfloat16 queries over a bfloat16 cache on AMX tiles
// (kernels_amx.cpp): the arithmetic of attention_rows_bf16.h, whose pair layouts are already what a
// tile product takes, with both products on the tile unit. A tile product C [16][16] += A [16][32
// bfloat16] . B [16 pairs][16] multiplies pairs, each row of B holding 16 columns' pairs, and
// accumulates in float32 as AVX512-BF16's pair products do.
//
// Keys are taken kAmxKeyBlock at a time (kernel_args.h), laid out once for every row vector of the
// task, then each vector of 16 rows runs the block on its own:
// - scores s [keys][16 rows] = k . qt: A = 16 keys' rows as they lie (read from the cache in place, or
//   copied into kb [block][d] where 16 keys span two of its blocks: no key is transposed), B = qt2
//   [d / 2][padded] (each row's pairs of q), 32 elements of the head dimension a product;
// - the online softmax of the block's scores, in AVX-512, into p2 [block / 2][16] (each row's pairs
//   of weights, rounded to bfloat16), the vector's output rescaled in memory where its max grew;
// - values ot [d][16 rows] += v^T . p: A = vt2t (each element's pairs of values along 32 keys:
//   attention_rows_bf16.h's vt2 transposed, 16 x 16 words at a time), B = p2; ot keeps vt2's
//   permuted order (values_lane), loaded into tiles and stored back once per block.
// With a block of 32 keys (the other layouts' tile) a 1,053-token prompt's layer took 4.4 ms on the
// family 6 model 207 Xeon, the rescaling of the output, the output tiles' loads and stores and the
// exponentials the largest parts of it (perf); blocks of 128 and weight_exp2 took 0.82-0.91x that
// time (bench/cpu_prompt_attention.py, three alternating runs). Running the next vector's scores
// before a vector's values, so that no tile load follows the stores of its lines, gained nothing.
// On the causal diagonal each vector takes only the key tiles up to its last query (0.94x a layer:
// a block of 128 keys beside 128 queries is half hidden).
#pragma once

#include "amx_tiles.h"
#include "attention_rows_bf16.h"

namespace kvtool::cpu::KVTOOL_CPU_ISA {

#if defined(__AMX_BF16__)

static_assert(W == kTileRows, "a B tile's 16 columns are one vector of rows");
static_assert(kKeyTile == 2 * kTileRows, "a key tile's pairs are one tile product's 16");

// Tiles: 0-3 the C tiles (scores of 4 key tiles, or 4 x 16 elements of a vector's output), 4-5 the
// A tiles in turn (one loads while the other multiplies), 6 the B tile.
// s [16 N keys][16 rows] = keys [16 N][d] . qt2 [d / 2][16 rows] (qt2's rows `padded` words apart), key
// tile i's 16 rows from key_tiles[i], key_stride bytes apart.
template <int N>
static inline void block_scores(const uint16_t* const* key_tiles, int64_t key_stride, int64_t d, const uint32_t* qt2,
                                int64_t padded, float* s) {
  _tile_zero(0);
  if constexpr (N > 1) _tile_zero(1);
  if constexpr (N > 2) _tile_zero(2);
  if constexpr (N > 3) _tile_zero(3);
  for (int64_t c = 0; c < d; c += 2 * kTileRows) {
    _tile_loadd(6, qt2 + c / 2 * padded, padded * 4);
    _tile_loadd(4, key_tiles[0] + c, key_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (N > 1) {
      _tile_loadd(5, key_tiles[1] + c, key_stride);
      _tile_dpbf16ps(1, 5, 6);
    }
    if constexpr (N > 2) {
      _tile_loadd(4, key_tiles[2] + c, key_stride);
      _tile_dpbf16ps(2, 4, 6);
    }
    if constexpr (N > 3) {
      _tile_loadd(5, key_tiles[3] + c, key_stride);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  constexpr int64_t kTileFloats = kTileRows * kTileRows;
  _tile_stored(0, s, W * 4);
  if constexpr (N > 1) _tile_stored(1, s + kTileFloats, W * 4);
  if constexpr (N > 2) _tile_stored(2, s + 2 * kTileFloats, W * 4);
  if constexpr (N > 3) _tile_stored(3, s + 3 * kTileFloats, W * 4);
}

// ot [16 N elements from e0][16 rows] (rows `padded` floats apart) += the block's vt2t [pair tile][d][16]
// . p2 [pair tile][16 pairs][16 rows], over num_pair_tiles tiles of 32 keys.
template <int N>
static inline void block_values(const uint32_t* vt2t, const uint32_t* p2, int num_pair_tiles, int64_t d, int64_t e0,
                                float* ot, int64_t padded) {
  const int64_t stride = padded * 4, element_tile = kTileRows * padded, a_tile = kTileRows * W;
  _tile_loadd(0, ot, stride);
  _tile_loadd(1, ot + element_tile, stride);
  if constexpr (N > 2) {
    _tile_loadd(2, ot + 2 * element_tile, stride);
    _tile_loadd(3, ot + 3 * element_tile, stride);
  }
  for (int i = 0; i < num_pair_tiles; ++i) {
    const uint32_t* a = vt2t + i * d * W + e0 * W;
    _tile_loadd(6, p2 + i * a_tile, W * 4);
    _tile_loadd(4, a, W * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, a + a_tile, W * 4);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (N > 2) {
      _tile_loadd(4, a + 2 * a_tile, W * 4);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(5, a + 3 * a_tile, W * 4);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  _tile_stored(0, ot, stride);
  _tile_stored(1, ot + element_tile, stride);
  if constexpr (N > 2) {
    _tile_stored(2, ot + 2 * element_tile, stride);
    _tile_stored(3, ot + 3 * element_tile, stride);
  }
}

// Where the block's 16-key tiles of keys lie for the scores' products: key_tiles[i], rows key_stride
// bytes apart.
struct BlockKeys {
  const uint16_t* key_tiles[kAmxKeyBlock / kTileRows];
  int64_t key_stride;
};

// The block's keys [k0, k0 + num_keys) laid out for every row vector: its key tiles read where the
// cache holds them when each 16 keys lie in one block of the cache (the rows past the keys then
// whatever the block holds there: scores the softmax never reads), else copied into kb [block][d]
// (rows past the keys zeros); and vt2t [pair tile][d][16] (pairs past the keys zeros). A copy's vector
// stores held up the tile loads right after them (a shared prefix's decode rows: 8% of its time).
static BlockKeys block_keys(const AttentionArgs& a, TilesAhead<uint16_t>& tiles, int64_t k0, int num_keys,
                            const PairTask& p, uint16_t* kb, uint32_t* vt2t) {
  const int64_t d = a.head_dim;
  const bool in_place = a.tokens_per_block % kTileRows == 0 && k0 % kTileRows == 0;
  BlockKeys keys{{}, in_place ? a.token_stride * static_cast<int64_t>(sizeof(uint16_t)) : d * 2};
  for (int sub = 0; sub * kKeyTile < num_keys; ++sub) {
    const int tile_keys = std::min(kKeyTile, num_keys - sub * kKeyTile);
    const KeyTile<uint16_t>& tile = tiles.start(k0 + sub * kKeyTile, 1);
    const int rows = round_up(tile_keys, kTileRows);
    for (int j = 0; j < rows; j += kTileRows) {
      keys.key_tiles[(sub * kKeyTile + j) / kTileRows] = in_place ? tile.key[j] : kb + (sub * kKeyTile + j) * d;
    }
    // The copy: a row's d bfloat16 elements moved as d / 2 floats' bits (d / 2 a multiple of W: pairs_fit).
    for (int j = 0; !in_place && j < rows; ++j) {
      const auto* src = reinterpret_cast<const float*>(tile.key[j < tile_keys ? j : 0]);
      auto* dst = reinterpret_cast<float*>(kb + (sub * kKeyTile + j) * d);
      for (int64_t f = 0; f < d / 2; f += W) (j < tile_keys ? Vec::load(src + f) : Vec::zero()).store(dst + f);
    }
    value_pairs(tile, tile_keys, kKeyTile / 2, d, p.vt2);
    // vt2t [sub][e][i] = vt2 [i][e], the words' bits moved as floats.
    uint32_t* out = vt2t + sub * d * W;
    for (int64_t e0 = 0; e0 < d; e0 += W) {
      Vec words[W];
      for (int i = 0; i < W; ++i) words[i] = Vec::load(reinterpret_cast<const float*>(p.vt2 + i * d + e0));
      transpose(words);
      for (int c = 0; c < W; ++c) words[transposed_index(c)].store(reinterpret_cast<float*>(out + (e0 + c) * W));
    }
    tiles.finish();
  }
  return keys;
}

// 2^x for a weight's exponent x <= 0, within 3 parts in a million: below the weights' rounding to
// bfloat16 (2^-9), and about half the instructions of Vec::exp. x = n + f with n = floor(x) and f in
// [0, 1) (vreduceps: x less its floor, exactly), 2^f by a degree-4 polynomial fitted to its relative
// error, times 2^n by vscalefps, which floors x itself; x <= -125 (a masked score's -inf among them)
// gives exactly 0, as Vec::exp does below its range, and never a denormal.
static inline Vec weight_exp2(Vec x) {
  const __mmask16 weighs = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(-125.0f), _CMP_GT_OQ);
  const __m512 f = _mm512_reduce_ps(x.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.3534167e-2f), f, _mm512_set1_ps(5.2011460e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4144275e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9300383e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000026f));
  return {_mm512_maskz_scalef_ps(weighs, p, x.v)};
}

// Row vector v's online softmax over the block's scores s [num_keys][16] (masked where the block
// reaches past the task's first query or back past its last one's window): its weights' pairs into
// p2 [pair tiles x 16][16] (pairs past the keys zeros), its running max and sum (of scores times
// a.scale, as attention_rows_bf16.h keeps them), and its output so far (ot [d][padded] at column v)
// rescaled where a row's max grew. The scale (> 0) is applied to the block's max and folded into
// each weight's exponent rather than stored with each score.
static void block_softmax(const AttentionArgs& a, const AttentionTask& t, int64_t k0, int num_keys, const PairTask& p,
                          int64_t v, float* s, uint32_t* p2) {
  const int64_t last_position = t.first_position + t.num_queries - 1;
  const bool masked = k0 + num_keys - 1 > t.first_position ||
                      (a.sliding_window > 0 && k0 <= last_position - a.sliding_window);
  Vec block_max = Vec::set1(kNegInf);
  if (masked) {
    const Vec query_positions = Vec::load(p.positions + v * W);
    for (int j = 0; j < num_keys; ++j) {
      const Vec score =
          visible_or_neg_inf(Vec::load(s + j * W), static_cast<float>(k0 + j), query_positions, a.sliding_window);
      score.store(s + j * W);
      block_max = Vec::max(block_max, score);
    }
  } else {
    for (int j = 0; j < num_keys; ++j) block_max = Vec::max(block_max, Vec::load(s + j * W));
  }
  const Vec old_max = Vec::load(p.row_max + v * W);
  const Rescale r = rescale(old_max, block_max * Vec::set1(a.scale));
  // weight = e^(score x scale - shift) = 2^(score x scale log2(e) - shift log2(e))
  const Vec to_exponent = Vec::set1(a.scale * kLog2e), offset = Vec::zero() - r.shift * Vec::set1(kLog2e);
  const auto weight = [&](int j) { return weight_exp2(Vec::fma(Vec::load(s + j * W), to_exponent, offset)); };
  Vec sum = Vec::zero();
  int i = 0;
  for (; 2 * i + 1 < num_keys; ++i) {
    const Vec first = weight(2 * i), second = weight(2 * i + 1);
    sum = sum + first + second;
    Vec::store_pairs(Vec::round_to_pairs(first, second), p2 + i * W);
  }
  if (2 * i < num_keys) {  // an odd block's last key, paired with a zero weight
    const Vec first = weight(2 * i);
    sum = sum + first;
    Vec::store_pairs(Vec::round_to_pairs(first, Vec::zero()), p2 + i * W);
    ++i;
  }
  for (; i < round_up(num_keys, kKeyTile) / 2; ++i) Vec::store_pairs(_mm512_setzero_si512(), p2 + i * W);
  (Vec::load(p.row_sum + v * W) * r.alpha + sum).store(p.row_sum + v * W);
  r.max.store(p.row_max + v * W);
  if (Vec::any(Vec::gt(r.max, old_max))) {
    for (int64_t e = 0; e < a.head_dim; ++e) {
      float* o = p.ot + e * p.padded + v * W;
      (Vec::load(o) * r.alpha).store(o);
    }
  }
}

template <typename A>
static void attention_rows_amx(const AttentionArgs& a, const AttentionTask& t, float* scratch) {
  const int64_t d = a.head_dim;
  const PairTask p = begin_pair_task<A>(a, t, scratch);
  const int64_t padded = p.padded;
  auto* kb = reinterpret_cast<uint16_t*>(p.rest);                  // [kAmxKeyBlock][d]
  uint32_t* vt2t = p.rest + kAmxKeyBlock * d / 2;                  // [kAmxKeyBlock / kKeyTile][d][16]
  auto* s = reinterpret_cast<float*>(vt2t + kAmxKeyBlock * d / 2);  // [kAmxKeyBlock][16]
  auto* p2 = reinterpret_cast<uint32_t*>(s + kAmxKeyBlock * W);     // [kAmxKeyBlock / 2][16]

  TilesInUse tiles_in_use;
  TilesAhead<uint16_t> tiles(a, t);
  for (int64_t k0 = t.key_begin; k0 < t.key_end; k0 += kAmxKeyBlock) {
    const int num_keys = static_cast<int>(min64(kAmxKeyBlock, t.key_end - k0));
    const BlockKeys keys = block_keys(a, tiles, k0, num_keys, p, kb, vt2t);
    for (int64_t v = 0; v < p.num_vectors; ++v) {
      // The block's keys past the vector's last query are hidden from all its rows: on the causal
      // diagonal a vector of early queries takes only the key tiles it sees.
      const int64_t last_seen = static_cast<int64_t>(_mm512_reduce_max_ps(Vec::load(p.positions + v * W).v)) - k0 + 1;
      if (last_seen <= 0) continue;
      const int vector_keys = static_cast<int>(min64(num_keys, last_seen));
      const int num_key_tiles = (vector_keys + kTileRows - 1) / kTileRows;
      const int num_pair_tiles = (vector_keys + kKeyTile - 1) / kKeyTile;
      const uint32_t* qt2 = p.qt2 + v * W;
      int j = 0;
      for (; j + 4 <= num_key_tiles; j += 4) {
        block_scores<4>(keys.key_tiles + j, keys.key_stride, d, qt2, padded, s + j * kTileRows * W);
      }
      const uint16_t* const* rest = keys.key_tiles + j;  // the last 1 to 3 key tiles
      float* rest_s = s + j * kTileRows * W;
      if (num_key_tiles - j == 3) block_scores<3>(rest, keys.key_stride, d, qt2, padded, rest_s);
      if (num_key_tiles - j == 2) block_scores<2>(rest, keys.key_stride, d, qt2, padded, rest_s);
      if (num_key_tiles - j == 1) block_scores<1>(rest, keys.key_stride, d, qt2, padded, rest_s);
      block_softmax(a, t, k0, vector_keys, p, v, s, p2);
      int64_t e = 0;
      for (; e + 4 * kTileRows <= d; e += 4 * kTileRows) {
        block_values<4>(vt2t, p2, num_pair_tiles, d, e, p.ot + e * padded + v * W, padded);
      }
      if (e < d) block_values<2>(vt2t, p2, num_pair_tiles, d, e, p.ot + e * padded + v * W, padded);  // d % 32 == 0
    }
  }
  end_pair_task<A>(a, t, p);
}

#endif  // __AMX_BF16__

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
