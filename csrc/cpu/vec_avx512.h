// 16 float lanes in AVX-512 (F, BW, VL, DQ) registers. Compiled only into kernels_avx512.cpp.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "bf16.h"
#include "exp_constants.h"

namespace kvtool::cpu::KVTOOL_CPU_ISA {

struct Vec {
  static constexpr int width = 16;
#if defined(__AVX512BF16__)
  // AVX512-BF16's dot products of bfloat16 pairs (kernels_avx512_bf16.cpp): each 32-bit lane of a
  // `Pairs` holds two bfloat16 values, the first in its low half.
  static constexpr bool has_bf16_pairs = true;
  using Pairs = __m512i;
  static Pairs load_pairs_raw(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static void store_pairs(Pairs v, uint32_t* p) { _mm512_storeu_si512(p, v); }
  static Pairs broadcast_pair(const uint16_t* p) {
    uint32_t pair;
    __builtin_memcpy(&pair, p, sizeof(pair));
    return _mm512_set1_epi32(static_cast<int>(pair));
  }
  // acc + a[lane].first * b[lane].first + a[lane].second * b[lane].second, in float32.
  static Vec dot_pairs(Vec acc, Pairs a, Pairs b) {
    return {_mm512_dpbf16_ps(acc.v, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b))};
  }
  // (first[lane], second[lane]) rounded to bfloat16 (to nearest even, as torch rounds).
  static Pairs round_to_pairs(Vec first, Vec second) {
    // Both rounded in one instruction (first's 16 words below second's), then interleaved.
    const __m512i words = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second.v, first.v));
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, words);
  }
  // The 32 bfloat16 values of a and of b (two cache rows) as pairs (a[i], b[i]), in two vectors:
  // `low` holds i = 8L + 0..3 of each 128-bit lane L, `high` i = 8L + 4..7 (in-lane interleaves).
  static void interleave_rows(const uint16_t* a, const uint16_t* b, Pairs& low, Pairs& high) {
    __m512i x = _mm512_loadu_si512(a), y = _mm512_loadu_si512(b);
    low = _mm512_unpacklo_epi16(x, y);
    high = _mm512_unpackhi_epi16(x, y);
  }
#else
  static constexpr bool has_bf16_pairs = false;
#endif
  using Mask = __mmask16;
  __m512 v;

  static __mmask16 first(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
  // Round to nearest even as torch does, NaN to a quiet NaN; 16 results in the low halves of 32-bit lanes.
  static __m512i narrow(__m512 x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  }

  // x's 16 lanes rounded to bfloat16 as narrow rounds them, packed. With AVX512-BF16 one vcvtneps2bf16
  // does it in a third of the instructions, but it takes a denormal as zero and keeps a NaN's payload
  // (torch's rounding does neither): a vector holding either takes narrow.
  static __m256i packed_bf16(__m512 x) {
#if defined(__AVX512BF16__)
    constexpr int kNanOrDenormal = 0x01 | 0x20 | 0x80;  // vfpclassps: quiet NaN, denormal, signalling NaN
    if (_mm512_fpclass_ps_mask(x, kNanOrDenormal) == 0) return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#endif
    return _mm512_cvtepi32_epi16(narrow(x));
  }

  // x rounded to bfloat16 as a store rounds it, kept in float32: in registers, not through memory.
  static Vec bf16_rounded(Vec x) { return {widen(packed_bf16(x.v))}; }

  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const uint16_t* p) { return {widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
  static Vec load_n(const float* p, int n) { return {_mm512_maskz_loadu_ps(first(n), p)}; }
  static Vec load_n(const uint16_t* p, int n) { return {widen(_mm256_maskz_loadu_epi16(first(n), p))}; }
  // 32 bfloat16 values as floats, the even-indexed in `even`, the odd-indexed in `odd`: two in-lane
  // operations where widening 16 at a time takes a lane-crossing one for each half.
  static void load_pairs(const uint16_t* p, Vec& even, Vec& odd) {
    __m512i bits = _mm512_loadu_si512(p);
    even.v = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    odd.v = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(uint16_t* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed_bf16(v)); }
  void store_n(float* p, int n) const { _mm512_mask_storeu_ps(p, first(n), v); }
  void store_n(uint16_t* p, int n) const { _mm256_mask_storeu_epi16(p, first(n), packed_bf16(v)); }
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  static Vec zero() { return {_mm512_setzero_ps()}; }

  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  float reduce_add() const { return _mm512_reduce_add_ps(v); }
  float reduce_max() const { return _mm512_reduce_max_ps(v); }

  // Horizontal reductions of many vectors, two at a time: pair_lanes<L>(a, b, x, y) puts in x and y
  // the lanes of a and b that level L of a transposing reduction pairs, so that combining x and y
  // lane-wise (adding them, or taking their max) for 16 vectors v[0..15] as a binary tree (v[2k] with v[2k+1] at
  // level 0, those results in pairs at level 1, ...) leaves lane i the reduction of v[i]. Levels:
  // pairs of lanes, quads, then 128-bit lanes (levels 2 and 3 the same operation).
  static constexpr int fold_levels = 4;
  template <int L>
  static void pair_lanes(Vec a, Vec b, Vec& x, Vec& y) {
    if constexpr (L == 0) {
      x.v = _mm512_unpacklo_ps(a.v, b.v);
      y.v = _mm512_unpackhi_ps(a.v, b.v);
    } else if constexpr (L == 1) {
      __m512d p = _mm512_castps_pd(a.v), q = _mm512_castps_pd(b.v);
      x.v = _mm512_castpd_ps(_mm512_unpacklo_pd(p, q));
      y.v = _mm512_castpd_ps(_mm512_unpackhi_pd(p, q));
    } else {
      x.v = _mm512_shuffle_f32x4(a.v, b.v, 0x88);
      y.v = _mm512_shuffle_f32x4(a.v, b.v, 0xdd);
    }
  }

  static Mask le(Vec a, Vec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LE_OQ); }
  static Mask gt(Vec a, Vec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ); }
  static Mask is_nan(Vec a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }
  static bool any(Mask m) { return m != 0; }
  static Mask mask_and(Mask a, Mask b) { return static_cast<Mask>(a & b); }
  static Vec select(Mask m, Vec a, Vec b) { return {_mm512_mask_blend_ps(m, b.v, a.v)}; }  // m ? a : b

  static Vec exp(Vec a) {
    // Operand order keeps a NaN input NaN (min/max return their second operand on NaN).
    __m512 x = _mm512_max_ps(_mm512_set1_ps(kExpLo), _mm512_min_ps(_mm512_set1_ps(kExpHi), a.v));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), x);
    __m512 y = _mm512_set1_ps(kExpP0);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP1));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP2));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP3));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP4));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP5));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 result = _mm512_mul_ps(y, _mm512_castsi512_ps(scale));
    return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a.v, _mm512_set1_ps(kExpLo), _CMP_NLT_UQ), result)};
  }
};

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
