// 8 float lanes in AVX2 + FMA registers. Compiled only into kernels_avx2.cpp.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "bf16.h"
#include "exp_constants.h"

namespace kvtool::cpu::KVTOOL_CPU_ISA {

struct Vec {
  static constexpr int width = 8;
  static constexpr bool has_bf16_pairs = false;  // see vec_avx512.h
  using Mask = __m256;  // all bits set in a true lane
  __m256 v;

  static __m256 widen(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
  // Round to nearest even as torch does, NaN to a quiet NaN; 8 results packed to 16 bits.
  static __m128i narrow(__m256 x) {
    __m256i bits = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
    // packus works within 128-bit halves: [a0..a3 a0..a3 | a4..a7 a4..a7] -> take quadwords 0 and 2.
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
    return _mm256_castsi256_si128(packed);
  }

  // x rounded to bfloat16 as a store rounds it, kept in float32: in registers, not through memory.
  static Vec bf16_rounded(Vec x) { return {widen(narrow(x.v))}; }

  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const uint16_t* p) { return {widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
  // Partial loads and stores of the first n < 8 lanes go through a small buffer.
  template <typename T>
  static Vec load_n(const T* p, int n) {
    T buffer[8] = {};
    for (int i = 0; i < n; ++i) buffer[i] = p[i];
    return load(buffer);
  }
  // 16 bfloat16 values as floats, the even-indexed in `even`, the odd-indexed in `odd` (in-lane only).
  static void load_pairs(const uint16_t* p, Vec& even, Vec& odd) {
    __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even.v = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
    odd.v = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(uint16_t* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow(v)); }
  template <typename T>
  void store_n(T* p, int n) const {
    T buffer[8];
    store(buffer);
    for (int i = 0; i < n; ++i) p[i] = buffer[i];
  }
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  static Vec zero() { return {_mm256_setzero_ps()}; }

  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
  float reduce_add() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  float reduce_max() const {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  // Horizontal reductions of many vectors, two at a time (vec_avx512.h): pairs of lanes, quads,
  // then the two 128-bit lanes.
  static constexpr int fold_levels = 3;
  template <int L>
  static void pair_lanes(Vec a, Vec b, Vec& x, Vec& y) {
    if constexpr (L == 0) {
      x.v = _mm256_unpacklo_ps(a.v, b.v);
      y.v = _mm256_unpackhi_ps(a.v, b.v);
    } else if constexpr (L == 1) {
      __m256d p = _mm256_castps_pd(a.v), q = _mm256_castps_pd(b.v);
      x.v = _mm256_castpd_ps(_mm256_unpacklo_pd(p, q));
      y.v = _mm256_castpd_ps(_mm256_unpackhi_pd(p, q));
    } else {
      x.v = _mm256_permute2f128_ps(a.v, b.v, 0x20);
      y.v = _mm256_permute2f128_ps(a.v, b.v, 0x31);
    }
  }

  static Mask le(Vec a, Vec b) { return _mm256_cmp_ps(a.v, b.v, _CMP_LE_OQ); }
  static Mask gt(Vec a, Vec b) { return _mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ); }
  static Mask is_nan(Vec a) { return _mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q); }
  static bool any(Mask m) { return _mm256_movemask_ps(m) != 0; }
  static Mask mask_and(Mask a, Mask b) { return _mm256_and_ps(a, b); }
  static Vec select(Mask m, Vec a, Vec b) { return {_mm256_blendv_ps(b.v, a.v, m)}; }  // m ? a : b

  static Vec exp(Vec a) {
    // Operand order keeps a NaN input NaN (min/max return their second operand on NaN).
    __m256 x = _mm256_max_ps(_mm256_set1_ps(kExpLo), _mm256_min_ps(_mm256_set1_ps(kExpHi), a.v));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), x);
    __m256 y = _mm256_set1_ps(kExpP0);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpP1));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpP2));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpP3));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpP4));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpP5));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 result = _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
    return {_mm256_and_ps(result, _mm256_cmp_ps(a.v, _mm256_set1_ps(kExpLo), _CMP_NLT_UQ))};
  }
};

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
