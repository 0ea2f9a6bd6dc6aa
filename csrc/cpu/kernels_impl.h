// The CPU kernels, written once against `Vec` (vec_generic.h, vec_avx2.h or vec_avx512.h, the last
// also with AVX512-BF16 in kernels_avx512_bf16.cpp and with AMX in kernels_amx.cpp) and
// compiled once per instruction set: each kernels_<isa>.cpp defines KVTOOL_CPU_ISA, includes its
// vector header and then this file, so every function here lives in that ISA's own namespace and
// the linker never mixes the copies. Only what the ISA's vector header brings is used here (no
// standard library templates, whose out-of-line copies would be shared across ISAs).
//
// Element types: float (float32) and uint16_t (bfloat16 bits). Arithmetic is float32 throughout;
// a bfloat16 result is rounded once, where torch's op would round it.
#pragma once

#include "argmax.h"
#include "attention_dims.h"
#include "attention_dims_bf16.h"
#include "attention_row_blocks.h"
#include "attention_rows.h"
#include "attention_rows_amx.h"
#include "attention_rows_bf16.h"
#include "draw.h"
#include "kernels_common.h"
#include "tile_linear_amx.h"

namespace kvtool::cpu::KVTOOL_CPU_ISA {

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
  if (t.rows_in_lanes) {
#if defined(__AMX_BF16__)
    if constexpr (bf16_pair_products<A, C>()) {
      if (pairs_fit(a.head_dim)) return attention_rows_amx<A>(a, t, scratch);
    }
#elif defined(__AVX512BF16__)
    if constexpr (bf16_pair_products<A, C>()) {
      if (pairs_fit(a.head_dim)) return attention_rows_bf16<A>(a, t, scratch);
    }
#endif
#if defined(__AVX2__)
    if (row_blocks_fit(a, t)) return attention_row_blocks<A, C>(a, t, scratch);
#endif
    attention_rows_in_lanes<A, C>(a, t, scratch);
  } else {
#if defined(__AVX512BF16__)
    if constexpr (bf16_pair_products<A, C>()) {
      if (pairs_fit(a.head_dim)) return decode_task_pairs<A>(a, t, scratch);
    }
#endif
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

// dot_row's weights (products of up to three rows, memory-bound) come in by the hardware prefetcher
// alone: a task's run of rows is one sequential stream, read as the memory floor's streaming read
// reads it (block_product, with more rows a line to multiply, asks ahead: see there). They used to
// ask for every line 4 KB ahead (prefetchnta): 1-2% faster a step than without on earlier days of
// the family 25 model 17 EPYC VM, and on the AVX-512 EPYC of 2026-11-26 the products without asking
// ran at oneDNN's rate or below. On 2026-11-27 the same VM kind took bfloat16 SmolLM2-135M decode
// steps in 0.86-0.95x the time without asking (float32 0.91x, and 1.00x at ~33 GB/s), and in
// 0.90-0.91x against asking 1 or 2 KB ahead, temporal or not (in-process A/Bs,
// results/cpu_decode_rows.md): where the asking loses, it loses far more than it gains where it
// wins.

// Where AMX is (the amx build: Intel Xeons), dot_row asks for the 256 bytes of weights each of its
// iterations reads 4 KB ahead, into L2 (prefetcht1): there the hardware prefetcher alone kept a
// batch-1 decode step well above its memory floor (1.75x in bfloat16 in the peers run on the family 6
// model 207 Xeon), and asking 2 KB ahead into L1 took SmolLM2-135M decode steps in 0.82x the time
// (bfloat16) and 0.86x (float32), medians of 4 alternating rounds of bench/cpu_forward.py (1 KB
// ahead gained less). Into L2 and further ahead, the lines wait there without holding the core's
// few L1 miss slots: a 302 MB bfloat16 weight's row product on two threads streamed 19-21.6 GB/s
// where 2 KB into L1 streamed 16-19.5 and a plain streaming read 20-23 (6 rounds; 8 and 16 KB ahead
// the same as 4), and decode steps took 0.95x the time (bfloat16, medians of 10 alternating
// processes) and 0.88x (float32, 8) (results/cpu_decode_rows.md). The AMD EPYCs lost by asking
// (above), so the other builds do not.
template <typename T>
static inline void ask_row_ahead(const T* w, int64_t k) {
#if defined(__AMX_BF16__)
  constexpr int64_t kAheadBytes = 4096;
  const char* p = reinterpret_cast<const char*>(w + k) + kAheadBytes;
  for (int line = 0; line < 4; ++line) _mm_prefetch(p + 64 * line, _MM_HINT_T1);
#else
  (void)w;
  (void)k;
#endif
}

// Whether bfloat16 rows take split_dot_rows: a build without native pair products (AVX2, AVX-512
// without AVX512-BF16, the portable one), where each element is widened before its multiply-add.
static constexpr bool kSplitBf16Rows = !Vec::has_bf16_pairs;

// w . x over d elements, four accumulators in flight: float32, or bfloat16 with AVX512-BF16 in dot
// products of the pairs as they lie (without them split_dot_rows).
template <typename T>
static inline float dot_row(const T* w, const T* x, int64_t d) {
  static_assert(sizeof(T) == sizeof(float) || !kSplitBf16Rows, "bfloat16 rows without pair products: split_dot_rows");
  Vec acc[4] = {Vec::zero(), Vec::zero(), Vec::zero(), Vec::zero()};
  int64_t k = 0;
#if defined(__AVX512BF16__)
  if constexpr (sizeof(T) == sizeof(uint16_t)) {
    // A 576-element row in 18 pair products where widening takes 36 multiply-adds and 72 shifts: one
    // core's product of a 576 x 576 weight in its caches took 5.2 us instead of 8.0, and a decode
    // step at 82 GB/s 1.01-1.025x less time (at 50 GB/s the same: the memory is the limit there).
    const auto* w2 = reinterpret_cast<const uint32_t*>(w);
    const auto* x2 = reinterpret_cast<const uint32_t*>(x);
    for (; k + 8 * W <= d; k += 8 * W) {
      ask_row_ahead(w, k);
      for (int u = 0; u < 4; ++u) {
        acc[u] = Vec::dot_pairs(acc[u], Vec::load_pairs_raw(w2 + k / 2 + u * W), Vec::load_pairs_raw(x2 + k / 2 + u * W));
      }
    }
    for (; k + 2 * W <= d; k += 2 * W) {
      acc[0] = Vec::dot_pairs(acc[0], Vec::load_pairs_raw(w2 + k / 2), Vec::load_pairs_raw(x2 + k / 2));
    }
  }
#endif
  if constexpr (sizeof(T) == sizeof(float)) {
    for (; k + 4 * W <= d; k += 4 * W) {
      ask_row_ahead(w, k);
      for (int u = 0; u < 4; ++u) acc[u] = Vec::fma(Vec::load(w + k + u * W), Vec::load(x + k + u * W), acc[u]);
    }
  }
  for (; k < d; k += W) acc[0] = Vec::fma(load_part(w + k, d - k), load_part(x + k, d - k), acc[0]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])).reduce_add();
}

