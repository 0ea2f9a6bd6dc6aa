// The CPU kernels, written once against `Vec` (vec_generic.h, vec_avx2.h or vec_avx512.h) and
// compiled once per instruction set: each kernels_<isa>.cpp defines KVTOOL_CPU_ISA, includes its
// vector header and then this file, so every function here lives in that ISA's own namespace and
// the linker never mixes the copies. Only what the ISA's vector header brings is used here (no
// standard library templates, whose out-of-line copies would be shared across ISAs).
//
// Element types: float (float32) and uint16_t (bfloat16 bits). Arithmetic is float32 throughout;
// a bfloat16 result is rounded once, where torch's op would round it.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernel_args.h"

namespace kvtool::cpu::KVTOOL_CPU_ISA {

constexpr int W = Vec::width;
constexpr float kNegInf = -__builtin_inff();

static inline float load_scalar(const float* p) { return *p; }
static inline float load_scalar(const uint16_t* p) { return bf16_to_float(*p); }
static inline void store_scalar(float* p, float x) { *p = x; }
static inline void store_scalar(uint16_t* p, float x) { *p = float_to_bf16(x); }

// v as the element type T holds it: bfloat16 rounding for uint16_t, nothing for float.
template <typename T>
static inline Vec rounded_to(Vec v) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return v;
  } else {
    T buffer[W];
    v.store(buffer);
    return Vec::load(buffer);
  }
}

template <typename T>
static inline Vec load_part(const T* p, int64_t n) {
  return n >= W ? Vec::load(p) : Vec::load_n(p, static_cast<int>(n));
}

template <typename T>
static inline void store_part(Vec v, T* p, int64_t n) {
  if (n >= W) {
    v.store(p);
  } else {
    v.store_n(p, static_cast<int>(n));
  }
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Calls f with a value of the element type a DType names (uint16_t holds bfloat16 bits).
template <typename F>
static inline void with_type(DType dtype, F&& f) {
  if (dtype == DType::kBFloat16) {
    f(uint16_t{});
  } else {
    f(float{});
  }
}

// ---- RMSNorm (+ residual) -------------------------------------------------------------------

template <typename T>
static void rms_norm_rows(const RmsNormArgs& a, int64_t begin, int64_t end) {
  const int64_t n = a.dim;
  const T* weight = static_cast<const T*>(a.weight);
  for (int64_t r = begin; r < end; ++r) {
    const T* x = static_cast<const T*>(a.x) + r * a.x_stride;
    T* out = static_cast<T*>(a.out) + r * a.out_stride;
    const T* src = x;
    Vec squares = Vec::zero();
    if (a.residual != nullptr) {
      T* residual = static_cast<T*>(a.residual) + r * a.residual_stride;
      for (int64_t i = 0; i < n; i += W) {
        Vec sum = rounded_to<T>(load_part(x + i, n - i) + load_part(residual + i, n - i));
        store_part(sum, residual + i, n - i);
        squares = Vec::fma(sum, sum, squares);  // lanes past n hold 0
      }
      src = residual;
    } else {
      for (int64_t i = 0; i < n; i += W) {
        Vec v = load_part(x + i, n - i);
        squares = Vec::fma(v, v, squares);
      }
    }
    Vec inv_rms = Vec::set1(1.0f / __builtin_sqrtf(squares.reduce_add() / static_cast<float>(n) + a.eps));
    for (int64_t i = 0; i < n; i += W) {
      store_part(load_part(src + i, n - i) * inv_rms * load_part(weight + i, n - i), out + i, n - i);
    }
  }
}

void rms_norm(const RmsNormArgs& a, int64_t begin, int64_t end) {
  with_type(a.dtype, [&](auto t) { rms_norm_rows<decltype(t)>(a, begin, end); });
}

// ---- SiLU(gate) * up ------------------------------------------------------------------------

template <typename T>
static void silu_mul_rows(const SiluMulArgs& a, int64_t begin, int64_t end) {
  const int64_t n = a.dim;
  const Vec one = Vec::set1(1.0f);
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = static_cast<const T*>(a.gate_up) + r * a.in_stride;
    const T* up = gate + n;
    T* out = static_cast<T*>(a.out) + r * a.out_stride;
    for (int64_t i = 0; i < n; i += W) {
      Vec g = load_part(gate + i, n - i);
      // silu(g) = g / (1 + e^-g), rounded as torch's F.silu output is before the product.
      Vec silu = rounded_to<T>(g / (one + Vec::exp(Vec::zero() - g)));
      store_part(silu * load_part(up + i, n - i), out + i, n - i);
    }
  }
}

void silu_mul(const SiluMulArgs& a, int64_t begin, int64_t end) {
  with_type(a.dtype, [&](auto t) { silu_mul_rows<decltype(t)>(a, begin, end); });
}

// ---- RoPE + KV append -----------------------------------------------------------------------

