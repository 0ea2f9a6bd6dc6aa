// A prompt's projections on AMX tiles (the amx build; kernels_amx.cpp): out = x . weight^T over a
// TileWeight (tile_weight.h), bfloat16 in and out, float32 sums.
//
// Each group of 32 rows of x times a group of 32 weight columns is four C tiles [16 rows][16 columns]
// (tiles 0-3), each step of 32 in_features two A tiles of x's rows, loaded from x as it lies (tiles
// 4-5), and the group's two B tiles (6-7): four tile products a step, each tile loaded used twice.
// A task is row_groups_per_task row groups by groups_per_task weight groups, its rows outer: the
// task's weight columns (256 by in_features) stay in L2 while its rows stream past them, and the
// threads take tasks in turn, so that a core slowed for a while (this VM's cores slow apart for
// minutes at a time) does less of the product instead of the other waiting for it
// (results/cpu_tile_linear.md).
//
// Results are rounded to bfloat16 once, as oneDNN's product rounds them. A gated product rounds gate
// and up to bfloat16 before SiLU(gate) * up as the separate product and silu_mul would: the fused one
// computes what the two compute, bit for bit, without the [rows, 2 * intermediate] product between them.
#pragma once

#include <cstring>

#include "amx_tiles.h"
#include "kernels_common.h"
#include "tile_weight.h"

namespace kvtool::cpu::KVTOOL_CPU_ISA {

#if defined(__AMX_BF16__)

static_assert(TileWeight::kGroupColumns == 2 * kTileRows && TileWeight::kStepDepth == 2 * kTileRows,
              "a group is two B tiles, a step one tile product's 32 bfloat16 of depth");

constexpr int64_t kTileGroupRows = 2 * kTileRows;

// c [32 rows][32 columns] float32 = x [32 rows][in_features] (rows x_stride elements apart) . the
// group's weight columns (TileWeight::group).
// between(s) runs after step s's products are issued: vector work the core does while the tile unit
// multiplies.
template <typename Between>
static inline void group_product(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t num_steps, float* c,
                                 Between&& between) {
  constexpr int64_t kTileElements = kTileRows * TileWeight::kStepDepth;
  const int64_t a_stride = x_stride * 2, second_rows = kTileRows * x_stride;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < num_steps; ++s, x += TileWeight::kStepDepth, w += TileWeight::kStepElements) {
    // The next step's two weight tiles (2 KB, a run of lines) into L1 while this step's products run:
    // the tile loads wait for the products that read their tiles, so what they fetch is on the path.
    if (s + 1 < num_steps) {
      const char* next = reinterpret_cast<const char*>(w + TileWeight::kStepElements);
      for (int line = 0; line < 32; ++line) _mm_prefetch(next + 64 * line, _MM_HINT_T0);
    }
    _tile_loadd(4, x, a_stride);
    _tile_loadd(6, w, 64);
    _tile_loadd(7, w + kTileElements, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, x + second_rows, a_stride);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    between(s);
  }
  constexpr int64_t kRowBytes = TileWeight::kGroupColumns * sizeof(float);
  _tile_stored(0, c, kRowBytes);
  _tile_stored(1, c + kTileRows, kRowBytes);
  _tile_stored(2, c + kTileRows * TileWeight::kGroupColumns, kRowBytes);
  _tile_stored(3, c + kTileRows * TileWeight::kGroupColumns + kTileRows, kRowBytes);
}

// A group's sums waiting to be rounded and stored: c [rows][32] float32 for out [rows][num_columns].
// Rounding them while the next group's tile products run lets the vector unit work beside the tile
// unit: right after a group's own products the rounding would wait for them (its C tiles are stored
// when all are done).
struct PendingGroup {
  const float* c;
  int64_t rows, num_columns;
  uint16_t* out;
};

