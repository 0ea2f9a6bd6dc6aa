// A range's largest value and its first index (ArgMax), as NumPy's argmax picks it: a greedy decode
// step's token from its logits (DecoderStack::decode), taken on the threads that computed them.
// Compiled once per instruction set (kernels_impl.h).
#pragma once

#include "kernels_common.h"

namespace kvtool::cpu::KVTOOL_CPU_ISA {

// One pass for the largest value and whether any is NaN, one more to its first place (a vector at a
// time until one holds it).
template <typename T>
static ArgMax argmax_typed(const T* data, int64_t begin, int64_t end) {
  Vec best = Vec::set1(kNegInf);
  bool has_nan = false;
  int64_t i = begin;
  for (; i + W <= end; i += W) {
    const Vec v = Vec::load(data + i);
    has_nan |= Vec::any(Vec::is_nan(v));
    best = Vec::max(v, best);  // a NaN lane of v keeps best's (max gives its second operand on NaN)
  }
  float lanes[W];
  best.store(lanes);
  float largest = kNegInf;
  for (float lane : lanes) largest = lane > largest ? lane : largest;
  for (; i < end; ++i) {  // no padded vector: its zeros could be the largest
    const float x = load_scalar(data + i);
    has_nan |= x != x;
    largest = x > largest ? x : largest;
  }
  int64_t j = begin;
  if (has_nan) {
    while (load_scalar(data + j) == load_scalar(data + j)) ++j;
    return {load_scalar(data + j), j};
  }
  const Vec target = Vec::set1(largest);
  while (j + W <= end && !Vec::any(Vec::le(target, Vec::load(data + j)))) j += W;
  while (load_scalar(data + j) != largest) ++j;
  return {largest, j};
}

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
