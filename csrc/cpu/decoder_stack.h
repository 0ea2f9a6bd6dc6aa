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

#include "activation_buffer.h"
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

// The embedding table and the LM head's weight, both [vocab_size, hidden_size] (one table when tied).
struct VocabWeights {
  const void* embedding;
  const void* lm_head;
  int64_t vocab_size;
};

struct DecoderShape {
  int64_t hidden_size, intermediate_size;
  int32_t num_heads, num_kv_heads, head_dim;
  float rms_norm_eps, attention_scale;
  DType dtype;  // of the weights and activations
};

// The RoPE table and the layers' KV caches (all of one layout), as every step reads them.
struct StackCaches {
  const float* rope_cache;   // [max_positions, head_dim]
  int64_t max_positions;
  const int64_t* kv_caches;  // [num_layers] the addresses of each layer's cache
  int64_t block_stride, kv_stride, token_stride, head_stride;
  int32_t tokens_per_block;
  DType cache_dtype;
};

// What one step gives the stack: its rows and where they sit.
struct DecoderStepArgs {
  void* residual;  // [num_rows, hidden_size]: the embedded tokens in, the residual stream after the last layer out
  void* out;       // [num_rows, hidden_size]: the final norm of the stream
  int64_t num_rows;
  const int64_t* positions;     // [num_rows]
  const int64_t* slot_mapping;  // [num_rows]
  StackCaches caches;
};

// A decode step as the engine schedules it: num_rows sequences with one new token each, at the given
// positions (the tokens each sequence has cached).
struct DecodeArgs {
  const int64_t* token_ids;     // [num_rows]
  const int64_t* positions;     // [num_rows]
  const int32_t* block_tables;  // [num_rows, max_blocks] row-major, -1 where no block
  int64_t num_rows, max_blocks, num_blocks;
  int64_t sliding_window;  // 0: none
  // The step's outputs, one or both: the LM head's float32 logits [num_rows, vocab_size], and each row's
  // token [num_rows] (nullptr: none): its greedy pick (the first largest logit, as NumPy's argmax picks)
  // where sampling is nullptr or its temperature 0, else its draw (CpuKernels::draw; sampling [num_rows]).
  float* logits;
  int64_t* picked_token_ids;
  const RowSampling* sampling;
  StackCaches caches;
};

class DecoderStack {
 public:
  // max_rows: the most rows a step may have (the activations' buffers are sized for them).
  DecoderStack(const DecoderShape& shape, std::vector<DecoderLayerWeights> layers, const void* final_norm,
               const VocabWeights& vocab, int64_t max_rows);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t max_rows() const { return max_rows_; }
  int64_t vocab_size() const { return vocab_.vocab_size; }

  // Runs every layer and the final norm for the step's rows, on one team of the kernels' threads
  // (std::invalid_argument: more rows than max_rows, or a position outside the RoPE table).
  void forward(CpuKernels& kernels, const AttentionPlan& plan, const DecoderStepArgs& args);

  // A whole decode step: each row's token embedded, its KV slot and the step's attention plan found from
  // the block tables, forward, and the LM head's float32 logits or picked tokens (or both). A step
  // crosses the Python boundary once (the Python around forward took ~0.15 ms of a ~7 ms bfloat16
  // SmolLM2-135M step: metadata tensors, checks, the plan's and the embedding's calls, the logits'
  // widening); its tokens are picked (greedy or drawn) on the threads that computed the logits, where
  // NumPy's argmax or the sampler after the step read them cold. std::invalid_argument: no output, more
  // rows than max_rows, a row's sampling_problem, a token outside the vocabulary, a position without a
  // block in its table or outside the RoPE table, or a block outside the pool.
  void decode(CpuKernels& kernels, const DecodeArgs& args);

 private:
  // Everything a team's threads could throw for, checked before they start (caller: the method named).
  void check_step(const DecoderStepArgs& args, const char* caller) const;
  // Every layer and the final norm: each thread of a team calls it (Parallel::run_team).
  void run_layers(CpuKernels& kernels, const AttentionPlan& plan, const DecoderStepArgs& args);
  void layer(CpuKernels& kernels, const AttentionPlan& plan, const DecoderStepArgs& args,
             const DecoderLayerWeights& weights, void* kv_cache, const void* x);
  void project(CpuKernels& kernels, const LinearWeights& weights, const void* x, void* out, int64_t num_rows,
               int64_t in_features, int64_t out_features) const;

  DecoderShape shape_;
  std::vector<DecoderLayerWeights> layers_;
  const void* final_norm_;
  VocabWeights vocab_;
  int64_t max_rows_, q_size_, qkv_size_;
  // Activations of max_rows rows, as float32 room (a bfloat16 step uses the first half of each).
  ActivationBuffer normed_, qkv_, attended_, x_, gate_up_, activation_, residual_, hidden_out_;
  // The LM head's output where the caller's float32 logits do not take it: a bfloat16 head's (widened
  // into them), a float32 head's in a greedy step without them.
  ActivationBuffer head_out_;
  // The largest logit of each part of each row [num_rows, parts] (the threads' shares of the vocabulary).
  std::vector<ArgMax> picks_;
  // Each thread's room for its rows' draws [num_threads, draw_scratch_floats(vocab_size)], sized at the
  // first sampled step.
  std::vector<float> draw_scratch_;
  // A decode step's metadata: query_start_loc [max_rows + 1], seq_lens [max_rows], slot_mapping [max_rows].
  std::vector<int32_t> query_start_loc_, seq_lens_;
  std::vector<int64_t> slot_mapping_;
};

}  // namespace kvtool::cpu
