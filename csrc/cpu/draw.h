// A row's draw from softmax(logits / temperature), cut to its top_k and top_p (draw_cut.h), by inverse
// transform: the first index whose running sum of the kept weights exp((x - largest) / temperature)
// exceeds u times their total, u uniform in [0, 1); tokens in vocabulary order (the distribution is
// the same in any order; kvtool.layers.sampler draws in the same order). A sampled decode step's
// token (DecoderStack::decode), taken by a thread of the team that computed the logits, which they
// still hold: the Python sampler after the step found them and its own code cold (~0.5 ms of a ~7 ms
// bfloat16 SmolLM2-135M step at a temperature, ~1.7 ms with top_p 0.9). Compiled once per instruction
// set (kernels_impl.h).
#pragma once

#include "draw_cut.h"
#include "kernels_common.h"

namespace kvtool::cpu::KVTOOL_CPU_ISA {

// The row's weights exp((x - largest) * inv_temperature) into weights [round_up(size, W)], 0 past size.
template <typename T>
static void draw_weights(const T* data, int64_t size, float largest, float inv_temperature, float* weights) {
  const Vec top = Vec::set1(largest), scale = Vec::set1(inv_temperature);
  int64_t i = 0;
  for (; i + W <= size; i += W) Vec::exp((Vec::load(data + i) - top) * scale).store(weights + i);
  if (i < size) {
    alignas(64) float tail[W];
    for (int l = 0; l < W; ++l) tail[l] = i + l < size ? load_scalar(data + i + l) : kNegInf;
    Vec::exp((Vec::load(tail) - top) * scale).store(weights + i);
  }
}

// The weights of the W tokens from i that the cut keeps (those >= floor; floor 0 keeps all).
static inline Vec kept_weights(const float* weights, int64_t i, Vec floor) {
  const Vec w = Vec::load(weights + i);
  return Vec::select(Vec::le(floor, w), w, Vec::zero());
}

// Two passes over the kept weights: the total, then the running sum to the target. Both add each
// vector's weights (one float) to a double in the same order, so the second reaches the first's total
// exactly, and u * total < total (u <= 1 - 2^-53): it crosses the target at a vector of positive weight
// at the latest at the end. Within that vector the lanes are added one by one; where rounding leaves
// them short of the target, its last lane of positive weight is the pick.
template <typename T>
static int64_t draw_typed(const T* data, int64_t size, const DrawParams& p, float* scratch) {
  const int64_t padded = round_up(size, W);
  float* weights = scratch;  // [padded]; the rest of scratch: draw_cut's
  draw_weights(data, size, p.largest, p.inv_temperature, weights);
  const Vec floor = Vec::set1(draw_cut(weights, size, p.top_k, p.top_p, scratch + padded));
  double total = 0.0;
  for (int64_t i = 0; i < padded; i += W) total += static_cast<double>(kept_weights(weights, i, floor).reduce_add());
  const double target = p.u * total;
  double running = 0.0;
  for (int64_t i = 0; i < padded; i += W) {
    const Vec kept = kept_weights(weights, i, floor);
    const double sum = static_cast<double>(kept.reduce_add());
    if (running + sum > target) {
      alignas(64) float lanes[W];
      kept.store(lanes);
      int64_t last = i;
      for (int l = 0; l < W && i + l < size; ++l) {
        if (lanes[l] <= 0.0f) continue;
        last = i + l;
        running += lanes[l];
        if (running > target) return last;
      }
      return last;
    }
    running += sum;
  }
  return size - 1;  // not reached: total > 0 (the largest token weighs 1 and is always kept)
}

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