template <typename T>
static void head_rms_norm(T* x, const T* weight, int64_t d, float eps) {
  Vec squares = Vec::zero();
  for (int64_t i = 0; i < d; i += W) {
    Vec v = load_part(x + i, d - i);
    squares = Vec::fma(v, v, squares);
  }
  Vec inv_rms = Vec::set1(1.0f / __builtin_sqrtf(squares.reduce_add() / static_cast<float>(d) + eps));
  for (int64_t i = 0; i < d; i += W) {
    store_part(load_part(x + i, d - i) * inv_rms * load_part(weight + i, d - i), x + i, d - i);
  }
}

// x[:half], x[half:] <- x1 cos - x2 sin, x2 cos + x1 sin (rotate-half RoPE).
template <typename T>
static void rotate(T* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; i += W) {
    int64_t n = half - i;
    Vec x1 = load_part(x + i, n), x2 = load_part(x + half + i, n);
    Vec c = load_part(cos + i, n), s = load_part(sin + i, n);
    store_part(x1 * c - x2 * s, x + i, n);
    store_part(x2 * c + x1 * s, x + half + i, n);
  }
}

template <typename A, typename C>
static void copy_converted(const A* src, C* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += W) store_part(load_part(src + i, n - i), dst + i, n - i);
}

template <typename A, typename C>
static void rope_store_kv_tokens(const RopeKvArgs& a, int64_t begin, int64_t end) {
  const int64_t d = a.head_dim, half = d / 2;
  const A* q_norm = static_cast<const A*>(a.q_norm_weight);
  const A* k_norm = static_cast<const A*>(a.k_norm_weight);
  for (int64_t t = begin; t < end; ++t) {
    A* row = static_cast<A*>(a.qkv) + t * a.qkv_stride;
    const float* cos = a.rope_cache + a.positions[t] * d;
    const float* sin = cos + half;
    for (int32_t h = 0; h < a.num_heads + a.num_kv_heads; ++h) {
      A* head = row + h * d;
      const A* norm = h < a.num_heads ? q_norm : k_norm;
      if (norm != nullptr) head_rms_norm(head, norm, d, a.norm_eps);
      rotate(head, cos, sin, half);
    }
    int64_t slot = a.slot_mapping[t];
    if (slot < 0) continue;
    C* key = static_cast<C*>(a.kv_cache) + (slot / a.tokens_per_block) * a.block_stride +
             (slot % a.tokens_per_block) * a.token_stride;
    const A* new_keys = row + static_cast<int64_t>(a.num_heads) * d;
    const A* new_values = new_keys + static_cast<int64_t>(a.num_kv_heads) * d;
    for (int32_t h = 0; h < a.num_kv_heads; ++h) {
      copy_converted(new_keys + h * d, key + h * a.head_stride, d);
      copy_converted(new_values + h * d, key + a.kv_stride + h * a.head_stride, d);
    }
  }
}

void rope_store_kv(const RopeKvArgs& a, int64_t begin, int64_t end) {
  with_type(a.dtype, [&](auto t) {
    with_type(a.cache_dtype, [&](auto c) { rope_store_kv_tokens<decltype(t), decltype(c)>(a, begin, end); });
  });
}

// ---- attention ------------------------------------------------------------------------------
//
// A task holds `rows` = num_queries x group query rows (the group: the query heads of one KV head),
// row m = h * num_queries + i for head h of the group and query i. Keys are visited kKeyTile at a
// time with the online softmax (running max and sum per row). Two layouts of the same arithmetic:
//
// - many rows (a prompt chunk): rows along the vector lanes. q is transposed once per task into
//   qt [head_dim][padded rows]; a score tile s [keys][rows] is k . qt, each key element broadcast
//   against a vector of rows; the output ot [head_dim][rows] accumulates v^T . p the same way. No
//   key is ever transposed and the softmax needs no horizontal reductions.
// - few rows (decode: one query x the group): lanes would sit mostly idle, so the head dimension
//   runs along the lanes instead: a score is a dot product of q and k rows, and o [rows][head_dim]
//   accumulates p-weighted v rows.

// Lanes of a score vector where the key at position key_position is visible to the query at each
// lane's position (causal, and within the sliding window when there is one).
static inline Vec visible_or_neg_inf(Vec scores, float key_position, Vec query_positions, int64_t window) {
  Vec key = Vec::set1(key_position);
  typename Vec::Mask visible = Vec::le(key, query_positions);
  if (window > 0) {
    visible = Vec::mask_and(visible, Vec::gt(key, query_positions - Vec::set1(static_cast<float>(window))));
  }
  return Vec::select(visible, scores, Vec::set1(kNegInf));
}

// The new running max and e^(old max - new max) for the rows of one vector; a row that has seen no
// visible key yet keeps max -inf, and its weights come out 0 rather than NaN.
struct Rescale {
  Vec max, shift, alpha;
};

