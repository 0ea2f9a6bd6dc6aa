// What each CPU kernel is given: plain structs of raw pointers, element strides and sizes, filled by
// the bindings (bind_cpu_kernels.cpp) from torch tensors' data_ptr() and strides, and the table of
// one ISA's kernels. Strides count elements, not bytes. No torch here. Helpers are static: this header
// is compiled into every ISA's translation unit, and none may hand its copy to another.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtool::cpu {

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1 };

inline constexpr int64_t element_bytes(DType dtype) { return dtype == DType::kBFloat16 ? 2 : 4; }

// out[r] = rms_norm(x[r] (+ residual[r])) * weight; with a residual, residual[r] becomes the sum first
// (rounded to the dtype), as `x = x + y; h = norm(x)` computes it.
struct RmsNormArgs {
  const void* x;
  void* residual;  // nullptr: normalise x alone
  const void* weight;
  void* out;
  int64_t num_rows, dim, x_stride, residual_stride, out_stride;
  float eps;
  DType dtype;
};

// out[r] = silu(gate_up[r, :dim]) * gate_up[r, dim:].
struct SiluMulArgs {
  const void* gate_up;
  void* out;
  int64_t num_rows, dim, in_stride, out_stride;
  DType dtype;
};

// Rotates each token's q and k heads (rotate-half RoPE, after the optional per-head q/k RMSNorm of
// Qwen3) in place in the fused qkv rows, then stores k and v at the token's cache slot.
struct RopeKvArgs {
  void* qkv;                  // [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], row stride qkv_stride
  int64_t num_tokens, qkv_stride;
  int32_t num_heads, num_kv_heads, head_dim;
  const int64_t* positions;   // [num_tokens]
  const float* rope_cache;    // [max_positions, head_dim]: cos of the head_dim / 2 frequencies, then sin
  int64_t max_positions;
  const void* q_norm_weight;  // [head_dim] or nullptr
  const void* k_norm_weight;
  float norm_eps;
  void* kv_cache;             // one layer: [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim] (strided)
  int64_t block_stride, kv_stride, token_stride, head_stride;
  const int64_t* slot_mapping;  // [num_tokens] block_id * tokens_per_block + offset; < 0: not stored
  int32_t tokens_per_block;
  DType dtype, cache_dtype;
};

// One layer's attention over the paged cache, for the whole step; run task by task.
struct AttentionArgs {
  const void* query;  // [num_tokens, num_heads, head_dim], token row stride query_stride
  int64_t query_stride;
  void* out;          // [num_tokens, num_heads, head_dim], token row stride out_stride
  int64_t out_stride;
  const void* kv_cache;
  int64_t block_stride, kv_stride, token_stride, head_stride;
  const int32_t* block_tables;  // [num_seqs, block_table_stride]
  int64_t block_table_stride;
  int32_t num_heads, num_kv_heads, head_dim, tokens_per_block;
  float scale;
  int64_t sliding_window;  // 0: none; else a query at position p sees keys at positions > p - window
  DType dtype, cache_dtype;
  // Where tasks that cover part of a key range leave their results (see AttentionTask::partial).
  float* partials;
  const struct SharedQuery* shared_queries;  // the plan's, for tasks with shared >= 0
};

// A query of a shared-prefix task (AttentionTask::shared): its row in the step, and where its
// sequence's partial results begin (floats into partials).
struct SharedQuery {
  int32_t row;
  int32_t partial;
};

