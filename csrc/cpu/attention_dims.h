// The decode layout of attention (few query rows: a decode token's group of heads, for every KV head
// of the sequence in one task), compiled once per instruction set (kernels_impl.h). Lanes would sit
// mostly idle with rows along them, so the head dimension runs along the lanes instead: a score is a
// dot product of a q row and a key row, and o [rows][head_dim] accumulates p-weighted value rows.
//
// Keys and values are read where the cache holds them, float32 or bfloat16, never copied: a decode
// step reads every cached token once per layer, so the kernel is as fast as it streams the cache.
#pragma once

#include "kernels_common.h"

namespace kvtool::cpu::KVTOOL_CPU_ISA {

// A bfloat16 row whose length is a whole number of vector pairs is read 2W elements at a time and
// split into its even and odd elements (Vec::load_pairs: two in-lane operations, where widening W at
// a time takes a lane-crossing one per vector). q and o are held in that order too, each 2W-element
// chunk's even elements first: dot products and weighted sums of rows do not depend on the order of
// their elements, and the output is put back in order once per task.
template <typename C>
static inline bool paired_rows(int64_t head_dim) {
  return sizeof(C) == sizeof(uint16_t) && head_dim % (2 * W) == 0;
}

// Where element e of a head row sits in a paired row.
static inline int64_t paired_lane(int64_t e) {
  const int64_t r = e % (2 * W);
  return e - r + (r % 2) * W + r / 2;
}

// NV vectors of a cache row as float32; d: the elements left in the row from p (unless Whole, the
// last vector may be partial).
template <typename C, bool Paired, int NV, bool Whole>
static inline void load_row(const C* p, int64_t d, Vec* out) {
  if constexpr (Paired) {
    static_assert(NV % 2 == 0, "a paired row is read in vector pairs");
    for (int v = 0; v < NV; v += 2) Vec::load_pairs(p + v * W, out[v], out[v + 1]);
  } else if constexpr (Whole) {
    for (int v = 0; v < NV; ++v) out[v] = Vec::load(p + v * W);
  } else {
    for (int v = 0; v < NV; ++v) out[v] = load_part(p + v * W, d - v * W);
  }
}

// One vector per row.
template <int R>
struct RowVecs {
  Vec v[R];
};

// For each row r, lane i of the result: the lanes of leaf(first + i).v[r] reduced by `combine` (a
// lane-wise sum or max), over the 2^L leaves first .. first + 2^L - 1 (with L = Vec::fold_levels, W
// of them): a transposing reduction on Vec::pair_lanes. Depth first, so that a few vectors a row are
// live at a time: holding a whole tile's W products for one transposing sum spilled them (R rows x W
// vectors), and a bfloat16 decode layer of SmolLM2-135M (one thread, cache in L2) took 26.1 us where
// it now takes 22.7.
template <int L, typename Leaf, typename Combine>
[[gnu::always_inline]] static inline auto across_lanes(int first, Leaf& leaf, Combine combine) {
  if constexpr (L == 0) {
    return leaf(first);
  } else {
    auto a = across_lanes<L - 1>(first, leaf, combine);
    const auto b = across_lanes<L - 1>(first + (1 << (L - 1)), leaf, combine);
    for (int r = 0; r < static_cast<int>(sizeof(a.v) / sizeof(Vec)); ++r) {
      Vec x, y;
      Vec::template pair_lanes<L - 1>(a.v[r], b.v[r], x, y);
      a.v[r] = combine(x, y);
    }
    return a;
  }
}

// s[r][j] (+)= the scores of R rows against each key j of a tile, W keys at a time: key_products(j,
// acc) adds key j's lane-wise products with each row r into acc[r][0] and acc[r][1] (Chains 2: half
// the additions' latency; 1: acc[r][0] alone), and the W keys' vectors of a row fold into its W
// scores, times scale. `add`: a later chunk of a row longer than the registers hold adds to the
// scores of the earlier ones. `ahead` (or nullptr) asks for a few of the next tile's lines before each
// key, from a copy of its cursor the compiler keeps in registers (through the pointer, the asking
// took a third of the scores' time). Callers mark key_products always_inline: GCC left chunk_scores'
// a call at each key, its q vectors reloaded from memory every time, and a float32 decode layer took
// 1.4x the time.
template <int R, int Chains = 2, typename C, typename KeyProducts>
static inline void transposed_scores(int num_keys, float* s, bool add, float scale, TileAhead<C>* ahead,
                                     KeyProducts key_products) {
  typename TileAhead<C>::Cursor cursor = ahead != nullptr ? ahead->cursor : typename TileAhead<C>::Cursor{};
  // (GCC ignores [[gnu::always_inline]] on a lambda; without inlining each key is a call.)
  auto leaf = [&](int j) __attribute__((always_inline)) {
    if (ahead != nullptr) ahead->step(cursor);
    Vec acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Vec::zero();
    if (j < num_keys) key_products(j, acc);
    RowVecs<R> out;
    for (int r = 0; r < R; ++r) out.v[r] = Chains == 1 ? acc[r][0] : acc[r][0] + acc[r][1];
    return out;
  };
  for (int j0 = 0; j0 < num_keys; j0 += W) {
    const RowVecs<R> sums = across_lanes<Vec::fold_levels>(j0, leaf, [](Vec x, Vec y) { return x + y; });
    for (int r = 0; r < R; ++r) {
      Vec scores = sums.v[r];
      if (add) scores = scores + Vec::load(s + r * kKeyTile + j0);
      if (scale != 1.0f) scores = scores * Vec::set1(scale);
      scores.store(s + r * kKeyTile + j0);
    }
  }
  if (ahead != nullptr) ahead->cursor = cursor;
}

// s[r][j] (+)= q[r] . key[j] for R rows of one KV head and NV vectors of the head dimension (q and the
// rows start at the same element; `offset` from each key pointer).
template <typename C, bool Paired, bool Whole, int R, int NV>
static void chunk_scores(const float* q, int64_t padded_d, const KeyTile<C>& tile, int64_t offset, int64_t d,
                         float* s, bool add) {
  Vec qv[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) qv[r][v] = Vec::load(q + r * padded_d + v * W);
  transposed_scores<R>(tile.num_keys, s, add, 1.0f, tile.ahead,
                       [&](int j, Vec (&acc)[R][2]) __attribute__((always_inline)) {
    Vec k[NV];
    load_row<C, Paired, NV, Whole>(tile.key[j] + offset, d, k);
    for (int v = 0; v < NV; ++v)
      for (int r = 0; r < R; ++r) acc[r][v & 1] = Vec::fma(qv[r][v], k[v], acc[r][v & 1]);
  });
}

// o[r] = alpha[r] o[r] + sum_j p[r][j] value[j] for R rows of one KV head, NV vectors of the head
// dimension: each value row is read once for all R rows.
template <typename C, bool Paired, bool Whole, int R, int NV>
static void chunk_values(const KeyTile<C>& tile, int64_t offset, const float* p, const float* alpha, int64_t d,
                         float* o, int64_t padded_d) {
  Vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec::load(o + r * padded_d + v * W) * Vec::set1(alpha[r]);
  // The next tile's asking steps on at each value row, as at each key of the scores (TileAhead).
  TileAhead<C>* ahead = tile.ahead;
  typename TileAhead<C>::Cursor cursor = ahead != nullptr ? ahead->cursor : typename TileAhead<C>::Cursor{};
  for (int j = 0; j < tile.num_keys; ++j) {
    if (ahead != nullptr) ahead->step(cursor);
    Vec values[NV];
    load_row<C, Paired, NV, Whole>(tile.value[j] + offset, d, values);
    for (int r = 0; r < R; ++r) {
      const Vec weight = Vec::set1(p[r * kKeyTile + j]);
      for (int v = 0; v < NV; ++v) acc[r][v] = Vec::fma(weight, values[v], acc[r][v]);
    }
  }
  if (ahead != nullptr) ahead->cursor = cursor;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v].store(o + r * padded_d + v * W);
}