static inline Rescale rescale(Vec old_max, Vec tile_max) {
  Vec new_max = Vec::max(old_max, tile_max);
  Vec shift = Vec::select(Vec::gt(new_max, Vec::set1(kNegInf)), new_max, Vec::zero());
  return {new_max, shift, Vec::exp(old_max - shift)};
}

// s[j][v*W..] = sum_d key[j][d] * qt[d][v*W..] for RK keys x NQ row vectors.
template <int RK, int NQ>
static inline void score_block(const float* const* key, const float* qt, int64_t padded, int64_t d, float* s,
                               int j0, int v0) {
  Vec acc[RK][NQ];
  for (int r = 0; r < RK; ++r)
    for (int n = 0; n < NQ; ++n) acc[r][n] = Vec::zero();
  for (int64_t e = 0; e < d; ++e) {
    Vec q[NQ];
    for (int n = 0; n < NQ; ++n) q[n] = Vec::load(qt + e * padded + (v0 + n) * W);
    for (int r = 0; r < RK; ++r) {
      Vec k = Vec::set1(key[j0 + r][e]);
      for (int n = 0; n < NQ; ++n) acc[r][n] = Vec::fma(k, q[n], acc[r][n]);
    }
  }
  for (int r = 0; r < RK; ++r)
    for (int n = 0; n < NQ; ++n) acc[r][n].store(s + (j0 + r) * padded + (v0 + n) * W);
}

// ot[e][v*W..] += sum_j value[j][e] * p[j][v*W..] for RD dims x NQ row vectors.
template <int RD, int NQ>
static inline void value_block(const float* const* value, int num_keys, const float* p, int64_t padded, float* ot,
                               int64_t e0, int v0) {
  Vec acc[RD][NQ];
  for (int r = 0; r < RD; ++r)
    for (int n = 0; n < NQ; ++n) acc[r][n] = Vec::load(ot + (e0 + r) * padded + (v0 + n) * W);
  for (int j = 0; j < num_keys; ++j) {
    Vec weight[NQ];
    for (int n = 0; n < NQ; ++n) weight[n] = Vec::load(p + j * padded + (v0 + n) * W);
    for (int r = 0; r < RD; ++r) {
      Vec v = Vec::set1(value[j][e0 + r]);
      for (int n = 0; n < NQ; ++n) acc[r][n] = Vec::fma(v, weight[n], acc[r][n]);
    }
  }
  for (int r = 0; r < RD; ++r)
    for (int n = 0; n < NQ; ++n) acc[r][n].store(ot + (e0 + r) * padded + (v0 + n) * W);
}

// Register blocking: 16 accumulators (half the vector registers with AVX-512), 4 keys or head dims
// by 4 row vectors; 8 accumulators with AVX2's 16 registers. Measured on a 1,056-token prompt, one
// thread: 176 GFLOP/s against 156 with 8 keys by 2 row vectors.
constexpr int kBlockKeys = 4;
constexpr int kBlockRows = W >= 16 ? 4 : 2;
constexpr int kValueDims = 4;
constexpr int kValueRows = W >= 16 ? 4 : 2;

template <int NQ>
static void scores(const float* const* key, int num_keys, const float* qt, int64_t padded, int64_t d, float* s,
                   int v0) {
  int j = 0;
  for (; j + kBlockKeys <= num_keys; j += kBlockKeys) score_block<kBlockKeys, NQ>(key, qt, padded, d, s, j, v0);
  for (; j < num_keys; ++j) score_block<1, NQ>(key, qt, padded, d, s, j, v0);
}

template <int NQ>
static void weighted_values(const float* const* value, int num_keys, const float* p, int64_t padded, int64_t d,
                            float* ot, int v0) {
  int64_t e = 0;
  for (; e + kValueDims <= d; e += kValueDims) value_block<kValueDims, NQ>(value, num_keys, p, padded, ot, e, v0);
  for (; e < d; ++e) value_block<1, NQ>(value, num_keys, p, padded, ot, e, v0);
}

// Pointers to the tile's key and value rows of the task's first KV head (float32), widened into
// kbuf/vbuf from a bfloat16 cache; the task's next heads follow at head_offset(): the cache's head
// stride, or head_dim in the buffers.
template <typename C>
static constexpr bool widened() { return sizeof(C) != sizeof(float); }

template <typename C>
static int64_t head_offset(const AttentionArgs& a) { return widened<C>() ? a.head_dim : a.head_stride; }

