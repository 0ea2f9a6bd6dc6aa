// The prompt layout of attention for bfloat16 queries over a bfloat16 cache on AMX tiles
// (kernels_amx.cpp): the same arithmetic and scratch as attention_rows_bf16.h, whose pair layouts
// are already what a tile product takes, with both products on the tile unit. A tile product
// C [16][16] += A [16][32 bfloat16] . B [16 pairs][16] multiplies pairs, each row of B holding 16
// columns' pairs, and accumulates in float32 as AVX512-BF16's pair products do:
//
// - scores s [keys][rows] = k . qt: A = 16 keys' rows (copied from the cache into kb [kKeyTile][d],
//   as they lie: no key is transposed), B = qt2 [d / 2][padded] (each row's pairs of q), 32 elements
//   of the head dimension a product;
// - values ot [d][rows] += v^T . p: A = vt2t [d][kKeyTile / 2] (each element's pairs of values along
//   the keys: attention_rows_bf16.h's vt2 transposed, 16 x 16 words at a time), B = p2 [kKeyTile / 2]
//   [padded] (each row's pairs of weights); ot keeps vt2's permuted order (values_lane).
//
// The running output stays in memory between key tiles (rows_softmax rescales it there), loaded into
// a tile for each product and stored back: a 1 KB tile from L1 beside a 16-cycle product. The
// softmax and the pairs' rounding are the AVX-512 code of attention_rows_bf16.h.
#pragma once

#include "attention_rows_bf16.h"

namespace kvtool::cpu::KVTOOL_CPU_ISA {

#if defined(__AMX_BF16__)

// Every tile 16 rows of 64 bytes (palette 1): a float32 C tile [16][16], a bfloat16 A tile [16][32],
// a B tile [16 pairs][16 columns].
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  TileConfig() {
    for (int i = 0; i < 8; ++i) {
      colsb[i] = 64;
      rows[i] = 16;
    }
  }
};

// A task's tiles configured while it runs and released after it (a thread holding tile state makes
// every context switch save 8 KB more).
class TilesInUse {
 public:
  TilesInUse() {
    static const TileConfig config;
    _tile_loadconfig(&config);
  }
  ~TilesInUse() { _tile_release(); }
  TilesInUse(const TilesInUse&) = delete;
  TilesInUse& operator=(const TilesInUse&) = delete;
};

constexpr int kTileRows = 16;
static_assert(W == kTileRows, "a B tile's 16 columns are one vector of rows");
static_assert(kKeyTile == 2 * kTileRows, "a key tile's pairs are one tile product's 16");

// s [16 NK keys][16 rows] (rows `padded` floats apart) = kb [16 NK][d] . qt2 [d / 2][16 rows]: the
// NK key tiles' products independent (tiles 0 and 1), so one need not wait for the other's result.
template <int NK>
static inline void amx_scores(const uint16_t* kb, int64_t kb_stride, const uint32_t* qt2, int64_t q_stride,
                              int64_t d, float* s, int64_t padded) {
  _tile_zero(0);
  if constexpr (NK == 2) _tile_zero(1);
  for (int64_t c = 0; c < d; c += 2 * kTileRows) {
    _tile_loadd(4, qt2 + c / 2 * padded, q_stride);
    _tile_loadd(2, kb + c, kb_stride);
    _tile_dpbf16ps(0, 2, 4);
    if constexpr (NK == 2) {
      _tile_loadd(3, kb + kTileRows * d + c, kb_stride);
      _tile_dpbf16ps(1, 3, 4);
    }
  }
  _tile_stored(0, s, padded * 4);
  if constexpr (NK == 2) _tile_stored(1, s + kTileRows * padded, padded * 4);
}