// The task's rows and their running state: q (scaled) and o [rows][padded_d], the tile's scores and
// weights s [rows][kKeyTile], the tile's rescaling of each row's output alpha [rows].
struct DecodeRows {
  float* q;
  float* o;
  float* s;
  float* alpha;
  int64_t rows, rows_per_head, head_stride, d, padded_d;
};

// Rows per chunk_scores / chunk_values call: as many as fit in the registers beside one key or value row.
template <int NV>
constexpr int rows_per_call() {
  constexpr int registers = W >= 16 ? 32 : 16;
  constexpr int rows = (registers - NV - 2) / NV;
  return rows < 1 ? 1 : (rows > 4 ? 4 : rows);
}

// Calls f(std::integral_constant<int, R>, m, head_offset) for the task's rows in runs of at most Max,
// each run rows m..m+R-1 of one KV head, whose keys and values lie head_offset past a key pointer.
template <int Max, typename F>
static inline void over_head_rows(const DecodeRows& rows, F&& f) {
  for (int64_t first = 0; first < rows.rows; first += rows.rows_per_head) {
    const int64_t head_offset = first / rows.rows_per_head * rows.head_stride;
    for (int64_t m = first; m < first + rows.rows_per_head; m += Max) {
      with_count<Max>(min64(Max, first + rows.rows_per_head - m), [&](auto r) { f(r, m, head_offset); });
    }
  }
}