template <typename C>
static void tile_rows(const AttentionArgs& a, const AttentionTask& t, int64_t k0, int num_keys, float* kbuf,
                      float* vbuf, const float** key, const float** value) {
  const int32_t* table = a.block_tables + t.seq * a.block_table_stride;
  const int64_t d = a.head_dim, row = d * t.num_kv_heads;
  // Block and offset advance with the position (no division per key).
  int64_t block = k0 / a.tokens_per_block, offset = k0 % a.tokens_per_block;
  const C* base = static_cast<const C*>(a.kv_cache) + t.kv_head * a.head_stride;
  for (int j = 0; j < num_keys; ++j, ++offset) {
    if (offset == a.tokens_per_block) {
      ++block;
      offset = 0;
    }
    const C* keys = base + table[block] * a.block_stride + offset * a.token_stride;
    if constexpr (!widened<C>()) {
      key[j] = keys;
      value[j] = keys + a.kv_stride;
    } else {
      for (int32_t g = 0; g < t.num_kv_heads; ++g) {
        copy_converted(keys + g * a.head_stride, kbuf + j * row + g * d, d);
        copy_converted(keys + a.kv_stride + g * a.head_stride, vbuf + j * row + g * d, d);
      }
      key[j] = kbuf + j * row;
      value[j] = vbuf + j * row;
    }
  }
}

template <typename A, typename C>
static void attention_rows_in_lanes(const AttentionArgs& a, const AttentionTask& t, float* scratch) {
  const int64_t group = a.num_heads / a.num_kv_heads, d = a.head_dim, nq = t.num_queries;
  const int64_t rows = nq * group, padded = round_up(rows, W), num_vectors = padded / W;
  float* qt = scratch;                  // [d][padded]
  float* ot = qt + d * padded;          // [d][padded]
  float* s = ot + d * padded;           // [kKeyTile][padded]
  float* row_max = s + kKeyTile * padded;
  float* row_sum = row_max + padded;
  float* positions = row_sum + padded;
  float* kbuf = positions + padded;     // [kKeyTile][d]
  float* vbuf = kbuf + kKeyTile * d;

  for (int64_t m = 0; m < padded; ++m) {
    int64_t h = m / nq, i = m % nq;
    bool real = m < rows;
    const A* q = static_cast<const A*>(a.query) + (t.first_row + (real ? i : 0)) * a.query_stride +
                 (t.kv_head * group + (real ? h : 0)) * d;
    for (int64_t e = 0; e < d; ++e) qt[e * padded + m] = real ? load_scalar(q + e) * a.scale : 0.0f;
    // Padding rows copy the last query's position: finite scores, never NaN; their output is dropped.
    positions[m] = static_cast<float>(t.first_position + (real ? i : nq - 1));
    row_max[m] = kNegInf;
    row_sum[m] = 0.0f;
  }
  for (int64_t e = 0; e < d * padded; ++e) ot[e] = 0.0f;

  const float* key[kKeyTile];
  const float* value[kKeyTile];
  const int64_t last_position = t.first_position + nq - 1;
  for (int64_t k0 = t.key_begin; k0 < t.key_end; k0 += kKeyTile) {
    const int num_keys = static_cast<int>(min64(kKeyTile, t.key_end - k0));
    tile_rows<C>(a, t, k0, num_keys, kbuf, vbuf, key, value);
    int64_t v = 0;
    for (; v + kBlockRows <= num_vectors; v += kBlockRows)
      scores<kBlockRows>(key, num_keys, qt, padded, d, s, static_cast<int>(v));
    for (; v + 2 <= num_vectors; v += 2) scores<2>(key, num_keys, qt, padded, d, s, static_cast<int>(v));
    for (; v < num_vectors; ++v) scores<1>(key, num_keys, qt, padded, d, s, static_cast<int>(v));

    // A tile reaching past the first query, or (with a window) back past the last query's window, is masked.
    const bool causal_edge = k0 + num_keys - 1 > t.first_position;
    const bool window_edge = a.sliding_window > 0 && k0 <= last_position - a.sliding_window;
    for (int64_t vec = 0; vec < num_vectors; ++vec) {
      float* sv = s + vec * W;
      Vec query_positions = Vec::load(positions + vec * W);
      Vec tile_max = Vec::set1(kNegInf);
      for (int j = 0; j < num_keys; ++j) {
        Vec score = Vec::load(sv + j * padded);
        if (causal_edge || window_edge) {
          score = visible_or_neg_inf(score, static_cast<float>(k0 + j), query_positions, a.sliding_window);
          score.store(sv + j * padded);
        }
        tile_max = Vec::max(tile_max, score);
      }
      const Vec old_max = Vec::load(row_max + vec * W);
      Rescale r = rescale(old_max, tile_max);
      Vec sum = Vec::zero();
      for (int j = 0; j < num_keys; ++j) {
        Vec p = Vec::exp(Vec::load(sv + j * padded) - r.shift);
        p.store(sv + j * padded);
        sum = sum + p;
      }
      (Vec::load(row_sum + vec * W) * r.alpha + sum).store(row_sum + vec * W);
      r.max.store(row_max + vec * W);
      // Once the running max settles (most tiles of a long prompt) no row's output needs rescaling.
      if (Vec::any(Vec::gt(r.max, old_max))) {
        for (int64_t e = 0; e < d; ++e) (Vec::load(ot + e * padded + vec * W) * r.alpha).store(ot + e * padded + vec * W);
      }
    }
    v = 0;
    for (; v + kValueRows <= num_vectors; v += kValueRows)
      weighted_values<kValueRows>(value, num_keys, s, padded, d, ot, static_cast<int>(v));
    for (; v + 2 <= num_vectors; v += 2) weighted_values<2>(value, num_keys, s, padded, d, ot, static_cast<int>(v));
    for (; v < num_vectors; ++v) weighted_values<1>(value, num_keys, s, padded, d, ot, static_cast<int>(v));
  }

  for (int64_t m = 0; m < rows; ++m) {
    int64_t h = m / nq, i = m % nq;
    A* out = static_cast<A*>(a.out) + (t.first_row + i) * a.out_stride + (t.kv_head * group + h) * d;
    float inv_sum = 1.0f / row_sum[m];
    for (int64_t e = 0; e < d; ++e) store_scalar(out + e, ot[e * padded + m] * inv_sum);
  }
}

