// Helpers of every CPU kernel (kernels_impl.h, attention_rows.h, attention_dims.h), compiled once per
// instruction set as kernels_impl.h describes: everything here lives in the ISA's own namespace.
#pragma once

#include <algorithm>
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
    return Vec::bf16_rounded(v);
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

template <typename A, typename C>
static void copy_converted(const A* src, C* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += W) store_part(load_part(src + i, n - i), dst + i, n - i);
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Calls f(std::integral_constant<int, n>) for n = count, 1 <= count <= Max <= 8.
template <int Max, typename F>
static inline void with_count(int64_t count, F&& f) {
  switch (count) {
    case 8: if constexpr (Max >= 8) f(std::integral_constant<int, 8>{}); break;
    case 7: if constexpr (Max >= 7) f(std::integral_constant<int, 7>{}); break;
    case 6: if constexpr (Max >= 6) f(std::integral_constant<int, 6>{}); break;
    case 5: if constexpr (Max >= 5) f(std::integral_constant<int, 5>{}); break;
    case 4: if constexpr (Max >= 4) f(std::integral_constant<int, 4>{}); break;
    case 3: if constexpr (Max >= 3) f(std::integral_constant<int, 3>{}); break;
    case 2: if constexpr (Max >= 2) f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// W vectors turned lane for vector in place (a W x W transpose in registers), with the lane pairings
// of the reductions (Vec::pair_lanes, level L pairing vectors 2^L apart): afterwards
// v[transposed_index(c)] holds lane c of every input vector, in order.
template <int L = 0>
static inline void transpose(Vec (&v)[W]) {
  if constexpr (L < Vec::fold_levels) {
    constexpr int dist = 1 << L;
#pragma GCC unroll 16
    for (int i = 0; i < W; ++i) {
      if (i & dist) continue;
      Vec x, y;
      Vec::pair_lanes<L>(v[i], v[i + dist], x, y);
      v[i] = x;
      v[i + dist] = y;
    }
    transpose<L + 1>(v);
  }
}

// Where transpose() leaves lane c: the pairings' second level swaps bits 0 and 1 of the index.
static constexpr int transposed_index(int c) { return W < 4 ? c : (c & ~3) | (c & 1) << 1 | (c >> 1 & 1); }

// The step row of a task's query i.
static inline int64_t query_row(const AttentionArgs& a, const AttentionTask& t, int64_t i) {
  return t.shared < 0 ? t.first_row + i : a.shared_queries[t.shared + i].row;
}

// Row m of a task's rows (m = h * num_queries + i: head h of the task's heads, query i): its query
// head among the model's, its query [head_dim], and where its output goes in the step's (a task
// covering all its queries' keys).
static inline int64_t task_head(const AttentionArgs& a, const AttentionTask& t, int64_t m) {
  return static_cast<int64_t>(t.kv_head) * (a.num_heads / a.num_kv_heads) + m / t.num_queries;
}

template <typename A>
static inline const A* task_query(const AttentionArgs& a, const AttentionTask& t, int64_t m) {
  return static_cast<const A*>(a.query) + query_row(a, t, m % t.num_queries) * a.query_stride +
         task_head(a, t, m) * a.head_dim;
}

template <typename A>
static inline A* task_output(const AttentionArgs& a, const AttentionTask& t, int64_t m) {
  return static_cast<A*>(a.out) + (t.first_row + m % t.num_queries) * a.out_stride + task_head(a, t, m) * a.head_dim;
}

// Where a task covering part of its queries' keys (partial >= 0) leaves row m of its `rows` rows
// (m = h * num_queries + i: head h of the task's heads, query i): the unnormalised output
// [head_dim], and the row's max and sum of weights.
struct PartialRow {
  float* out;
  float* stats;
};

static inline PartialRow partial_row(const AttentionArgs& a, const AttentionTask& t, int64_t rows, int64_t m) {
  const int64_t d = a.head_dim;
  if (t.shared < 0) return {a.partials + t.partial + m * d, a.partials + t.partial + rows * d + 2 * m};
  // A shared task's queries are one per sequence, each with a sequence's merge of all heads.
  const int64_t head = task_head(a, t, m);
  float* first = a.partials + a.shared_queries[t.shared + m % t.num_queries].partial + t.partial;
  return {first + head * d, first + static_cast<int64_t>(a.num_heads) * d + 2 * head};
}

// Writes a task's rows (m = h * num_queries + i: head h of the task's heads, query i), each element e
// of which output(m, e) gives unnormalised: divided by the row's sum into the step's output, or with
// the row's max and sum into the partials for a task covering part of its queries' keys.
template <typename A, typename Output>
static void write_task_output(const AttentionArgs& a, const AttentionTask& t, const float* row_max,
                              const float* row_sum, Output output) {
  const int64_t group = a.num_heads / a.num_kv_heads, d = a.head_dim, nq = t.num_queries;
  const int64_t rows = nq * group * t.num_kv_heads;
  // A vector at a time: element by element (a bfloat16 output rounded in scalar code) the writing
  // took longer than a whole key tile's products in a decode task of SmolLM2-135M's 9 rows.
  alignas(64) float chunk[W];
  auto write = [&](int64_t m, auto* out, float scale) {
    for (int64_t e0 = 0; e0 < d; e0 += W) {
      const int64_t n = min64(W, d - e0);
      for (int64_t i = 0; i < n; ++i) chunk[i] = output(m, e0 + i);
      store_part(load_part(chunk, n) * Vec::set1(scale), out + e0, n);
    }
  };
  for (int64_t m = 0; m < rows; ++m) {
    if (t.partial >= 0) {
      const PartialRow partial = partial_row(a, t, rows, m);
      write(m, partial.out, 1.0f);
      partial.stats[0] = row_max[m];
      partial.stats[1] = row_sum[m];
    } else {
      write(m, task_output<A>(a, t, m), 1.0f / row_sum[m]);
    }
  }
}

template <typename C>
struct KeyTile;

// Where asked-for cache lines go: into L1 (prefetcht0), or into L2 (prefetcht1), for lines wanted a
// tile later. A decode task asks for its tiles into L2: its next tile's lines, asked for into L1
// while the current tile's products run there, pushed those out and held the core's few L1 miss slots
// (a family 25 model 17 EPYC: whole bfloat16 decode steps 0.958x the time, float32 0.972x, in-process
// A/B of the hints; the earlier EPYC with vp2intersect took 1.00x with prefetcht1 and 1.23x with
// prefetcht2, results/cpu_attention.md). The prompt layouts ask for their next tiles into L2 as well,
// and for each tile's lines into L1 as its products start (TilesAhead, attention_rows.h).
enum class TileAsk { kNone, kIntoL1, kIntoL2 };

template <TileAsk Ask>
static inline void ask_for_line(const void* line) {
  if constexpr (Ask == TileAsk::kIntoL1) __builtin_prefetch(line, 0, 3);
  if constexpr (Ask == TileAsk::kIntoL2) __builtin_prefetch(line, 0, 2);
}

// Where the lines of tiles asked for a tile ahead go (TileAhead, and a decode task's first tile).
constexpr TileAsk kAheadTileAsk = TileAsk::kIntoL2;

// Where a task's part of one key's (or value's) row lies, from the row's pointer (its first KV
// head): num_pieces runs of piece_bytes, piece_stride bytes apart. A token-major block ([tokens,
// heads, head_dim]: the heads of a token follow each other) makes it one run; a head-major one
// ([heads, tokens, head_dim]: a head's rows of consecutive tokens follow each other) a run a head.
struct TaskRows {
  int num_pieces = 1;
  int64_t piece_bytes = 0;
  int64_t piece_stride = 0;
};

template <typename C>
static inline TaskRows task_rows(const AttentionArgs& a, const AttentionTask& t) {
  const int64_t element = static_cast<int64_t>(sizeof(C));
  if (t.num_kv_heads == 1 || a.head_stride == a.head_dim) {
    return {1, ((t.num_kv_heads - 1) * a.head_stride + a.head_dim) * element, 0};
  }
  return {static_cast<int>(t.num_kv_heads), a.head_dim * element, a.head_stride * element};
}

// The cache lines of the next key tile (its keys' rows, then its values'), asked for a few lines at
// a time while the current tile's products run: a step at each key of each scores and values call
// (decode layout) or after each register block of the products (prompt layout, TilesAhead), in the
// order they lie (runs of rows that follow each other in the cache: a tile of one block's tokens is
// two runs, its keys' and its values'). Asked for all at once when the tile was found, they filled
// the load queue and the products waited behind them: a bfloat16 decode layer took about the time
// of reading its cache plus that of computing on it; a few rows (~48 lines) every 16 keys, 1.2-1.5x
// less from memory; a line or three every key, the whole decode step 0.968-0.98x less again
// (results/cpu_attention.md): the bursts had the products wait for the core's few outstanding-miss
// slots. (Each scores call asking for its own head's part of every row instead, a strided walk,
// took a decode layer 1.5x the time from memory.)
template <typename C>
struct TileAhead {
  // Where the asking has got to: the next line to ask for, the end of its run, the run.
  struct Cursor {
    const char* at = nullptr;
    const char* end = nullptr;
    int run = 0;
  };
  static constexpr int kMaxRuns = 2 * kKeyTile;

  const char* run_begin[kMaxRuns];
  const char* run_end[kMaxRuns];
  int num_runs = 0;
  TaskRows rows;           // how the task's part of a row lies
  int lines_per_step = 0;  // asked for at each step()
  Cursor cursor;           // between scores calls (a call steps a copy of it, in registers)

  // Starts on `next` with every line asked for within `num_steps` steps: its keys' rows, then its
  // values', each a piece (KV head) at a time, so that runs of rows that follow each other merge.
  // A tile scattered into more than kMaxRuns runs (blocks of a few tokens, heads apart) has the rest
  // left to the hardware: asking is a hint.
  inline void begin(const KeyTile<C>* next, int64_t num_steps) {
    // Keys whose rows follow each other (a block's tokens) are taken a segment at a time, and the run
    // being extended is kept in locals. Piece by piece through run_end[num_runs - 1] (each waiting on
    // the store before it: 192 pieces a tile of SmolLM2-135M's 3 head-major KV heads), finding the
    // runs took ~20% of a bfloat16 decode layer's attention with its cache in L2.
    int segment_first[kKeyTile + 1];
    int num_segments = 0;
    for (int j = 0; j < next->num_keys; ++j) {
      if (j == 0 || reinterpret_cast<const char*>(next->key[j]) !=
                        reinterpret_cast<const char*>(next->key[j - 1]) + rows.piece_bytes) {
        segment_first[num_segments++] = j;
      }
    }
    segment_first[num_segments] = next->num_keys;
    num_runs = 0;
    int64_t num_pieces = 0;
    const char* open_end = nullptr;
    for (const C* const* part : {next->key, next->value}) {
      for (int p = 0; p < rows.num_pieces; ++p) {
        for (int s = 0; s < num_segments; ++s) {
          const int keys = segment_first[s + 1] - segment_first[s];
          const char* first = reinterpret_cast<const char*>(part[segment_first[s]]) + p * rows.piece_stride;
          if (num_runs > 0 && first == open_end) {
            open_end = first + keys * rows.piece_bytes;
          } else if (num_runs < kMaxRuns) {
            if (num_runs > 0) run_end[num_runs - 1] = open_end;
            run_begin[num_runs++] = first;
            open_end = first + keys * rows.piece_bytes;
          } else {
            continue;
          }
          num_pieces += keys;
        }
      }
    }
    if (num_runs > 0) run_end[num_runs - 1] = open_end;
    const int64_t lines = num_pieces * ((rows.piece_bytes + 63) / 64);
    lines_per_step = static_cast<int>((lines + num_steps - 1) / num_steps);
    cursor = {run_begin[0], run_end[0], 0};
  }
  // Whether the runs begun on fill the bytes from `from` on, one after the other in some order: the
  // tile lies straight on from the one read before it (the next block of the pool, as a sequence's
  // blocks lie taken from a fresh pool). False when the runs reached kMaxRuns (some may be left out).
  inline bool follows(const char* from) const {
    if (num_runs == 0 || num_runs == kMaxRuns) return false;
    const char* lowest = run_begin[0];
    int64_t num_bytes = 0;
    for (int r = 0; r < num_runs; ++r) {
      lowest = std::min(lowest, run_begin[r]);
      num_bytes += run_end[r] - run_begin[r];
    }
    return lowest == from && end() - lowest == num_bytes;
  }
  // Where the highest run ends (nullptr: no runs).
  inline const char* end() const {
    if (num_runs == 0) return nullptr;
    const char* last = run_end[0];
    for (int r = 1; r < num_runs; ++r) last = std::max(last, run_end[r]);
    return last;
  }
  // Asks for the next lines_per_step lines from c.
  inline void step(Cursor& c) const {
    for (int n = 0; n < lines_per_step; ++n) {
      if (c.at >= c.end && !next_run(c)) return;
      ask_for_line<kAheadTileAsk>(c.at);
      c.at += 64;
    }
  }
  // Asks for every line left.
  inline void ask_rest() {
    do {
      for (; cursor.at < cursor.end; cursor.at += 64) ask_for_line<kAheadTileAsk>(cursor.at);
    } while (next_run(cursor));
  }
  // Moves c to the start of the next run; false when c is in the last.
  inline bool next_run(Cursor& c) const {
    if (c.run + 1 >= num_runs) return false;
    ++c.run;
    c.at = run_begin[c.run];
    c.end = run_end[c.run];
    return true;
  }
};

// One key tile's rows for a task: pointers to each key's row of the task's first KV head (its next
// heads follow at head_stride) and to its value row. `ahead`: the next tile's lines to ask for while
// this tile's products run (decode layout; nullptr: none).
template <typename C>
struct KeyTile {
  const C* key[kKeyTile];
  const C* value[kKeyTile];
  int num_keys;
  TileAhead<C>* ahead = nullptr;
};

// Finds a tile's rows and asks for their cache lines at once (Ask: where to; the decode layout
// spreads the asking for its next tiles over the products instead: TileAhead). A task's keys and
// values are many short runs (a token's heads, keys and values apart, blocks wherever the block
// table puts them) that the hardware prefetcher alone left a decode layer's attention ~20% slower
// (bench/cpu_attention.py). The prefetches are here, where the pointers are stored, rather than in a
// function of their own, which the compiler finds free of effects and drops.
template <TileAsk Ask = TileAsk::kIntoL1, typename C>
static void find_tile(const AttentionArgs& a, const AttentionTask& t, int64_t k0, int num_keys, KeyTile<C>& tile) {
  const int32_t* table = a.block_tables + t.seq * a.block_table_stride;
  const TaskRows rows = task_rows<C>(a, t);
  // Block and offset advance with the position (no division per key).
  int64_t block = k0 / a.tokens_per_block, offset = k0 % a.tokens_per_block;
  const C* base = static_cast<const C*>(a.kv_cache) + t.kv_head * a.head_stride;
  for (int j = 0; j < num_keys; ++j, ++offset) {
    if (offset == a.tokens_per_block) {
      ++block;
      offset = 0;
    }
    tile.key[j] = base + table[block] * a.block_stride + offset * a.token_stride;
    tile.value[j] = tile.key[j] + a.kv_stride;
    for (int p = 0; Ask != TileAsk::kNone && p < rows.num_pieces; ++p) {
      const char* key = reinterpret_cast<const char*>(tile.key[j]) + p * rows.piece_stride;
      const char* value = reinterpret_cast<const char*>(tile.value[j]) + p * rows.piece_stride;
      for (int64_t line = 0; line < rows.piece_bytes; line += 64) {
        ask_for_line<Ask>(key + line);
        ask_for_line<Ask>(value + line);
      }
    }
  }
  tile.num_keys = num_keys;
}

// Calls f with a value of the element type a DType names (uint16_t holds bfloat16 bits).
template <typename F>
static inline void with_type(DType dtype, F&& f) {
  if (dtype == DType::kBFloat16) {
    f(uint16_t{});
  } else {
    f(float{});
  }
}

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA
