// A bfloat16 weight laid out once, at load, for the amx build's tile products (tile_linear_amx.h): a
// prompt's projections. oneDNN splits such a product evenly between the threads, and on the family 6
// model 207 Xeon did not split SmolLM2-135M's qkv and down products at all; kvtool's tile product
// hands out tasks of 64 rows by 256 columns that the threads take in turn (results/cpu_tile_linear.md).
//
// The weight's output features go in groups of 32 (two B tiles of 16 columns), each group its
// in_features in steps of 32 (a tile product's depth): for group g and step s, two tiles of
// [16 pairs][16 columns][2] bfloat16 (the pair layout a tile product's B takes), 1 KB each, one after
// the other. Columns past out_features are zeros. A gated weight (gate_up: the gate's rows, then the
// up's) puts 16 gate columns and the same 16 up columns in each group, so that one group's product
// holds both halves of SiLU(gate) * up for 16 output features.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>

namespace kvtool::cpu {

class TileWeight {
 public:
  static constexpr int64_t kGroupColumns = 32;  // a group's weight columns (two tiles of 16)
  static constexpr int64_t kStepDepth = 32;     // in_features a tile product takes
  static constexpr int64_t kStepElements = kGroupColumns * kStepDepth;

  // weight: bfloat16 [num_weight_rows][in_features], rows `stride` elements apart. gated: the product
  // is SiLU(gate) * up, gate the first num_weight_rows / 2 rows. std::invalid_argument where fits()
  // says no.
  TileWeight(const uint16_t* weight, int64_t num_weight_rows, int64_t in_features, int64_t stride, bool gated);

  // Whether a weight of these sizes can be laid out: in_features a whole number of steps (a tile
  // reads 32 of them from each row of x) and, gated, each half a whole number of 16-column tiles.
  static bool fits(int64_t num_weight_rows, int64_t in_features, bool gated);

  int64_t in_features() const { return in_features_; }
  // The product's output features: the weight's rows, half of them gated.
  int64_t out_features() const { return out_features_; }
  bool gated() const { return gated_; }
  int64_t num_groups() const { return num_groups_; }
  int64_t num_bytes() const { return num_groups_ * in_features_ * kGroupColumns * 2; }
  // Group g: in_features / kStepDepth steps of kStepElements elements.
  const uint16_t* group(int64_t g) const { return data_.get() + g * in_features_ * kGroupColumns; }

 private:
  struct Free {
    void operator()(uint16_t* p) const { std::free(p); }
  };

  int64_t in_features_, out_features_;
  bool gated_;
  int64_t num_groups_;
  std::unique_ptr<uint16_t, Free> data_;  // 64-byte aligned: every tile row one cache line
};

}  // namespace kvtool::cpu