// The decode layout's two products, with a head row's NV vectors held in registers (NV = 0: any
// length, looped). Scores: W keys at a time, each key's lane-wise products with the row, then one
// transposing sum gives W scores. Values: R rows of one KV head together, so each value row is read
// once for them all: o[r] = alpha[r] o[r] + sum_j p[r][j] value[j].
template <int R, int NV>
static void dims_scores(const float* q, int64_t padded_d, const float* const* key, int64_t head, int num_keys,
                        int64_t d, float* s) {
  constexpr int kVectors = NV > 0 ? NV : 1;
  Vec qv[R][kVectors];
  if constexpr (NV > 0) {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) qv[r][v] = Vec::load(q + r * padded_d + v * W);
  }
  for (int j0 = 0; j0 < num_keys; j0 += W) {
    Vec partial[R][W];
    for (int jj = 0; jj < W; ++jj) {
      Vec acc[R][2];  // two chains a row: half the additions' latency
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Vec::zero();
      if (j0 + jj < num_keys) {
        const float* k = key[j0 + jj] + head;
        if constexpr (NV > 0) {
          for (int v = 0; v < NV; ++v) {
            Vec kv = load_part(k + v * W, d - v * W);
            for (int r = 0; r < R; ++r) acc[r][v & 1] = Vec::fma(qv[r][v], kv, acc[r][v & 1]);
          }
        } else {
          for (int64_t e = 0; e < d; e += W) acc[0][0] = Vec::fma(Vec::load(q + e), load_part(k + e, d - e), acc[0][0]);
        }
      }
      for (int r = 0; r < R; ++r) partial[r][jj] = acc[r][0] + acc[r][1];
    }
    for (int r = 0; r < R; ++r) Vec::transpose_sum(partial[r]).store(s + r * kKeyTile + j0);
  }
}