// ot [16 NB elements][16 rows] += vt2t [16 NB][16 pairs] . p2 (in tile 7): NB (4 or 2) independent
// outputs in tiles 0-3, their values in tiles 4-6.
template <int NB>
static inline void amx_values(const uint32_t* vt2t, float* ot, int64_t padded) {
  const int64_t stride = padded * 4, block = kTileRows * padded;
  _tile_loadd(0, ot, stride);
  _tile_loadd(4, vt2t, W * 4);
  _tile_dpbf16ps(0, 4, 7);
  _tile_loadd(1, ot + block, stride);
  _tile_loadd(5, vt2t + kTileRows * W, W * 4);
  _tile_dpbf16ps(1, 5, 7);
  if constexpr (NB == 4) {
    _tile_loadd(2, ot + 2 * block, stride);
    _tile_loadd(6, vt2t + 2 * kTileRows * W, W * 4);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(3, ot + 3 * block, stride);
    _tile_loadd(4, vt2t + 3 * kTileRows * W, W * 4);
    _tile_dpbf16ps(3, 4, 7);
  }
  _tile_stored(0, ot, stride);
  _tile_stored(1, ot + block, stride);
  if constexpr (NB == 4) {
    _tile_stored(2, ot + 2 * block, stride);
    _tile_stored(3, ot + 3 * block, stride);
  }
}

template <typename A>
static void attention_rows_amx(const AttentionArgs& a, const AttentionTask& t, float* scratch) {
  const int64_t d = a.head_dim;
  const PairTask p = begin_pair_task<A>(a, t, scratch);
  const int64_t padded = p.padded, num_vectors = p.num_vectors;
  uint32_t* vt2t = p.rest;                                          // [d][kKeyTile / 2]
  auto* kb = reinterpret_cast<uint16_t*>(vt2t + d * kKeyTile / 2);  // [kKeyTile][d]
  const int64_t q_stride = padded * 4, kb_stride = d * 2;           // bytes between tile rows

  TilesInUse tiles_in_use;
  TilesAhead<uint16_t> tiles(a, t);
  for (int64_t k0 = t.key_begin; k0 < t.key_end; k0 += kKeyTile) {
    const int num_keys = static_cast<int>(min64(kKeyTile, t.key_end - k0));
    const int num_key_tiles = (num_keys + kTileRows - 1) / kTileRows;
    // A step() after each row vector's scores and values.
    const KeyTile<uint16_t>& tile = tiles.start(k0, 2 * num_vectors);
    // Keys past the tile's last are zeros: finite scores, which the softmax never reads.
    // A row's d bfloat16 elements moved as d / 2 floats' bits (d / 2 a multiple of W: pairs_fit).
    for (int j = 0; j < num_key_tiles * kTileRows; ++j) {
      const auto* src = reinterpret_cast<const float*>(tile.key[j < num_keys ? j : 0]);
      auto* dst = reinterpret_cast<float*>(kb + j * d);
      for (int64_t f = 0; f < d / 2; f += W) (j < num_keys ? Vec::load(src + f) : Vec::zero()).store(dst + f);
    }
    for (int64_t v = 0; v < num_vectors; ++v) {
      if (num_key_tiles == 2) {
        amx_scores<2>(kb, kb_stride, p.qt2 + v * W, q_stride, d, p.s + v * W, padded);
      } else {
        amx_scores<1>(kb, kb_stride, p.qt2 + v * W, q_stride, d, p.s + v * W, padded);
      }
      tiles.step();
    }
    rows_softmax(a, t, k0, num_keys, padded, a.scale, p.positions, p.s, p.row_max, p.row_sum, p.ot);

    // Every one of a tile product's 16 pairs of keys, those past the tile's zeros.
    tile_pairs(tile, num_keys, kKeyTile / 2, d, p);
    // vt2t [e][i] = vt2 [i][e], the words' bits moved as floats.
    for (int64_t e0 = 0; e0 < d; e0 += W) {
      Vec words[W];
      for (int i = 0; i < W; ++i) words[i] = Vec::load(reinterpret_cast<const float*>(p.vt2 + i * d + e0));
      transpose(words);
      for (int c = 0; c < W; ++c) words[transposed_index(c)].store(reinterpret_cast<float*>(vt2t + (e0 + c) * W));
    }
    for (int64_t v = 0; v < num_vectors; ++v) {
      _tile_loadd(7, p.p2 + v * W, q_stride);
      int64_t e = 0;
      for (; e + 4 * kTileRows <= d; e += 4 * kTileRows) amx_values<4>(vt2t + e * W, p.ot + e * padded + v * W, padded);
      if (e < d) amx_values<2>(vt2t + e * W, p.ot + e * padded + v * W, padded);  // d % 32 == 0
      tiles.step();
    }
    tiles.finish();
  }
  end_pair_task<A>(a, t, p);
}

#endif  // __AMX_BF16__

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
