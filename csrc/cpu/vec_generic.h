// One float lane: the portable path, and the reference the vector widths must agree with.
// Every kernel source sees `Vec` in its ISA's namespace (kernels_impl.h).
#pragma once

#include <cstdint>

#include "bf16.h"

namespace kvtool::cpu::KVTOOL_CPU_ISA {

struct Vec {
  static constexpr int width = 1;
  static constexpr bool has_bf16_pairs = false;  // see vec_avx512.h
  using Mask = bool;
  float v;

  static Vec bf16_rounded(Vec x) { return {bf16_to_float(float_to_bf16(x.v))}; }

  static Vec load(const float* p) { return {*p}; }
  static Vec load(const uint16_t* p) { return {bf16_to_float(*p)}; }
  static Vec load_n(const float* p, int) { return {*p}; }
  static Vec load_n(const uint16_t* p, int) { return {bf16_to_float(*p)}; }
  static void load_pairs(const uint16_t* p, Vec& even, Vec& odd) {
    even.v = bf16_to_float(p[0]);
    odd.v = bf16_to_float(p[1]);
  }
  void store(float* p) const { *p = v; }
  void store(uint16_t* p) const { *p = float_to_bf16(v); }
  void store_n(float* p, int) const { *p = v; }
  void store_n(uint16_t* p, int) const { *p = float_to_bf16(v); }
  static Vec set1(float x) { return {x}; }
  static Vec zero() { return {0.0f}; }

  friend Vec operator+(Vec a, Vec b) { return {a.v + b.v}; }
  friend Vec operator-(Vec a, Vec b) { return {a.v - b.v}; }
  friend Vec operator*(Vec a, Vec b) { return {a.v * b.v}; }
  friend Vec operator/(Vec a, Vec b) { return {a.v / b.v}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {__builtin_fmaf(a.v, b.v, c.v)}; }
  static Vec max(Vec a, Vec b) { return {a.v > b.v ? a.v : b.v}; }
  float reduce_add() const { return v; }

  // One lane: nothing to reduce across lanes (vec_avx512.h).
  static constexpr int fold_levels = 0;
  // (Named by the reductions' templates; with no levels never called.)
  template <int L>
  static void pair_lanes(Vec a, Vec b, Vec& x, Vec& y) {
    x = a;
    y = b;
  }

  static Mask le(Vec a, Vec b) { return a.v <= b.v; }
  static Mask gt(Vec a, Vec b) { return a.v > b.v; }
  static Mask is_nan(Vec a) { return a.v != a.v; }
  static bool any(Mask m) { return m; }
  static Mask mask_and(Mask a, Mask b) { return a && b; }
  static Vec select(Mask m, Vec a, Vec b) { return m ? a : b; }  // lane by lane: m ? a : b
  static Vec exp(Vec a) { return {__builtin_expf(a.v)}; }
};

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