template <int R, int NV>
static void dims_values(const float* const* value, int64_t head, const float* p, int num_keys, const float* alpha,
                        int64_t d, float* o, int64_t padded_d) {
  Vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec::load(o + r * padded_d + v * W) * Vec::set1(alpha[r]);
  for (int j = 0; j < num_keys; ++j) {
    Vec values[NV];
    for (int v = 0; v < NV; ++v) values[v] = load_part(value[j] + head + v * W, d - v * W);
    for (int r = 0; r < R; ++r) {
      Vec weight = Vec::set1(p[r * kKeyTile + j]);
      for (int v = 0; v < NV; ++v) acc[r][v] = Vec::fma(weight, values[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v].store(o + r * padded_d + v * W);
}

// Rows per dims_scores / dims_values call: as many as fit in the registers beside one key or value row.
template <int NV>
constexpr int value_rows() {
  constexpr int registers = W >= 16 ? 32 : 16;
  constexpr int rows = (registers - NV - 2) / NV;
  return rows < 1 ? 1 : (rows > 4 ? 4 : rows);
}

template <int NV>
static void dims_products(const float* q, float* o, float* s, const float* alpha, int64_t rows, int64_t rows_per_head,
                          int64_t next_head, const float* const* key, const float* const* value, int num_keys,
                          int64_t d, int64_t padded_d, bool scores) {
  constexpr int kMaxRows = value_rows<NV>();
  for (int64_t first = 0; first < rows; first += rows_per_head) {  // one KV head's rows
    const int64_t head = first / rows_per_head * next_head;
    for (int64_t m = first; m < first + rows_per_head;) {
      const int64_t count = min64(kMaxRows, first + rows_per_head - m);
      auto run = [&](auto r) {
        constexpr int R = decltype(r)::value;
        if constexpr (R <= kMaxRows) {
          if (scores) {
            dims_scores<R, NV>(q + m * padded_d, padded_d, key, head, num_keys, d, s + m * kKeyTile);
          } else {
            dims_values<R, NV>(value, head, s + m * kKeyTile, num_keys, alpha + m, d, o + m * padded_d, padded_d);
          }
        }
      };
      switch (count) {
        case 4: run(std::integral_constant<int, 4>{}); break;
        case 3: run(std::integral_constant<int, 3>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        default: run(std::integral_constant<int, 1>{}); break;
      }
      m += count;
    }
  }
}

// The head dimension in whole vectors, for the register-held products (at most 8; else looped).
static void dims_step(int64_t num_vectors, const float* q, float* o, float* s, const float* alpha, int64_t rows,
                      int64_t rows_per_head, int64_t next_head, const float* const* key, const float* const* value,
                      int num_keys, int64_t d, int64_t padded_d, bool scores) {
  switch (num_vectors) {
#define KVTOOL_DIMS_CASE(n) \
  case n: return dims_products<n>(q, o, s, alpha, rows, rows_per_head, next_head, key, value, num_keys, d, padded_d, scores);
    KVTOOL_DIMS_CASE(1)
    KVTOOL_DIMS_CASE(2)
    KVTOOL_DIMS_CASE(3)
    KVTOOL_DIMS_CASE(4)
    KVTOOL_DIMS_CASE(5)
    KVTOOL_DIMS_CASE(6)
    KVTOOL_DIMS_CASE(7)
    KVTOOL_DIMS_CASE(8)
#undef KVTOOL_DIMS_CASE
    default: break;
  }
  // Longer rows (head_dim above 8 vectors): the scores looped, the values 8 vectors at a time.
  if (scores) {
    for (int64_t m = 0; m < rows; ++m) {
      dims_scores<1, 0>(q + m * padded_d, padded_d, key, m / rows_per_head * next_head, num_keys, d, s + m * kKeyTile);
    }
    return;
  }
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t head = m / rows_per_head * next_head;
    const float* p = s + m * kKeyTile;
    float* om = o + m * padded_d;
    int64_t e = 0;
    for (; e + 8 * W <= padded_d; e += 8 * W) dims_values<1, 8>(value, head + e, p, num_keys, alpha + m, d - e, om + e, 0);
    switch ((padded_d - e) / W) {
#define KVTOOL_VALUES_CASE(n) \
  case n: dims_values<1, n>(value, head + e, p, num_keys, alpha + m, d - e, om + e, 0); break;
      KVTOOL_VALUES_CASE(1)
      KVTOOL_VALUES_CASE(2)
      KVTOOL_VALUES_CASE(3)
      KVTOOL_VALUES_CASE(4)
      KVTOOL_VALUES_CASE(5)
      KVTOOL_VALUES_CASE(6)
      KVTOOL_VALUES_CASE(7)
#undef KVTOOL_VALUES_CASE
      default: break;
    }
  }
}

template <typename A, typename C>
static void attention_dims_in_lanes(const AttentionArgs& a, const AttentionTask& t, float* scratch) {
  // Row m: query m % nq of head m / nq counted from the task's first KV head's group (so of KV head
  // kv_head + m / (nq * group)).
  const int64_t group = a.num_heads / a.num_kv_heads, d = a.head_dim, nq = t.num_queries;
  const int64_t rows = nq * group * t.num_kv_heads, padded_d = round_up(d, W), rows_per_head = nq * group;
  const int64_t next_head = head_offset<C>(a);
  float* q = scratch;                  // [rows][padded_d], scaled
  float* o = q + rows * padded_d;      // [rows][padded_d]
  float* s = o + rows * padded_d;      // [rows][kKeyTile]
  float* row_max = s + rows * kKeyTile;
  float* row_sum = row_max + rows;
  float* positions = row_sum + rows;
  float* alpha = positions + rows;     // this tile's rescaling of each row's output
  float* kbuf = alpha + rows;          // [kKeyTile][num_kv_heads * d]
  float* vbuf = kbuf + kKeyTile * d * t.num_kv_heads;

  for (int64_t m = 0; m < rows; ++m) {
    int64_t h = m / nq, i = m % nq;
    const A* src = static_cast<const A*>(a.query) + (t.first_row + i) * a.query_stride + (t.kv_head * group + h) * d;
    for (int64_t e = 0; e < padded_d; ++e) {
      q[m * padded_d + e] = e < d ? load_scalar(src + e) * a.scale : 0.0f;
      o[m * padded_d + e] = 0.0f;
    }
    row_max[m] = kNegInf;
    row_sum[m] = 0.0f;
    positions[m] = static_cast<float>(t.first_position + i);
  }

  const float* key[kKeyTile];
  const float* value[kKeyTile];
  const int64_t last_position = t.first_position + nq - 1;
  for (int64_t k0 = t.key_begin; k0 < t.key_end; k0 += kKeyTile) {
    const int num_keys = static_cast<int>(min64(kKeyTile, t.key_end - k0));
    tile_rows<C>(a, t, k0, num_keys, kbuf, vbuf, key, value);
    dims_step(padded_d / W, q, o, s, alpha, rows, rows_per_head, next_head, key, value, num_keys, d, padded_d, true);
    const bool causal_edge = k0 + num_keys - 1 > t.first_position;
    const bool window_edge = a.sliding_window > 0 && k0 <= last_position - a.sliding_window;
    for (int64_t m = 0; m < rows; ++m) {
      float* sm = s + m * kKeyTile;
      if (causal_edge || window_edge) {
        for (int j = 0; j < num_keys; ++j) {
          const float key_position = static_cast<float>(k0 + j);
          if (key_position > positions[m] ||
              (a.sliding_window > 0 && key_position <= positions[m] - static_cast<float>(a.sliding_window))) {
            sm[j] = kNegInf;
          }
        }
      }
      // Whole vectors: the scores past num_keys are -inf, their weights 0.
      for (int j = num_keys; j < round_up(num_keys, W); ++j) sm[j] = kNegInf;
      Vec tile_max_vec = Vec::set1(kNegInf);
      for (int j = 0; j < num_keys; j += W) tile_max_vec = Vec::max(tile_max_vec, Vec::load(sm + j));
      const float tile_max = tile_max_vec.reduce_max();
      // As rescale() does for a vector of rows.
      const float new_max = tile_max > row_max[m] ? tile_max : row_max[m];
      const float shift = new_max > kNegInf ? new_max : 0.0f;
      alpha[m] = __builtin_expf(row_max[m] - shift);
      Vec sum = Vec::zero();
      for (int j = 0; j < num_keys; j += W) {
        Vec p = Vec::exp(Vec::load(sm + j) - Vec::set1(shift));
        p.store(sm + j);
        sum = sum + p;
      }
      row_sum[m] = row_sum[m] * alpha[m] + sum.reduce_add();
      row_max[m] = new_max;
    }
    dims_step(padded_d / W, q, o, s, alpha, rows, rows_per_head, next_head, key, value, num_keys, d, padded_d, false);
  }

  if (t.partial >= 0) {
    float* partial = a.partials + t.partial;
    for (int64_t m = 0; m < rows; ++m) {
      for (int64_t e = 0; e < d; e += W) store_part(Vec::load(o + m * padded_d + e), partial + m * d + e, d - e);
      partial[rows * d + 2 * m] = row_max[m];
      partial[rows * d + 2 * m + 1] = row_sum[m];
    }
    return;
  }
  for (int64_t m = 0; m < rows; ++m) {
    int64_t h = m / nq, i = m % nq;
    A* out = static_cast<A*>(a.out) + (t.first_row + i) * a.out_stride + (t.kv_head * group + h) * d;
    Vec inv_sum = Vec::set1(1.0f / row_sum[m]);
    for (int64_t e = 0; e < d; e += W) store_part(Vec::load(o + m * padded_d + e) * inv_sum, out + e, d - e);
  }
}

// out = sum_s e^(max_s - max) o_s / sum_s e^(max_s - max) sum_s over the shares s of a split task.
template <typename A>
static void merge_typed(const AttentionArgs& a, const AttentionMerge& merge) {
  const int64_t group = a.num_heads / a.num_kv_heads, d = a.head_dim, nq = merge.num_queries;
  const int64_t rows = nq * group * merge.num_kv_heads, size = partial_floats(rows, d);
  const float* first = a.partials + merge.first_partial;
  for (int64_t m = 0; m < rows; ++m) {
    float max = kNegInf;
    for (int32_t s = 0; s < merge.num_partials; ++s) {
      const float share_max = first[s * size + rows * d + 2 * m];
      max = share_max > max ? share_max : max;
    }
    float total = 0.0f;
    for (int32_t s = 0; s < merge.num_partials; ++s) {
      const float* stats = first + s * size + rows * d + 2 * m;
      total += stats[0] > kNegInf ? __builtin_expf(stats[0] - max) * stats[1] : 0.0f;
    }
    const int64_t h = m / nq, i = m % nq;
    A* out = static_cast<A*>(a.out) + (merge.first_row + i) * a.out_stride + (merge.kv_head * group + h) * d;
    for (int64_t e = 0; e < d; e += W) {
      Vec acc = Vec::zero();
      for (int32_t s = 0; s < merge.num_partials; ++s) {
        const float share_max = first[s * size + rows * d + 2 * m];
        if (share_max == kNegInf) continue;  // a share whose keys this row sees none of
        acc = Vec::fma(Vec::set1(__builtin_expf(share_max - max) / total), load_part(first + s * size + m * d + e, d - e),
                       acc);
      }
      store_part(acc, out + e, d - e);
    }
  }
}

template <typename A, typename C>
static void attention_task(const AttentionArgs& a, const AttentionTask& t, float* scratch) {
  const int64_t rows = static_cast<int64_t>(t.num_queries) * (a.num_heads / a.num_kv_heads);  // per KV head
  if (rows_in_lanes(rows, W)) {
    attention_rows_in_lanes<A, C>(a, t, scratch);
  } else {
    attention_dims_in_lanes<A, C>(a, t, scratch);
  }
}

void merge_attention(const AttentionArgs& a, const AttentionMerge& merge) {
  with_type(a.dtype, [&](auto t) { merge_typed<decltype(t)>(a, merge); });
}

void attention(const AttentionArgs& a, const AttentionTask& t, float* scratch) {
  with_type(a.dtype, [&](auto q) {
    with_type(a.cache_dtype, [&](auto c) { attention_task<decltype(q), decltype(c)>(a, t, scratch); });
  });
}

// ---- products of a few rows ------------------------------------------------------------------

// How far ahead of its loads a dot product asks for its weight row: a task's run of rows is one
// sequential stream, and with the hardware prefetcher alone the products of a decode step read their
// weights well below the rate a streaming read gets (bench/cpu_linear_rows.py).
constexpr int64_t kPrefetchBytes = 1024;

// w . x over d elements, four accumulators in flight (bfloat16: split into even and odd elements).
template <typename T>
static inline float dot_row(const T* w, const T* x, int64_t d) {
  Vec acc[4] = {Vec::zero(), Vec::zero(), Vec::zero(), Vec::zero()};
  int64_t k = 0;
  if constexpr (sizeof(T) == sizeof(uint16_t)) {
    for (; k + 4 * W <= d; k += 4 * W) {
      __builtin_prefetch(w + k + kPrefetchBytes / static_cast<int64_t>(sizeof(T)));
      Vec xe, xo, we, wo;
      Vec::load_pairs(x + k, xe, xo);
      Vec::load_pairs(w + k, we, wo);
      acc[0] = Vec::fma(we, xe, acc[0]);
      acc[1] = Vec::fma(wo, xo, acc[1]);
      Vec::load_pairs(x + k + 2 * W, xe, xo);
      Vec::load_pairs(w + k + 2 * W, we, wo);
      acc[2] = Vec::fma(we, xe, acc[2]);
      acc[3] = Vec::fma(wo, xo, acc[3]);
    }
  } else {
    for (; k + 4 * W <= d; k += 4 * W) {
      __builtin_prefetch(w + k + kPrefetchBytes / static_cast<int64_t>(sizeof(T)));
      for (int u = 0; u < 4; ++u) acc[u] = Vec::fma(Vec::load(w + k + u * W), Vec::load(x + k + u * W), acc[u]);
    }
  }
  for (; k < d; k += W) acc[0] = Vec::fma(load_part(w + k, d - k), load_part(x + k, d - k), acc[0]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])).reduce_add();
}

// Output features [begin, end) one weight row at a time, for every input row while it is in L1: each
// weight is read from memory once. Fastest for a single row (a decode step at batch 1); with more rows
// oneDNN's blocked product wins, so kvtool uses this for one row only (kvtool.cpu_kernels.decoder).
template <typename T>
static void linear_typed(const LinearArgs& a, int64_t begin, int64_t end) {
  const T* weight = static_cast<const T*>(a.weight);
  const T* bias = static_cast<const T*>(a.bias);
  for (int64_t n = begin; n < end; ++n) {
    const T* w = weight + n * a.weight_stride;
    const float b = bias != nullptr ? load_scalar(bias + n) : 0.0f;
    for (int64_t m = 0; m < a.num_rows; ++m) {
      const T* x = static_cast<const T*>(a.x) + m * a.x_stride;
      store_scalar(static_cast<T*>(a.out) + m * a.out_stride + n, dot_row(w, x, a.in_features) + b);
    }
  }
}

void linear(const LinearArgs& a, int64_t begin, int64_t end) {
  with_type(a.dtype, [&](auto t) { linear_typed<decltype(t)>(a, begin, end); });
}

// ---- a streaming read ------------------------------------------------------------------------

double sum(const float* data, int64_t begin, int64_t end) {
  // Four independent accumulators keep the loads, not the additions' latency, the limit.
  Vec acc[4] = {Vec::zero(), Vec::zero(), Vec::zero(), Vec::zero()};
  int64_t i = begin;
  for (; i + 4 * W <= end; i += 4 * W) {
    for (int k = 0; k < 4; ++k) acc[k] = acc[k] + Vec::load(data + i + k * W);
  }
  double total = static_cast<double>(((acc[0] + acc[1]) + (acc[2] + acc[3])).reduce_add());
  for (; i < end; ++i) total += data[i];
  return total;
}

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
