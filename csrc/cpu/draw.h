// A row's draw from softmax(logits / temperature) by inverse transform: the first index whose running
// sum of exp((x - largest) / temperature) exceeds u times their total, u uniform in [0, 1). A sampled
// decode step's token (DecoderStack::decode), taken by a thread of the team that computed the logits,
// which they still hold: the Python sampler after the step found them and its own code cold (~0.5 ms of
// a ~7 ms bfloat16 SmolLM2-135M step, ~0.12 ms warm). Compiled once per instruction set (kernels_impl.h).
#pragma once

#include "kernels_common.h"

namespace kvtool::cpu::KVTOOL_CPU_ISA {

// The weights of the W elements from i: exp((x - largest) * inv_temperature), 0 past size.
template <typename T>
static inline Vec draw_weights(const T* data, int64_t i, int64_t size, Vec largest, Vec inv_temperature) {
  Vec x;
  if (i + W <= size) {
    x = Vec::load(data + i);
  } else {
    alignas(64) float tail[W];
    for (int l = 0; l < W; ++l) tail[l] = i + l < size ? load_scalar(data + i + l) : kNegInf;
    x = Vec::load(tail);
  }
  return Vec::exp((x - largest) * inv_temperature);
}

// Two passes over the row: the total, then the running sum to the target. Both add each vector's
// weights (one float) to a double in the same order, so the second reaches the first's total exactly,
// and u * total < total (u <= 1 - 2^-53): it crosses the target at a vector of positive weight at the
// latest at the end. Within that vector the lanes are added one by one; where rounding leaves them
// short of the target, its last lane of positive weight is the pick.
template <typename T>
static int64_t draw_typed(const T* data, int64_t size, float largest, float inv_temperature, double u) {
  const Vec top = Vec::set1(largest), scale = Vec::set1(inv_temperature);
  double total = 0.0;
  for (int64_t i = 0; i < size; i += W) {
    total += static_cast<double>(draw_weights(data, i, size, top, scale).reduce_add());
  }
  const double target = u * total;
  double running = 0.0;
  for (int64_t i = 0; i < size; i += W) {
    const Vec weights = draw_weights(data, i, size, top, scale);
    const double sum = static_cast<double>(weights.reduce_add());
    if (running + sum > target) {
      alignas(64) float lanes[W];
      weights.store(lanes);
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
  return size - 1;  // not reached: total > 0 (the largest element weighs 1)
}

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
