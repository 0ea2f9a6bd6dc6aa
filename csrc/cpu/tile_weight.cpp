#include "tile_weight.h"

#include <new>
#include <stdexcept>
#include <string>

namespace kvtool::cpu {

bool TileWeight::fits(int64_t num_weight_rows, int64_t in_features, bool gated) {
  if (num_weight_rows < 1 || in_features < 1 || in_features % kStepDepth != 0) return false;
  return !gated || num_weight_rows % kGroupColumns == 0;
}

TileWeight::TileWeight(const uint16_t* weight, int64_t num_weight_rows, int64_t in_features, int64_t stride,
                       bool gated)
    : in_features_(in_features),
      out_features_(gated ? num_weight_rows / 2 : num_weight_rows),
      gated_(gated),
      num_groups_(gated ? num_weight_rows / kGroupColumns : (num_weight_rows + kGroupColumns - 1) / kGroupColumns) {
  if (!fits(num_weight_rows, in_features, gated) || stride < in_features) {
    throw std::invalid_argument("a tile weight takes in_features in whole steps of 32 and, gated, halves of whole "
                                "16-row tiles; got " + std::to_string(num_weight_rows) + " rows of " +
                                std::to_string(in_features) + " (stride " + std::to_string(stride) + ")" +
                                (gated ? ", gated" : ""));
  }
  data_.reset(static_cast<uint16_t*>(std::aligned_alloc(64, static_cast<size_t>(num_bytes()))));
  if (!data_) throw std::bad_alloc();
  constexpr int64_t kTileColumns = kGroupColumns / 2;
  const int64_t half = out_features_;  // gated: where the up rows begin
  uint16_t* out = data_.get();
  for (int64_t g = 0; g < num_groups_; ++g) {
    for (int64_t k0 = 0; k0 < in_features; k0 += kStepDepth) {
      for (int64_t tile = 0; tile < 2; ++tile) {
        // The weight row of each of the tile's 16 columns (-1: a zero column past the weight's rows).
        int64_t rows[kTileColumns];
        for (int64_t c = 0; c < kTileColumns; ++c) {
          const int64_t row = gated ? tile * half + g * kTileColumns + c : g * kGroupColumns + tile * kTileColumns + c;
          rows[c] = row < num_weight_rows ? row : -1;
        }
        for (int64_t pair = 0; pair < kStepDepth / 2; ++pair) {
          for (int64_t c = 0; c < kTileColumns; ++c) {
            const uint16_t* w = rows[c] < 0 ? nullptr : weight + rows[c] * stride + k0 + 2 * pair;
            *out++ = w == nullptr ? 0 : w[0];
            *out++ = w == nullptr ? 0 : w[1];
          }
        }
      }
    }
  }
}

}  // namespace kvtool::cpu
