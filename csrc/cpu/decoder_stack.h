// A Llama-family decoder stack's step of a few rows (a decode step at batch 1 or 2) in one call: every
// layer's kernels run from C++, one after another, on the weights' addresses registered once.
//
// Why: such a step is some 300 kernel calls of microseconds each. Called one by one from Python, the
// interpreter ran between them (about 0.4 ms of a 6.6 ms bfloat16 step of SmolLM2-135M, the OpenMP
// worker spinning meanwhile) and each call converted its arguments. Here the step crosses the Python
// boundary once. Steps of more rows (prompts) keep the Python loop, whose products are oneDNN's.
#pragma once

#include <cstdint>
#include <vector>

#include "attention_plan.h"
#include "cpu_kernels.h"
#include "kernel_args.h"

namespace kvtool::cpu {

// A projection's weight [out_features, in_features] (rows contiguous) and its bias [out_features] or nullptr.
struct LinearWeights {
  const void* weight;
  const void* bias;
};

// One layer's weights: the two RMSNorms', Qwen3's per-head q/k norms (nullptr: none), and the fused
// projections qkv [q_size + 2 kv_size, hidden], o [hidden, q_size], gate_up [2 intermediate, hidden],
// down [hidden, intermediate].
struct DecoderLayerWeights {
  const void* input_norm;
  const void* post_attention_norm;
  const void* q_norm;
  const void* k_norm;
  LinearWeights qkv, o, gate_up, down;
};

struct DecoderShape {
  int64_t hidden_size, intermediate_size;
  int32_t num_heads, num_kv_heads, head_dim;
  float rms_norm_eps, attention_scale;
  DType dtype;  // of the weights and activations
};

// What one step gives the stack: its rows, where they sit, and the layers' KV caches (all of one layout).
struct DecoderStepArgs {
  void* residual;  // [num_rows, hidden_size]: the embedded tokens in, the residual stream after the last layer out
  void* out;       // [num_rows, hidden_size]: the final norm of the stream
  int64_t num_rows;
  const int64_t* positions;     // [num_rows]
  const int64_t* slot_mapping;  // [num_rows]
  const float* rope_cache;      // [max_positions, head_dim]
  int64_t max_positions;
  const int64_t* kv_caches;     // [num_layers] the addresses of each layer's cache
  int64_t block_stride, kv_stride, token_stride, head_stride;
  int32_t tokens_per_block;
  DType cache_dtype;
};

class DecoderStack {
 public:
  // max_rows: the most rows a step may have (the activations' buffers are sized for them).
  DecoderStack(const DecoderShape& shape, std::vector<DecoderLayerWeights> layers, const void* final_norm,
               int64_t max_rows);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t max_rows() const { return max_rows_; }

  // Runs every layer and the final norm for the step's rows (std::invalid_argument: more rows than
  // max_rows, or a position outside the RoPE table).
  void forward(CpuKernels& kernels, const AttentionPlan& plan, const DecoderStepArgs& args);

 private:
  void layer(CpuKernels& kernels, const AttentionPlan& plan, const DecoderStepArgs& args,
             const DecoderLayerWeights& weights, void* kv_cache, const void* x);
  void project(CpuKernels& kernels, const LinearWeights& weights, const void* x, void* out, int64_t num_rows,
               int64_t in_features, int64_t out_features) const;

  DecoderShape shape_;
  std::vector<DecoderLayerWeights> layers_;
  const void* final_norm_;
  int64_t max_rows_, q_size_, qkv_size_;
  // Activations of max_rows rows, as float32 room (a bfloat16 step uses the first half of each).
  std::vector<float> normed_, qkv_, attended_, x_, gate_up_, activation_;
};

}  // namespace kvtool::cpu