// A share of the work: consecutive queries of one sequence, one KV head (and its group of query heads).
struct AttentionTask {
  int32_t seq;
  int32_t kv_head;         // the first KV head
  int32_t num_kv_heads;    // KV heads kv_head .. kv_head + num_kv_heads - 1 (a decode task takes all)
  int32_t first_row;       // the first query's row in the step
  int32_t num_queries;
  int32_t first_position;  // the first query's position; query i is at first_position + i
  int32_t key_begin;       // the keys any of these queries sees: positions [key_begin, key_end)
  int32_t key_end;
  // -1: the task sees every key of its queries and writes their output. Else it covers a share of
  // them (a long decode split for the threads) and leaves, at partials + partial (floats), its
  // unnormalised output [rows][head_dim], then each row's max and sum of weights
  // (partial_floats(rows, head_dim) in all); a merge combines the shares.
  int32_t partial;
  // -1, or the first of num_queries entries of shared_queries, one new token each of sequences that
  // hold keys [key_begin, key_end) in the same blocks (a prompt prefix cached once; with one entry, a
  // sequence's own keys after it). seq is the first of them; query i leaves its share of each of the
  // task's heads at partials + shared_queries[shared + i].partial + partial, laid out as a decode
  // task of all heads leaves its partial.
  int32_t shared;
  // The layout the task runs in (kernels_impl.h): the prompt layout, a KV head per task (query rows
  // along the vector lanes; on AVX2 and AVX-512 a float32 task's rows a block at a time in registers,
  // attention_row_blocks.h); else the head dimension along the lanes, every KV head in the task.
  bool rows_in_lanes;
};

// The shares of one split task, merged into its output; share s is at partials + first_partial +
// s * partial_floats(rows, head_dim).
struct AttentionMerge {
  int32_t first_row, num_queries, kv_head, num_kv_heads, first_partial, num_partials;
};

static inline int64_t partial_floats(int64_t rows, int64_t head_dim) { return rows * (head_dim + 2); }

// Which layout the planner gives a task of `rows` query rows (AttentionTask::rows_in_lanes): rows
// along the vector lanes once they fill more than about half a vector (always in the one-lane build),
// else the head dimension along them (a decode token's group of heads).
static inline bool rows_in_lanes(int64_t rows, int64_t width) { return width == 1 || rows * 8 > width * 5; }

// out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n]): a projection of a few rows (a decode step's),
// run over a range of output features.
struct LinearArgs {
  const void* x;       // [num_rows, in_features], row stride x_stride
  const void* weight;  // [out_features, in_features], row stride weight_stride
  const void* bias;    // [out_features] or nullptr
  void* out;           // [num_rows, out_features], row stride out_stride
  int64_t num_rows, in_features, out_features, x_stride, weight_stride, out_stride;
  DType dtype;
  // Products of fewer than kMinBlockRows rows: a range [begin, end) of the kernel covers the output
  // features n + s * stream_rows for every s (streams of stream_rows features each walked side by
  // side, KernelTable::row_product_streams); 0: the features [begin, end).
  int64_t stream_rows = 0;
};

// Products of fewer input rows take each weight row's dot product with each input row in turn; from
// this many on, blocks of rows share each weight vector (kernels_impl.h, linear_typed).
inline constexpr int64_t kMinBlockRows = 4;

// out = x . weight^T on AMX tiles (tile_linear_amx.h), the weight laid out by TileWeight (a gated one:
// out = SiLU(x . gate^T) * (x . up^T)); bfloat16 throughout. Tasks of row_groups_per_task groups of 32
// rows by groups_per_task groups of weight columns, the task's rows outer.
struct TileLinearArgs {
  const uint16_t* x;  // [num_rows, in_features], row stride x_stride
  const uint16_t* weight;  // TileWeight's layout: num_groups groups of in_features * 32 elements
  uint16_t* out;  // [num_rows, out_features], row stride out_stride
  int64_t num_rows, in_features, out_features, x_stride, out_stride, num_groups;
  bool gated;
  int64_t row_groups_per_task, groups_per_task;
};

// The largest of a range of values and the index of its first occurrence. A NaN counts as the
// largest, its first one taken (as NumPy's argmax picks).
struct ArgMax {
  float value;
  int64_t index;
};

// How a row's token is drawn from its logits (draw.h).
struct DrawParams {
  float largest;          // the row's largest logit (finite)
  float inv_temperature;  // finite, > 0
  int64_t top_k;          // 0 or >= the row's size: every token
  float top_p;            // in (0, 1]; 1: every token
  double u;               // uniform in [0, 1)
};

// The floats of scratch a draw from a row of `size` logits takes: its weights (padded to whole vectors
// of the widest instruction set), then the one bucket of them the top-p cut sorts.
inline int64_t draw_scratch_floats(int64_t size) { return 2 * ((size + 15) / 16 * 16); }