// A tile's scores (or weighted values) for every row, over the NV vectors of the head dimension from
// vector v0. A chunk of whole vectors (Whole) loads them plainly: with a length check at each vector
// GCC kept the values' accumulators in memory as well, storing every one of them at each key. With
// that and key_products inlined, a float32 decode layer of SmolLM2-135M on two threads of a family
// 25 model 17 EPYC took ~35 us where it took 45-60 with its cache in L2, 0.87x the time from memory,
// and whole decode steps 0.95-0.98x (AVX2 and AVX-512 code alike, and bfloat16 rows without
// AVX512-BF16 as much: results/cpu_attention.md). A chunk ending in a part-filled vector (a head_dim
// not a multiple of W, which few models have) runs a row a call: its own code for every row count
// made the kernels' largest file take 1.9x the time to compile.
template <typename C, bool Paired, int NV>
static void chunk_products(const DecodeRows& rows, const KeyTile<C>& tile, int64_t v0, bool scores) {
  const int64_t d = rows.d - v0 * W, padded_d = rows.padded_d;
  auto run = [&](auto whole) {
    constexpr bool Whole = decltype(whole)::value;
    over_head_rows<Whole ? rows_per_call<NV>() : 1>(rows, [&](auto r, int64_t m, int64_t head_offset) {
      constexpr int R = decltype(r)::value;
      const int64_t offset = head_offset + v0 * W;
      if (scores) {
        chunk_scores<C, Paired, Whole, R, NV>(rows.q + m * padded_d + v0 * W, padded_d, tile, offset, d,
                                              rows.s + m * kKeyTile, v0 > 0);
      } else {
        chunk_values<C, Paired, Whole, R, NV>(tile, offset, rows.s + m * kKeyTile, rows.alpha + m, d,
                                              rows.o + m * padded_d + v0 * W, padded_d);
      }
    });
  };
  if constexpr (Paired) {
    run(std::true_type{});
  } else if (d >= NV * W) {
    run(std::true_type{});
  } else {
    run(std::false_type{});
  }
}

// The head dimension in chunks of at most 8 vectors, each held in registers while the tile's keys
// or values stream past.
template <typename C, bool Paired>
static void tile_products(const DecodeRows& rows, const KeyTile<C>& tile, bool scores) {
  const int64_t num_vectors = rows.padded_d / W;
  for (int64_t v0 = 0; v0 < num_vectors; v0 += 8) {
    switch (min64(8, num_vectors - v0)) {
#define KVTOOL_CHUNK_CASE(n)                                                        \
  case n:                                                                           \
    if constexpr (!Paired || n % 2 == 0) chunk_products<C, Paired, n>(rows, tile, v0, scores); \
    break;
      KVTOOL_CHUNK_CASE(1)
      KVTOOL_CHUNK_CASE(2)
      KVTOOL_CHUNK_CASE(3)
      KVTOOL_CHUNK_CASE(4)
      KVTOOL_CHUNK_CASE(5)
      KVTOOL_CHUNK_CASE(6)
      KVTOOL_CHUNK_CASE(7)
      KVTOOL_CHUNK_CASE(8)
#undef KVTOOL_CHUNK_CASE
      default: break;
    }
  }
}