// Rows [begin, end) of the pending group, rounded to bfloat16: gated, SiLU(gate) * up (gate c's first 16
// columns, up its last 16), each rounded as the separate product and silu_mul round them.
static inline void store_rows(const TileLinearArgs& a, const PendingGroup& p, int64_t begin, int64_t end) {
  const float* c = p.c + begin * TileWeight::kGroupColumns;
  uint16_t* out = p.out + begin * a.out_stride;
  if (a.gated) {
    const Vec one = Vec::set1(1.0f);
    for (int64_t r = begin; r < end; ++r, c += TileWeight::kGroupColumns, out += a.out_stride) {
      Vec gate = Vec::bf16_rounded(Vec::load(c)), up = Vec::bf16_rounded(Vec::load(c + W));
      Vec silu = Vec::bf16_rounded(gate / (one + Vec::exp(Vec::zero() - gate)));
      (silu * up).store(out);
    }
    return;
  }
  for (int64_t r = begin; r < end; ++r, c += TileWeight::kGroupColumns, out += a.out_stride) {
    store_part(Vec::load(c), out, p.num_columns);
    if (p.num_columns > W) store_part(Vec::load(c + W), out + W, p.num_columns - W);
  }
}

void tile_linear(const TileLinearArgs& a, int64_t task, uint16_t* rows_scratch) {
  const int64_t num_column_tasks = (a.num_groups + a.groups_per_task - 1) / a.groups_per_task;
  const int64_t row_begin = task / num_column_tasks * a.row_groups_per_task * kTileGroupRows;
  const int64_t row_end = min64(a.num_rows, row_begin + a.row_groups_per_task * kTileGroupRows);
  const int64_t group_begin = task % num_column_tasks * a.groups_per_task;
  const int64_t group_end = min64(a.num_groups, group_begin + a.groups_per_task);
  const int64_t group_elements = a.in_features * TileWeight::kGroupColumns;
  const int64_t num_steps = a.in_features / TileWeight::kStepDepth;
  const int64_t group_columns = a.gated ? kTileRows : TileWeight::kGroupColumns;  // output columns a group
  constexpr int64_t kGroupFloats = kTileGroupRows * TileWeight::kGroupColumns;
  alignas(64) float sums[2 * kGroupFloats];  // two groups' C: one rounded while the next one's products run
  // The pending group's rows are rounded a few after each step of the next group's products.
  const int64_t rows_per_step = (kTileGroupRows + num_steps - 1) / num_steps;
  int64_t num_groups = 0;
  PendingGroup pending{};
  auto round_pending = [&](int64_t step) {
    const int64_t begin = step * rows_per_step;
    if (num_groups > 0 && begin < pending.rows) {
      store_rows(a, pending, begin, min64(pending.rows, begin + rows_per_step));
    }
  };
  TilesInUse tiles;
  for (int64_t r = row_begin; r < row_end; r += kTileGroupRows) {
    const int64_t rows = min64(kTileGroupRows, row_end - r);
    const uint16_t* x = a.x + r * a.x_stride;
    int64_t x_stride = a.x_stride;
    if (rows < kTileGroupRows) {
      // The last rows, with zero rows after them: the A tiles read 32 whole rows.
      for (int64_t i = 0; i < rows; ++i) {
        std::memcpy(rows_scratch + i * a.in_features, x + i * x_stride, a.in_features * sizeof(uint16_t));
      }
      std::memset(rows_scratch + rows * a.in_features, 0, (kTileGroupRows - rows) * a.in_features * sizeof(uint16_t));
      x = rows_scratch;
      x_stride = a.in_features;
    }
    uint16_t* out = a.out + r * a.out_stride;
    for (int64_t g = group_begin; g < group_end; ++g, ++num_groups) {
      float* c = sums + num_groups % 2 * kGroupFloats;
      group_product(x, x_stride, a.weight + g * group_elements, num_steps, c, round_pending);
      pending = {c, rows, min64(group_columns, a.out_features - g * group_columns), out + g * group_columns};
    }
  }
  if (num_groups > 0) store_rows(a, pending, 0, pending.rows);
}

#endif

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
