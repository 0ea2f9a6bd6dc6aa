// The prompt layout of attention (rows along the vector lanes), compiled once per instruction set
// (kernels_impl.h); attention_dims.h holds the decode layout. The AVX2 and AVX-512 builds run a
// float32 task (or one over a bfloat16 cache without native bfloat16 products) with rows in registers
// instead (attention_row_blocks.h) where head_dim is a whole number of vectors (on AVX2, not the
// tasks whose rows fill this layout's register blocks exactly: row_blocks_fit).
#pragma once

#include "kernels_common.h"

namespace kvtool::cpu::KVTOOL_CPU_ISA {

// A task holds `rows` = num_queries x group query rows (the group: the query heads of one KV head),
// row m = h * num_queries + i for head h of the group and query i. Keys are visited kKeyTile at a
// time with the online softmax (running max and sum per row). Two layouts of the same arithmetic:
//
// - many rows (a prompt chunk): rows along the vector lanes. q is transposed once per task into
//   qt [head_dim][padded rows]; a score tile s [keys][rows] is k . qt, each key element broadcast
//   against a vector of rows; the output ot [head_dim][rows] accumulates v^T . p the same way. No
//   key is ever transposed and the softmax needs no horizontal reductions.
// - few rows (decode: one query x the group; attention_dims.h): lanes would sit mostly idle, so the
//   head dimension runs along the lanes instead: a score is a dot product of q and k rows, and o
//   [rows][head_dim] accumulates p-weighted v rows.

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
// by 4 row vectors; measured on a 1,056-token prompt, one thread: 176 GFLOP/s against 156 with 8 keys
// by 2 row vectors (6 row vectors, 24 accumulators, on two threads: 1.01x the time). With AVX2's 16
// registers, 12 accumulators (4 by 3 row vectors, beside 3 row vectors and a broadcast element): a
// 1,056-token prompt's attention on two threads of a family 25 model 17 EPYC took 0.90-0.96x
// (float32) and 0.94-0.95x (bfloat16 cache) the time of 4 by 2 (results/cpu_attention.md).
constexpr int kBlockKeys = 4;
constexpr int kBlockRows = W >= 16 ? 4 : 3;
constexpr int kValueDims = 4;
constexpr int kValueRows = kBlockRows;  // rows_tile_steps counts both products' blocks alike

// A prompt layout task's key tiles, each found a tile ahead: the next tile's lines are asked for
// (into L2) a few at a time while the current tile's products run, step() between their register
// blocks (TileAhead), and each tile's lines into L1 as its products start. Asked for only then, a
// tile's lines from memory kept the products waiting. With the cache from memory (SmolLM2-135M's
// shape, results/cpu_attention.md): 8 decode sequences sharing a 1,024-token prefix, whose tasks
// take this layout, took a layer 0.80-0.85x the time (float32) and 0.62-0.78x (bfloat16); a
// 32-token hit over its 1,024 cached tokens 0.88x and 0.79x. A whole 1,056-token prompt, whose
// cache it has just written (in the CPU's caches), 1.02x: the asking is a little work of its own.
template <typename C>
class TilesAhead {
 public:
  TilesAhead(const AttentionArgs& a, const AttentionTask& t) : a_(a), t_(t) { ahead_.rows = task_rows<C>(a, t); }
  // The tile at k0, its lines asked for into L1 now (from L2 after the first tile), and the next
  // tile's to be asked for over about num_steps steps.
  const KeyTile<C>& start(int64_t k0, int64_t num_steps) {
    find_tile(a_, t_, k0, num_keys(k0), tile_);
    has_next_ = k0 + kKeyTile < t_.key_end;
    if (has_next_) {
      find_tile<TileAsk::kNone>(a_, t_, k0 + kKeyTile, num_keys(k0 + kKeyTile), next_);
      ahead_.begin(&next_, std::max<int64_t>(1, num_steps));
    }
    return tile_;
  }
  void step() {
    if (has_next_) ahead_.step(ahead_.cursor);
  }
  // Done with the current tile: what is left of the next one's lines is asked for.
  void finish() {
    if (has_next_) ahead_.ask_rest();
  }

 private:
  int num_keys(int64_t k0) const { return static_cast<int>(min64(kKeyTile, t_.key_end - k0)); }