// Keys are taken this many at a time (a tile of scores per query row).
inline constexpr int kKeyTile = 32;

// The kernels of one instruction set.
struct KernelTable {
  const char* isa;
  int32_t width;  // float lanes of a vector
  // Streams of weight rows each thread walks side by side in a product of fewer than kMinBlockRows
  // rows (LinearArgs::stream_rows; 1: its share front to back).
  int32_t row_product_streams;
  void (*rms_norm)(const RmsNormArgs&, int64_t row_begin, int64_t row_end);
  void (*silu_mul)(const SiluMulArgs&, int64_t row_begin, int64_t row_end);
  void (*rope_store_kv)(const RopeKvArgs&, int64_t token_begin, int64_t token_end);
  // scratch holds the plan's scratch_floats() (attention_scratch_floats of its largest task).
  void (*attention)(const AttentionArgs&, const AttentionTask&, float* scratch);
  void (*merge_attention)(const AttentionArgs&, const AttentionMerge&);
  // The sum of data[begin, end): a plain streaming read, what memory bandwidth is measured with.
  double (*sum)(const float* data, int64_t begin, int64_t end);
  void (*linear)(const LinearArgs&, int64_t feature_begin, int64_t feature_end);
  // Of data[begin, end) (float32 or bfloat16 elements, begin < end).
  ArgMax (*argmax)(const void* data, DType dtype, int64_t begin, int64_t end);
  // A draw from softmax(data[0, size) * inv_temperature), cut to top_k and top_p, by inverse transform
  // of u (draw.h); scratch holds draw_scratch_floats(size).
  int64_t (*draw)(const void* data, DType dtype, int64_t size, const DrawParams& params, float* scratch);
  // Task `task` of a tile product; rows_scratch holds 32 * in_features elements (a last group of fewer
  // than 32 rows, padded). nullptr where the build has no tiles (every one but amx).
  void (*tile_linear)(const TileLinearArgs&, int64_t task, uint16_t* rows_scratch);
};

static inline int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// Query rows (queries x the heads of a group) per prompt task: enough that each key tile read serves
// many rows, few enough that a prompt splits into many tasks for the threads to share.
inline constexpr int32_t kRowsPerAttentionTask = 128;
// The same for the AMX prompt layout (bfloat16), which lays a task's keys and values out for its tile
// products, every task its own copy of the keys before its last query: three times the rows lay each
// key out a third as often (a 1,053-token prompt's layer of SmolLM2-135M took 0.90-0.94x the time with
// 384 rows as with 128, where the float32 layout took 1.08-1.13x: both row counts in one process,
// results/cpu_attention.md).
inline constexpr int32_t kAmxRowsPerAttentionTask = 384;

// Keys the AMX prompt layout takes at a time (attention_rows_amx.h; a multiple of kKeyTile): its online
// softmax rescales, and its output tiles are loaded and stored, once per block.
inline constexpr int kAmxKeyBlock = 128;

// Scratch floats of a task of `rows` query rows over num_kv_heads KV heads.
static inline int64_t attention_scratch_floats(int64_t rows, int64_t head_dim, int64_t num_kv_heads, int64_t width) {
  int64_t padded = round_up(rows, width);
  // q (scaled) and the running output, transposed or not (head_dim padded to whole vectors); the
  // score tile; max, sum, positions, rescaling; K and V tiles widened from a bfloat16 cache; and the
  // AMX layout's key block: its keys and value pairs in bfloat16 (head_dim floats a key), a row
  // vector's scores (16 floats a key) and weight pairs (8 a key).
  return 2 * round_up(head_dim, width) * padded + kKeyTile * padded + 4 * padded +
         2 * kKeyTile * head_dim * num_kv_heads + kAmxKeyBlock * (head_dim + 24);
}

const KernelTable& generic_kernels();
#if defined(__x86_64__) || defined(_M_X64)
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();
const KernelTable& avx512_bf16_kernels();
const KernelTable& amx_kernels();
#endif

}  // namespace kvtool::cpu