// The online softmax of a tile for every row: masked scores to weights (in place), the running max
// and sum, and alpha, the rescaling of each row's output so far. The rows' bookkeeping runs W rows a
// vector: each row's tile max and sum reduced across lanes together, the rows' rescalings in one
// exponential. Row by row (a horizontal max, a scalar exp and a horizontal sum each, one waiting on
// the other) it took ~10% of a bfloat16 decode layer's attention of SmolLM2-135M, one thread, cache in
// L2; this way the layer takes 0.95x the time (27.9 us -> 26.5).
static void tile_softmax(const AttentionArgs& a, const AttentionTask& t, const DecodeRows& rows, int64_t k0,
                         int num_keys, const float* positions, float* row_max, float* row_sum) {
  const int64_t last_position = t.first_position + t.num_queries - 1;
  // A tile reaching past the first query, or (with a window) back past the last query's window, is masked.
  const bool causal_edge = k0 + num_keys - 1 > t.first_position;
  const bool window_edge = a.sliding_window > 0 && k0 <= last_position - a.sliding_window;
  for (int64_t m = 0; m < rows.rows; ++m) {
    float* sm = rows.s + m * kKeyTile;
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
  }
  const Vec neg_inf = Vec::set1(kNegInf);
  for (int64_t m0 = 0; m0 < rows.rows; m0 += W) {
    const int count = static_cast<int>(min64(W, rows.rows - m0));
    auto tile_max_of = [&](int i) {
      RowVecs<1> max{{neg_inf}};
      for (int j = 0; i < count && j < num_keys; j += W) {
        max.v[0] = Vec::max(max.v[0], Vec::load(rows.s + (m0 + i) * kKeyTile + j));
      }
      return max;
    };
    const Vec tile_max =
        across_lanes<Vec::fold_levels>(0, tile_max_of, [](Vec x, Vec y) { return Vec::max(x, y); }).v[0];
    // A row that has seen no visible key yet keeps max -inf, and its weights come out 0 rather than NaN.
    const Vec old_max = Vec::load_n(row_max + m0, count);
    const Vec new_max = Vec::select(Vec::gt(tile_max, old_max), tile_max, old_max);
    const Vec shift = Vec::select(Vec::gt(new_max, neg_inf), new_max, Vec::zero());
    const Vec alpha = Vec::exp(old_max - shift);
    alignas(64) float shifts[W];
    shift.store(shifts);
    auto weights_of = [&](int i) {
      RowVecs<1> sum{{Vec::zero()}};
      for (int j = 0; i < count && j < num_keys; j += W) {
        float* sm = rows.s + (m0 + i) * kKeyTile + j;
        const Vec p = Vec::exp(Vec::load(sm) - Vec::set1(shifts[i]));
        p.store(sm);
        sum.v[0] = sum.v[0] + p;
      }
      return sum;
    };
    const Vec sums = across_lanes<Vec::fold_levels>(0, weights_of, [](Vec x, Vec y) { return x + y; }).v[0];
    Vec::fma(Vec::load_n(row_sum + m0, count), alpha, sums).store_n(row_sum + m0, count);
    new_max.store_n(row_max + m0, count);
    alpha.store_n(rows.alpha + m0, count);
  }
}

