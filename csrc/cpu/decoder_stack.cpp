#include "decoder_stack.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "bf16.h"

namespace kvtool::cpu {

DecoderStack::DecoderStack(const DecoderShape& shape, std::vector<DecoderLayerWeights> layers, const void* final_norm,
                           const VocabWeights& vocab, int64_t max_rows)
    : shape_(shape),
      layers_(std::move(layers)),
      final_norm_(final_norm),
      vocab_(vocab),
      max_rows_(max_rows),
      q_size_(static_cast<int64_t>(shape.num_heads) * shape.head_dim),
      qkv_size_(static_cast<int64_t>(shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim) {
  if (max_rows < 1 || shape.hidden_size < 1 || shape.intermediate_size < 1 || shape.num_heads < 1 ||
      shape.num_kv_heads < 1 || shape.head_dim < 2 || shape.num_heads % shape.num_kv_heads != 0 ||
      vocab.vocab_size < 1) {
    throw std::invalid_argument("DecoderStack: max_rows, the sizes, the head counts and vocab_size must be >= 1, "
                                "and num_heads a multiple of num_kv_heads");
  }
  const int64_t offset = activation_offset_bytes();
  residual_.resize(max_rows * shape.hidden_size, offset);
  hidden_out_.resize(max_rows * shape.hidden_size, offset);
  const int64_t head_values = max_rows * vocab.vocab_size;
  head_out_.resize(shape.dtype == DType::kBFloat16 ? (head_values + 1) / 2 : head_values, offset);
  query_start_loc_.resize(max_rows + 1);
  seq_lens_.resize(max_rows);
  slot_mapping_.resize(max_rows);
  normed_.resize(max_rows * shape.hidden_size, offset);
  qkv_.resize(max_rows * qkv_size_, offset);
  attended_.resize(max_rows * q_size_, offset);
  x_.resize(max_rows * shape.hidden_size, offset);
  gate_up_.resize(max_rows * 2 * shape.intermediate_size, offset);
  activation_.resize(max_rows * shape.intermediate_size, offset);
}

void DecoderStack::project(CpuKernels& kernels, const LinearWeights& weights, const void* x, void* out,
                           int64_t num_rows, int64_t in_features, int64_t out_features) const {
  kernels.linear({x, weights.weight, weights.bias, out, num_rows, in_features, out_features, in_features, in_features,
                  out_features, shape_.dtype});
}

void DecoderStack::layer(CpuKernels& kernels, const AttentionPlan& plan, const DecoderStepArgs& args,
                         const DecoderLayerWeights& weights, void* kv_cache, const void* x) {
  const DecoderShape& s = shape_;
  const int64_t n = args.num_rows, hidden = s.hidden_size, intermediate = s.intermediate_size;
  // normed = norm(x + residual), residual += x (the first layer: norm(residual)).
  kernels.rms_norm({x != nullptr ? x : args.residual, x != nullptr ? args.residual : nullptr, weights.input_norm,
                    normed_.data(), n, hidden, hidden, hidden, hidden, s.rms_norm_eps, s.dtype});
  project(kernels, weights.qkv, normed_.data(), qkv_.data(), n, hidden, qkv_size_);  // [n, qkv_size]
  const StackCaches& c = args.caches;
  kernels.rope_store_kv({qkv_.data(), n, qkv_size_, s.num_heads, s.num_kv_heads, s.head_dim, args.positions,
                         c.rope_cache, c.max_positions, weights.q_norm, weights.k_norm, s.rms_norm_eps, kv_cache,
                         c.block_stride, c.kv_stride, c.token_stride, c.head_stride, args.slot_mapping,
                         c.tokens_per_block, s.dtype, c.cache_dtype});
  AttentionArgs attention{};
  attention.query = qkv_.data();
  attention.query_stride = qkv_size_;
  attention.out = attended_.data();  // [n, q_size]
  attention.out_stride = q_size_;
  attention.kv_cache = kv_cache;
  attention.block_stride = c.block_stride;
  attention.kv_stride = c.kv_stride;
  attention.token_stride = c.token_stride;
  attention.head_stride = c.head_stride;
  attention.scale = s.attention_scale;
  attention.dtype = s.dtype;
  attention.cache_dtype = c.cache_dtype;
  kernels.attention(plan, attention);
  project(kernels, weights.o, attended_.data(), x_.data(), n, q_size_, hidden);
  kernels.rms_norm({x_.data(), args.residual, weights.post_attention_norm, normed_.data(), n, hidden, hidden, hidden,
                    hidden, s.rms_norm_eps, s.dtype});
  project(kernels, weights.gate_up, normed_.data(), gate_up_.data(), n, hidden, 2 * intermediate);
  kernels.silu_mul({gate_up_.data(), activation_.data(), n, intermediate, 2 * intermediate, intermediate, s.dtype});
  project(kernels, weights.down, activation_.data(), x_.data(), n, intermediate, hidden);
}

void DecoderStack::check_step(const DecoderStepArgs& args, const char* caller) const {
  if (args.num_rows < 1 || args.num_rows > max_rows_) {
    throw std::invalid_argument(std::string("DecoderStack.") + caller + ": a step of " +
                                std::to_string(args.num_rows) + " rows; the stack takes 1 to " +
                                std::to_string(max_rows_));
  }
  for (int64_t r = 0; r < args.num_rows; ++r) {
    if (args.positions[r] < 0 || args.positions[r] >= args.caches.max_positions) {
      throw std::invalid_argument(std::string("DecoderStack.") + caller + ": position " +
                                  std::to_string(args.positions[r]) + " of row " + std::to_string(r) +
                                  " is outside the RoPE table of " + std::to_string(args.caches.max_positions) +
                                  " positions");
    }
  }
}

void DecoderStack::run_layers(CpuKernels& kernels, const AttentionPlan& plan, const DecoderStepArgs& args) {
  const void* x = nullptr;  // the last sublayer's output, not yet added to the residual
  for (int64_t i = 0; i < num_layers(); ++i) {
    layer(kernels, plan, args, layers_[i], reinterpret_cast<void*>(args.caches.kv_caches[i]), x);
    x = x_.data();
  }
  const int64_t hidden = shape_.hidden_size;
  kernels.rms_norm({x != nullptr ? x : args.residual, x != nullptr ? args.residual : nullptr, final_norm_, args.out,
                    args.num_rows, hidden, hidden, hidden, hidden, shape_.rms_norm_eps, shape_.dtype});
}

void DecoderStack::forward(CpuKernels& kernels, const AttentionPlan& plan, const DecoderStepArgs& args) {
  check_step(args, "forward");
  kernels.reserve_attention(plan);
  auto body = [&] { run_layers(kernels, plan, args); };
  kernels.parallel().run_team(body);
}

void DecoderStack::decode(CpuKernels& kernels, const DecodeArgs& args) {
  if (args.logits == nullptr && args.picked_token_ids == nullptr) {
    throw std::invalid_argument("DecoderStack.decode: a step needs somewhere to put its logits or picked tokens");
  }
  const int64_t n = args.num_rows, hidden = shape_.hidden_size, vocab = vocab_.vocab_size;
  for (int64_t r = 0; args.sampling != nullptr && r < n; ++r) {
    const std::string problem = sampling_problem(args.sampling[r]);
    if (!problem.empty()) {
      throw std::invalid_argument("DecoderStack.decode: row " + std::to_string(r) + ": " + problem);
    }
  }
  const int64_t draw_floats = draw_scratch_floats(vocab);
  if (args.sampling != nullptr && static_cast<int64_t>(draw_scratch_.size()) < kernels.num_threads() * draw_floats) {
    draw_scratch_.resize(kernels.num_threads() * draw_floats);
  }
  const DecoderStepArgs step{residual_.data(), hidden_out_.data(), n, args.positions, slot_mapping_.data(),
                             args.caches};
  check_step(step, "decode");
  const int64_t row_bytes = hidden * element_bytes(shape_.dtype), tokens_per_block = args.caches.tokens_per_block;
  query_start_loc_[0] = 0;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t token = args.token_ids[r], position = args.positions[r];
    if (token < 0 || token >= vocab) {
      throw std::invalid_argument("DecoderStack.decode: token " + std::to_string(token) + " of row " +
                                  std::to_string(r) + " is outside the vocabulary of " + std::to_string(vocab));
    }
    const int64_t block_index = position / tokens_per_block;
    const int32_t block = position >= 0 && block_index < args.max_blocks
                              ? args.block_tables[r * args.max_blocks + block_index]
                              : -1;
    if (block < 0) {
      throw std::invalid_argument("DecoderStack.decode: row " + std::to_string(r) + "'s position " +
                                  std::to_string(position) + " has no block in its table of " +
                                  std::to_string(args.max_blocks) + " blocks");
    }
    std::memcpy(reinterpret_cast<char*>(residual_.data()) + r * row_bytes,
                static_cast<const char*>(vocab_.embedding) + token * row_bytes, row_bytes);
    slot_mapping_[r] = static_cast<int64_t>(block) * tokens_per_block + position % tokens_per_block;
    seq_lens_[r] = static_cast<int32_t>(position + 1);
    query_start_loc_[r + 1] = static_cast<int32_t>(r + 1);
  }
  // Every block a row's query sees must be the pool's: the plan checks them.
  const AttentionPlan plan(query_start_loc_.data(), seq_lens_.data(), n, args.block_tables, args.max_blocks,
                           args.num_blocks,
                           {shape_.num_heads, shape_.num_kv_heads, shape_.head_dim, args.caches.tokens_per_block,
                            args.sliding_window},
                           kernels.width(), kernels.num_threads(),
                           kernels.rows_per_attention_task(shape_.dtype));
  kernels.reserve_attention(plan);
  // The layers, the LM head, and the widening of its logits or the picks, on one team of threads.
  const bool head_into_logits = shape_.dtype == DType::kFloat32 && args.logits != nullptr;
  void* head = head_into_logits ? static_cast<void*>(args.logits) : head_out_.data();  // [n, vocab]
  struct Widening {
    const uint16_t* narrow;
    float* logits;
    int64_t size, per_task;
  };
  const Widening widening{static_cast<const uint16_t*>(head), args.logits, n * vocab,
                          (n * vocab + kernels.num_threads() - 1) / kernels.num_threads()};
  // Each row's vocabulary in a part a thread, then a task a row: its parts' largest taken together, and
  // its draw where it has a temperature.
  struct Picking {
    const CpuKernels* kernels;
    const void* head;
    DType dtype;
    int64_t vocab, parts;
    ArgMax* picks;  // [n, parts]
    int64_t* token_ids;
    const RowSampling* sampling;
    float* draw_scratch;  // [threads, draw_floats]
    int64_t draw_floats;
  };
  const int64_t parts = std::min<int64_t>(kernels.num_threads(), vocab);
  picks_.resize(n * parts);
  const Picking picking{&kernels, head, shape_.dtype, vocab, parts, picks_.data(), args.picked_token_ids,
                        args.sampling, draw_scratch_.data(), draw_floats};
  auto body = [&] {
    run_layers(kernels, plan, step);
    project(kernels, {vocab_.lm_head, nullptr}, hidden_out_.data(), head, n, hidden, vocab);
    if (args.logits != nullptr && !head_into_logits) {
      kernels.parallel().run(
          kernels.num_threads(),
          [](const void* context, int64_t task, int) {
            const auto* w = static_cast<const Widening*>(context);
            const int64_t end = std::min(w->size, (task + 1) * w->per_task);
            for (int64_t i = task * w->per_task; i < end; ++i) w->logits[i] = bf16_to_float(w->narrow[i]);
          },
          &widening);
    }
    if (args.picked_token_ids == nullptr) return;
    kernels.parallel().run(
        n * parts,
        [](const void* context, int64_t task, int) {
          const auto* p = static_cast<const Picking*>(context);
          const int64_t row = task / p->parts, part = task % p->parts;
          const char* values = static_cast<const char*>(p->head) + row * p->vocab * element_bytes(p->dtype);
          p->picks[task] = p->kernels->argmax(values, p->dtype, part * p->vocab / p->parts,
                                              (part + 1) * p->vocab / p->parts);
        },
        &picking);
    kernels.parallel().run(
        n,
        [](const void* context, int64_t row, int thread) {
          const auto* p = static_cast<const Picking*>(context);
          // The first part's pick unless a later one holds a larger value or the first NaN.
          ArgMax best = p->picks[row * p->parts];
          for (int64_t part = 1; part < p->parts && best.value == best.value; ++part) {
            const ArgMax& pick = p->picks[row * p->parts + part];
            if (pick.value != pick.value || pick.value > best.value) best = pick;
          }
          if (p->sampling == nullptr || !(p->sampling[row].temperature > 0.0f)) {
            p->token_ids[row] = best.index;
            return;
          }
          const char* values = static_cast<const char*>(p->head) + row * p->vocab * element_bytes(p->dtype);
          p->token_ids[row] = p->kernels->draw(values, p->dtype, p->vocab, best, p->sampling[row],
                                               p->draw_scratch + thread * p->draw_floats);
        },
        &picking);
  };
  kernels.parallel().run_team(body);
}

}  // namespace kvtool::cpu