  const AttentionArgs& a_;
  const AttentionTask& t_;
  KeyTile<C> tile_, next_;
  TileAhead<C> ahead_;
  bool has_next_ = false;
};

// The step() calls of a tile's products: one after each register block of keys (scores) and of head
// dimensions (values), for each block of row vectors (kBlockRows of them, then 2, then 1, as the
// products run them; kValueRows == kBlockRows).
static inline int64_t rows_tile_steps(int64_t num_vectors, int num_keys, int64_t d) {
  const int64_t left = num_vectors % kBlockRows;
  const int64_t num_row_blocks = num_vectors / kBlockRows + left / 2 + left % 2;
  return num_row_blocks * ((num_keys + kBlockKeys - 1) / kBlockKeys + (d + kValueDims - 1) / kValueDims);
}

template <int NQ, typename Step>
static void scores(const float* const* key, int num_keys, const float* qt, int64_t padded, int64_t d, float* s,
                   int v0, Step step) {
  int j = 0;
  for (; j + kBlockKeys <= num_keys; j += kBlockKeys) {
    score_block<kBlockKeys, NQ>(key, qt, padded, d, s, j, v0);
    step();
  }
  for (; j < num_keys; ++j) score_block<1, NQ>(key, qt, padded, d, s, j, v0);
}

template <int NQ, typename Step>
static void weighted_values(const float* const* value, int num_keys, const float* p, int64_t padded, int64_t d,
                            float* ot, int v0, Step step) {
  int64_t e = 0;
  for (; e + kValueDims <= d; e += kValueDims) {
    value_block<kValueDims, NQ>(value, num_keys, p, padded, ot, e, v0);
    step();
  }
  for (; e < d; ++e) value_block<1, NQ>(value, num_keys, p, padded, ot, e, v0);
}

// Pointers to the tile's key and value rows (float32) of the task's KV head (a prompt layout task
// has one), widened into kbuf/vbuf [kKeyTile][head_dim] from a bfloat16 cache: each element serves
// every row vector of the task, so widening it once pays.
template <typename C>
static void tile_rows(const AttentionArgs& a, const KeyTile<C>& tile, float* kbuf, float* vbuf, const float** key,
                      const float** value) {
  const int64_t d = a.head_dim;
  for (int j = 0; j < tile.num_keys; ++j) {
    if constexpr (sizeof(C) == sizeof(float)) {
      key[j] = tile.key[j];
      value[j] = tile.value[j];
    } else {
      copy_converted(tile.key[j], kbuf + j * d, d);
      copy_converted(tile.value[j], vbuf + j * d, d);
      key[j] = kbuf + j * d;
      value[j] = vbuf + j * d;
    }
  }
}

// The online softmax of a score tile s [kKeyTile][padded] (scores scaled by score_scale first): masked
// scores to weights in place, each row's running max and sum, and the output rows so far (ot
// [head_dim][padded]) rescaled where a row's max grew.
static void rows_softmax(const AttentionArgs& a, const AttentionTask& t, int64_t k0, int num_keys, int64_t padded,
                         float score_scale, const float* positions, float* s, float* row_max, float* row_sum,
                         float* ot) {
  const int64_t last_position = t.first_position + t.num_queries - 1;
  // A tile reaching past the first query, or (with a window) back past the last query's window, is masked.
  const bool causal_edge = k0 + num_keys - 1 > t.first_position;
  const bool window_edge = a.sliding_window > 0 && k0 <= last_position - a.sliding_window;
  const Vec scale = Vec::set1(score_scale);
  for (int64_t vec = 0; vec < padded / W; ++vec) {
    float* sv = s + vec * W;
    Vec query_positions = Vec::load(positions + vec * W);
    Vec tile_max = Vec::set1(kNegInf);
    for (int j = 0; j < num_keys; ++j) {
      Vec score = Vec::load(sv + j * padded);
      if (score_scale != 1.0f) score = score * scale;
      if (causal_edge || window_edge) {
        score = visible_or_neg_inf(score, static_cast<float>(k0 + j), query_positions, a.sliding_window);
      }
      if (score_scale != 1.0f || causal_edge || window_edge) score.store(sv + j * padded);
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
      for (int64_t e = 0; e < a.head_dim; ++e) {
        (Vec::load(ot + e * padded + vec * W) * r.alpha).store(ot + e * padded + vec * W);
      }
    }
  }
}

// dst[e][m] (rows of `padded` floats) = element e of row m for e < n and m < padded, W rows by W
// elements at a time, transposed in registers: row(m, e0, count) loads row m's elements [e0, e0 +
// count) (zeros past them). A store per element took ~5% of a prompt's attention (perf, float32 and
// bfloat16 alike, 1,053 tokens).
template <typename Row>
static inline void rows_into_lanes(int64_t padded, int64_t n, float* dst, Row row) {
  for (int64_t m0 = 0; m0 < padded; m0 += W) {
    for (int64_t e0 = 0; e0 < n; e0 += W) {
      const int64_t count = min64(W, n - e0);
      Vec v[W];
      for (int r = 0; r < W; ++r) v[r] = row(m0 + r, e0, count);
      transpose(v);
      for (int c = 0; c < count; ++c) v[transposed_index(c)].store(dst + (e0 + c) * padded + m0);
    }
  }
}

// The output rows of a task whose rows ran along the lanes: row m's element e is lanes(e)[m], W rows
// by W elements at a time, transposed in registers (element by element it took 2-8% of a prompt's
// attention, and 8% of a shared prefix's decode rows on AMX): divided by row_sum[m] into the step's
// output, or for a task covering part of its queries' keys into its partials, with each row's max
// and sum.
template <typename A, typename Lanes>
static void write_rows_from_lanes(const AttentionArgs& a, const AttentionTask& t, const float* row_max,
                                  const float* row_sum, Lanes lanes) {
  const int64_t d = a.head_dim, rows = t.num_queries * (a.num_heads / a.num_kv_heads) * t.num_kv_heads;
  for (int64_t m0 = 0; m0 < rows; m0 += W) {
    for (int64_t e0 = 0; e0 < d; e0 += W) {
      const int64_t count = min64(W, d - e0);
      Vec v[W];
      for (int c = 0; c < W; ++c) v[c] = c < count ? Vec::load(lanes(e0 + c) + m0) : Vec::zero();
      transpose(v);
      for (int r = 0; r < W && m0 + r < rows; ++r) {
        const int64_t m = m0 + r;
        if (t.partial < 0) {
          store_part(v[transposed_index(r)] * Vec::set1(1.0f / row_sum[m]), task_output<A>(a, t, m) + e0, count);
          continue;
        }
        const PartialRow partial = partial_row(a, t, rows, m);
        store_part(v[transposed_index(r)], partial.out + e0, count);
        partial.stats[0] = row_max[m];
        partial.stats[1] = row_sum[m];
      }
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

  const Vec scale = Vec::set1(a.scale);
  rows_into_lanes(padded, d, qt, [&](int64_t m, int64_t e0, int64_t count) {
    return m < rows ? load_part(task_query<A>(a, t, m) + e0, count) * scale : Vec::zero();
  });
  for (int64_t m = 0; m < padded; ++m) {
    // Padding rows copy the last query's position: finite scores, never NaN; their output is dropped.
    positions[m] = static_cast<float>(t.first_position + (m < rows ? m % nq : nq - 1));
    row_max[m] = kNegInf;
    row_sum[m] = 0.0f;
  }
  for (int64_t e = 0; e < d * padded; ++e) ot[e] = 0.0f;

  const float* key[kKeyTile];
  const float* value[kKeyTile];
  TilesAhead<C> tiles(a, t);
  auto step = [&] { tiles.step(); };
  for (int64_t k0 = t.key_begin; k0 < t.key_end; k0 += kKeyTile) {
    const int num_keys = static_cast<int>(min64(kKeyTile, t.key_end - k0));
    tile_rows<C>(a, tiles.start(k0, rows_tile_steps(num_vectors, num_keys, d)), kbuf, vbuf, key, value);
    int64_t v = 0;
    for (; v + kBlockRows <= num_vectors; v += kBlockRows)
      scores<kBlockRows>(key, num_keys, qt, padded, d, s, static_cast<int>(v), step);
    for (; v + 2 <= num_vectors; v += 2) scores<2>(key, num_keys, qt, padded, d, s, static_cast<int>(v), step);
    for (; v < num_vectors; ++v) scores<1>(key, num_keys, qt, padded, d, s, static_cast<int>(v), step);
    rows_softmax(a, t, k0, num_keys, padded, 1.0f, positions, s, row_max, row_sum, ot);
    v = 0;
    for (; v + kValueRows <= num_vectors; v += kValueRows)
      weighted_values<kValueRows>(value, num_keys, s, padded, d, ot, static_cast<int>(v), step);
    for (; v + 2 <= num_vectors; v += 2)
      weighted_values<2>(value, num_keys, s, padded, d, ot, static_cast<int>(v), step);
    for (; v < num_vectors; ++v) weighted_values<1>(value, num_keys, s, padded, d, ot, static_cast<int>(v), step);
    tiles.finish();
  }
  write_rows_from_lanes<A>(a, t, row_max, row_sum, [&](int64_t e) { return ot + e * padded; });
}

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