// Input features up to which split_dot_rows takes x split once (on the stack, a float each); longer
// rows split x again for each weight row.
constexpr int64_t kMaxSplitX = 4096;

// x's elements as Vec::load_pairs splits them, stored: each 2W-element chunk's even elements, then its
// odd ones, for the chunks of whole 4W-element steps (what split_dot_rows' main loop reads).
static inline void split_x(const uint16_t* x, int64_t d, float* xs) {
  for (int64_t k = 0; k < d - d % (4 * W); k += 2 * W) {
    Vec even, odd;
    Vec::load_pairs(x + k, even, odd);
    even.store(xs + k);
    odd.store(xs + k + W);
  }
}

// dots[n] = w[n] . x over d bfloat16 elements for weight rows n in [0, num_w_rows) (w_stride apart),
// each element widened (split into even and odd elements) before its multiply-add, where no native
// pair product is (kSplitBf16Rows). xs: x split once by split_x (nullptr: split here for each row).
// A function of its own, never inlined, that walks the rows itself: inlined in linear a row at a time,
// GCC kept three of the four accumulators on the stack in the AVX2 build, each multiply-add waiting on
// a store and a load, and the widening made these products a bfloat16 decode step's limit: 2.16x its
// memory floor at ~62 GB/s on the family 25 model 17 EPYC run as AVX2. One thread's 576 x 576 product
// in its caches took 38.6-43.1 us there and takes 17.5 (through ops.linear, ~5 us of it the wrapper's
// checks), 3 rows 100.5 -> 44.5 us; the avx512 build, whose 32 registers held them, 18.1 -> 17.0
// (results/cpu_decode_rows.md). One weight row at a time, in order: two rows side by side (x split
// once for both) took decode steps 1.5-2x the time, the hardware prefetcher losing on two interleaved
// streams, and asking for the lines 4 KB ahead gained nothing (1.01x).
[[gnu::noinline]] static void split_dot_rows(const uint16_t* w, int64_t w_stride, int64_t num_w_rows,
                                             const uint16_t* x, const float* xs, int64_t d, float* dots) {
  for (int64_t n = 0; n < num_w_rows; ++n) {
    const uint16_t* row = w + n * w_stride;
    Vec acc[4] = {Vec::zero(), Vec::zero(), Vec::zero(), Vec::zero()};
    int64_t k = 0;
    for (; k + 4 * W <= d; k += 4 * W) {
      for (int h = 0; h < 2; ++h) {
        Vec we, wo, xe, xo;
        Vec::load_pairs(row + k + 2 * W * h, we, wo);
        if (xs != nullptr) {
          xe = Vec::load(xs + k + 2 * W * h);
          xo = Vec::load(xs + k + 2 * W * h + W);
        } else {
          Vec::load_pairs(x + k + 2 * W * h, xe, xo);
        }
        acc[2 * h] = Vec::fma(we, xe, acc[2 * h]);
        acc[2 * h + 1] = Vec::fma(wo, xo, acc[2 * h + 1]);
      }
    }
    for (; k < d; k += W) acc[0] = Vec::fma(load_part(row + k, d - k), load_part(x + k, d - k), acc[0]);
    dots[n] = ((acc[0] + acc[1]) + (acc[2] + acc[3])).reduce_add();
  }
}