// A decode task's frame, whichever products it runs: the rows' state laid out in scratch, each row's
// query put in place by set_query(src, q) (q: the row's padded_d floats, zeroed), the key tiles
// walked (products(rows, tile, scores): a tile's scores, or after the softmax its weighted values),
// and the output written, element e of a row read from o at lane(e).
template <typename A, typename C, typename SetQuery, typename Products, typename Lane>
static void run_decode_task(const AttentionArgs& a, const AttentionTask& t, float* scratch, SetQuery set_query,
                            Products products, Lane lane) {
  // Row m: query m % nq of head m / nq counted from the task's first KV head's group (so of KV head
  // kv_head + m / (nq * group)).
  const int64_t group = a.num_heads / a.num_kv_heads, d = a.head_dim, nq = t.num_queries;
  const int64_t num_rows = nq * group * t.num_kv_heads, padded_d = round_up(d, W);
  DecodeRows rows{scratch, nullptr, nullptr, nullptr, num_rows, nq * group, a.head_stride, d, padded_d};
  rows.o = rows.q + num_rows * padded_d;
  rows.s = rows.o + num_rows * padded_d;
  float* row_max = rows.s + num_rows * kKeyTile;
  float* row_sum = row_max + num_rows;
  float* positions = row_sum + num_rows;
  rows.alpha = positions + num_rows;

  for (int64_t m = 0; m < num_rows; ++m) {
    const int64_t i = m % nq;
    const A* src = task_query<A>(a, t, m);
    float* q = rows.q + m * padded_d;
    for (int64_t e = 0; e < padded_d; ++e) q[e] = rows.o[m * padded_d + e] = 0.0f;
    set_query(src, q);
    row_max[m] = kNegInf;
    row_sum[m] = 0.0f;
    positions[m] = static_cast<float>(t.first_position + i);
  }

  // The first tile's lines are asked for when it is found; each next tile is found before this
  // tile's products and its lines asked for a few at a time while they run (TileAhead: a step at each
  // key of a scores call and of a values call, one of each a KV head at least; what is left after the
  // values). Stepping in the scores alone left the memory idle while the values ran: with the values'
  // steps as well, a bfloat16 decode step of SmolLM2-135M after ~1,060 tokens took 0.983x and 0.987x
  // the time, a float32 one 1.013x and 0.991x (in-process A/Bs, 16-24 rounds each, a family 25 model
  // 17 EPYC at 44-66 GB/s, results/cpu_attention.md).
  // A next tile that lies straight on from this one in memory (TileAhead::follows: the next block of
  // a layer-major pool) is left to the hardware prefetcher, already streaming there: asking for it as
  // well, those steps took 1.007x the time (bfloat16) and 1.016x (float32), medians of 6 A/Bs of 150
  // rounds at 35-65 GB/s. A tile elsewhere (blocks in descending order) is asked for as before (the
  // steps level with the old kernel): left to the hardware, those steps took 1.07x the time.
  KeyTile<C> tiles[2];
  TileAhead<C> ahead;
  ahead.rows = task_rows<C>(a, t);
  int current = 0;
  find_tile<kAheadTileAsk>(a, t, t.key_begin, static_cast<int>(min64(kKeyTile, t.key_end - t.key_begin)),
                           tiles[current]);
  ahead.begin(&tiles[current], 1);  // only for where the first tile ends (its lines are asked for)
  const char* tile_end = ahead.end();
  for (int64_t k0 = t.key_begin; k0 < t.key_end; k0 += kKeyTile) {
    KeyTile<C>& tile = tiles[current];
    tile.ahead = nullptr;
    if (k0 + kKeyTile < t.key_end) {
      KeyTile<C>& next = tiles[1 - current];
      find_tile<TileAsk::kNone>(a, t, k0 + kKeyTile, static_cast<int>(min64(kKeyTile, t.key_end - k0 - kKeyTile)),
                                next);
      ahead.begin(&next, 2 * static_cast<int64_t>(tile.num_keys) * t.num_kv_heads);
      if (!ahead.follows(tile_end)) tile.ahead = &ahead;
      tile_end = ahead.end();
    }
    products(rows, tile, true);
    tile_softmax(a, t, rows, k0, tile.num_keys, positions, row_max, row_sum);
    products(rows, tile, false);
    if (tile.ahead != nullptr) ahead.ask_rest();
    current = 1 - current;
  }

  write_task_output<A>(a, t, row_max, row_sum, [&](int64_t m, int64_t e) { return rows.o[m * padded_d + lane(e)]; });
}

template <typename A, typename C, bool Paired>
static void decode_task(const AttentionArgs& a, const AttentionTask& t, float* scratch) {
  auto lane = [](int64_t e) { return Paired ? paired_lane(e) : e; };
  run_decode_task<A, C>(
      a, t, scratch,
      [&](const A* src, float* q) {
        for (int64_t e = 0; e < a.head_dim; ++e) q[lane(e)] = load_scalar(src + e) * a.scale;
      },
      [](const DecodeRows& rows, const KeyTile<C>& tile, bool scores) { tile_products<C, Paired>(rows, tile, scores); },
      lane);
}

template <typename A, typename C>
static void attention_dims_in_lanes(const AttentionArgs& a, const AttentionTask& t, float* scratch) {
  if constexpr (sizeof(C) == sizeof(uint16_t)) {
    if (paired_rows<C>(a.head_dim)) return decode_task<A, C, true>(a, t, scratch);
  }
  decode_task<A, C, false>(a, t, scratch);
}

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