// out[m][n] for input rows m0..m0+M-1: each weight vector is loaded once for all M rows and
// multiplied in registers beside their accumulators, where dot_row reads the weight row again (from
// L1) for every input row, two loads a multiply-add. One weight row at a time, in order, each line
// asked for into L2 kBlockAskAhead bytes ahead: at eight rows the products take long enough a line
// that the hardware prefetcher alone left the memory idle, and a float32 step's products from memory
// took 1.6x the time (results/cpu_decode_rows.md). C chains a row, so that at least four products
// are in flight for the multiply-adds' latency.
constexpr int64_t kBlockAskAhead = 4096;

template <typename T, int M>
static inline void block_product(const LinearArgs& a, int64_t n, int64_t m0) {
  constexpr int C = M >= 4 ? 1 : (M >= 2 ? 2 : 4);
  const T* w = static_cast<const T*>(a.weight) + n * a.weight_stride;
  const T* x[M];
  for (int m = 0; m < M; ++m) x[m] = static_cast<const T*>(a.x) + (m0 + m) * a.x_stride;
  Vec acc[C][M];
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < M; ++m) acc[c][m] = Vec::zero();
  const int64_t d = a.in_features;
  int64_t k = 0;
#if defined(__AVX512BF16__)
  if constexpr (sizeof(T) == sizeof(uint16_t)) {
    for (; k + 2 * W * C <= d; k += 2 * W * C) {
      __builtin_prefetch(reinterpret_cast<const char*>(w + k) + kBlockAskAhead, 0, 2);
      for (int c = 0; c < C; ++c) {
        const auto wp = Vec::load_pairs_raw(reinterpret_cast<const uint32_t*>(w + k + 2 * W * c));
        for (int m = 0; m < M; ++m) {
          const auto xp = Vec::load_pairs_raw(reinterpret_cast<const uint32_t*>(x[m] + k + 2 * W * c));
          acc[c][m] = Vec::dot_pairs(acc[c][m], wp, xp);
        }
      }
    }
  }
#endif
  if constexpr (sizeof(T) == sizeof(uint16_t)) {
    for (; k + 2 * W <= d; k += 2 * W) {
      __builtin_prefetch(reinterpret_cast<const char*>(w + k) + kBlockAskAhead, 0, 2);
      Vec we, wo;
      Vec::load_pairs(w + k, we, wo);
      // The even and odd elements chain apart where a row has chains to spare (C > 1).
      for (int m = 0; m < M; ++m) {
        Vec xe, xo;
        Vec::load_pairs(x[m] + k, xe, xo);
        acc[0][m] = Vec::fma(we, xe, acc[0][m]);
        acc[C - 1][m] = Vec::fma(wo, xo, acc[C - 1][m]);
      }
    }
  } else {
    for (; k + W * C <= d; k += W * C) {
      __builtin_prefetch(reinterpret_cast<const char*>(w + k) + kBlockAskAhead, 0, 2);
      for (int c = 0; c < C; ++c) {
        const Vec wv = Vec::load(w + k + W * c);
        for (int m = 0; m < M; ++m) acc[c][m] = Vec::fma(wv, Vec::load(x[m] + k + W * c), acc[c][m]);
      }
    }
  }
  for (; k < d; k += W) {
    const Vec wv = load_part(w + k, d - k);
    for (int m = 0; m < M; ++m) acc[0][m] = Vec::fma(wv, load_part(x[m] + k, d - k), acc[0][m]);
  }
  const T* bias = static_cast<const T*>(a.bias);
  const float b = bias != nullptr ? load_scalar(bias + n) : 0.0f;
  for (int m = 0; m < M; ++m) {
    Vec sum = acc[0][m];
    for (int c = 1; c < C; ++c) sum = sum + acc[c][m];
    store_scalar(static_cast<T*>(a.out) + (m0 + m) * a.out_stride + n, sum.reduce_add() + b);
  }
}

// Output features [begin, end) for every input row, each weight read from memory once. Up to
// kMinBlockRows - 1 rows (decode steps at batch 1 to 3: memory-bound) a weight row at a time, dot_row
// for each input row while the weight row is in L1; more in blocks of up to kRowBlock rows (what the
// registers hold beside their accumulators), block_product for each weight row. At 8 rows a float32
// step's products from memory took 0.62-0.67x the time of the first way, bfloat16 0.65-0.72x; at 4
// rows 0.96-1.09x (a C++ loop over SmolLM2-135M's matrices, two threads, results/cpu_decode_rows.md).
// (kMinBlockRows: kernel_args.h.)
template <typename T>
static void linear_typed(const LinearArgs& a, int64_t begin, int64_t end) {
  if (a.num_rows < kMinBlockRows) {
    const T* weight = static_cast<const T*>(a.weight);
    const T* bias = static_cast<const T*>(a.bias);
    // Features n, n + stream_rows, ...: a row of each stream in turn (one stream: n alone).
    const int64_t stream_rows = a.stream_rows > 0 ? a.stream_rows : a.out_features;
    if constexpr (sizeof(T) == sizeof(uint16_t) && kSplitBf16Rows) {
      // Each input row's x split once; weight rows a run at a time, every input row's dots while the
      // run is in the caches (kSplitRun rows). Each stream's features of the range in turn.
      constexpr int64_t kSplitRun = 16;
      const int64_t d = a.in_features;
      alignas(64) float xs[3][kMaxSplitX];
      static_assert(kMinBlockRows - 1 <= 3, "a split x for each input row of a row product");
      for (int64_t m = 0; m < a.num_rows && d <= kMaxSplitX; ++m) {
        split_x(static_cast<const T*>(a.x) + m * a.x_stride, d, xs[m]);
      }
      for (int64_t stream = begin; stream < a.out_features; stream += stream_rows) {
        const int64_t stream_end = min64(a.out_features, stream - begin + end);
        for (int64_t n0 = stream; n0 < stream_end; n0 += kSplitRun) {
          const int64_t run = min64(kSplitRun, stream_end - n0);
          for (int64_t m = 0; m < a.num_rows; ++m) {
            float dots[kSplitRun];
            split_dot_rows(weight + n0 * a.weight_stride, a.weight_stride, run,
                           static_cast<const T*>(a.x) + m * a.x_stride, d <= kMaxSplitX ? xs[m] : nullptr, d,
                           dots);
            for (int64_t r = 0; r < run; ++r) {
              const float b = bias != nullptr ? load_scalar(bias + n0 + r) : 0.0f;
              store_scalar(static_cast<T*>(a.out) + m * a.out_stride + n0 + r, dots[r] + b);
            }
          }
        }
      }
    } else {
      for (int64_t first = begin; first < end; ++first) {
        for (int64_t n = first; n < a.out_features; n += stream_rows) {
          const T* w = weight + n * a.weight_stride;
          const float b = bias != nullptr ? load_scalar(bias + n) : 0.0f;
          for (int64_t m = 0; m < a.num_rows; ++m) {
            const T* x = static_cast<const T*>(a.x) + m * a.x_stride;
            store_scalar(static_cast<T*>(a.out) + m * a.out_stride + n, dot_row(w, x, a.in_features) + b);
          }
        }
      }
    }
    return;
  }
  constexpr int kRowBlock = W >= 16 ? 8 : 4;
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t m0 = 0; m0 < a.num_rows; m0 += kRowBlock) {
      with_count<kRowBlock>(min64(kRowBlock, a.num_rows - m0),
                            [&](auto rows) { block_product<T, decltype(rows)::value>(a, n, m0); });
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

// ---- the first largest value ------------------------------------------------------------------

ArgMax argmax(const void* data, DType dtype, int64_t begin, int64_t end) {
  ArgMax result{};
  with_type(dtype, [&](auto t) { result = argmax_typed(static_cast<const decltype(t)*>(data), begin, end); });
  return result;
}

int64_t draw(const void* data, DType dtype, int64_t size, const DrawParams& params, float* scratch) {
  int64_t index = 0;
  with_type(dtype, [&](auto t) { index = draw_typed(static_cast<const decltype(t)*>(data), size, params, scratch); });
  return index;
}

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
