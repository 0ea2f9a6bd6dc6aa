// The Python module kvtool.cpu_kernels._kernels. Tensors cross as raw data pointers (torch's
// data_ptr()) and element strides: converting a tensor through DLPack costs microseconds, and a
// decode step calls these kernels a hundred times. Each call releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "cpu_kernels.h"
#include "decoder_stack.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtool::cpu {

namespace {

using Int32Array = nb::ndarray<const int32_t, nb::c_contig, nb::device::cpu>;
using Int64Array = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using BlockTables = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Logits = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using TokenIds = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using FloatRow = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using DoubleRow = nb::ndarray<const double, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// The caches' arguments DecoderStack.forward and .decode share, checked against the stack's layers.
StackCaches stack_caches(const DecoderStack& stack, const char* method, uintptr_t rope_cache, int64_t max_positions,
                         const Int64Array& kv_caches, int64_t block_stride, int64_t kv_stride, int64_t token_stride,
                         int64_t head_stride, int32_t tokens_per_block, DType cache_dtype) {
  if (static_cast<int64_t>(kv_caches.shape(0)) != stack.num_layers()) {
    throw std::invalid_argument(std::string("DecoderStack.") + method + ": " + std::to_string(kv_caches.shape(0)) +
                                " KV caches for " + std::to_string(stack.num_layers()) + " layers");
  }
  return {ptr<const float>(rope_cache), max_positions, kv_caches.data(), block_stride, kv_stride, token_stride,
          head_stride, tokens_per_block, cache_dtype};
}

}  // namespace

}  // namespace kvtool::cpu

NB_MODULE(_kernels, m) {
  using namespace kvtool::cpu;
  m.doc() = "kvtool's CPU kernels (fused RMSNorm, SiLU-and-mul, RoPE + KV append, paged attention), "
            "one build per instruction set, chosen at run time.";

  nb::enum_<DType>(m, "DType", "Element type of activations or of the KV cache.")
      .value("FLOAT32", DType::kFloat32)
      .value("BFLOAT16", DType::kBFloat16);

  m.def("supported_isas", &supported_isas, "The instruction sets this CPU runs the kernels for, best first.");

  nb::class_<AttentionPlan>(m, "AttentionPlan",
                            "One step's attention split into tasks (sequence, KV head, run of queries); every "
                            "layer of the step uses it.")
      .def_prop_ro("num_tasks", [](const AttentionPlan& plan) { return plan.tasks().size(); })
      .def_prop_ro("work", &AttentionPlan::work, "Multiply-adds of all tasks.")
      .def_prop_ro("num_merges", [](const AttentionPlan& plan) { return plan.merges().size(); },
                   "Outputs merged from shares: of decode tasks split by keys for the threads, and of the "
                   "sequences of a shared prefix.")
      .def_prop_ro("num_shared_prefixes", &AttentionPlan::num_shared_prefixes,
                   "Groups of decode sequences whose common leading blocks are read once for all of them.");

  nb::class_<DecoderLayerWeights>(m, "DecoderLayerWeights",
                                  "One decoder layer's weights by address (0: none): the norms' and the fused "
                                  "projections' [out_features, in_features] with their biases.")
      .def(
          "__init__",
          [](DecoderLayerWeights* self, uintptr_t input_norm, uintptr_t post_attention_norm, uintptr_t q_norm,
             uintptr_t k_norm, uintptr_t qkv, uintptr_t qkv_bias, uintptr_t o, uintptr_t o_bias, uintptr_t gate_up,
             uintptr_t gate_up_bias, uintptr_t down, uintptr_t down_bias) {
            new (self) DecoderLayerWeights{ptr<const void>(input_norm), ptr<const void>(post_attention_norm),
                                           ptr<const void>(q_norm), ptr<const void>(k_norm),
                                           {ptr<const void>(qkv), ptr<const void>(qkv_bias)},
                                           {ptr<const void>(o), ptr<const void>(o_bias)},
                                           {ptr<const void>(gate_up), ptr<const void>(gate_up_bias)},
                                           {ptr<const void>(down), ptr<const void>(down_bias)}};
          },
          "input_norm"_a, "post_attention_norm"_a, "q_norm"_a, "k_norm"_a, "qkv"_a, "qkv_bias"_a, "o"_a, "o_bias"_a,
          "gate_up"_a, "gate_up_bias"_a, "down"_a, "down_bias"_a);

  nb::class_<DecoderStack>(m, "DecoderStack",
                           "A decoder stack's step of a few rows in one call, on weights registered once by address "
                           "(they must outlive it).")
      .def(
          "__init__",
          [](DecoderStack* self, std::vector<DecoderLayerWeights> layers, uintptr_t final_norm, uintptr_t embedding,
             uintptr_t lm_head, int64_t vocab_size, int64_t hidden_size, int64_t intermediate_size, int32_t num_heads,
             int32_t num_kv_heads, int32_t head_dim, float rms_norm_eps, float attention_scale, DType dtype,
             int64_t max_rows) {
            new (self) DecoderStack({hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, rms_norm_eps,
                                     attention_scale, dtype},
                                    std::move(layers), ptr<const void>(final_norm),
                                    {ptr<const void>(embedding), ptr<const void>(lm_head), vocab_size}, max_rows);
          },
          "layers"_a, "final_norm"_a, "embedding"_a, "lm_head"_a, "vocab_size"_a, "hidden_size"_a,
          "intermediate_size"_a, "num_heads"_a, "num_kv_heads"_a, "head_dim"_a, "rms_norm_eps"_a, "attention_scale"_a,
          "dtype"_a, "max_rows"_a,
          "embedding and lm_head: the [vocab_size, hidden_size] tables decode reads (the same one when tied).")
      .def_prop_ro("num_layers", &DecoderStack::num_layers)
      .def_prop_ro("max_rows", &DecoderStack::max_rows)
      .def_prop_ro("vocab_size", &DecoderStack::vocab_size)
      .def(
          "forward",
          [](DecoderStack& stack, CpuKernels& kernels, const AttentionPlan& plan, uintptr_t residual, uintptr_t out,
             int64_t num_rows, uintptr_t positions, uintptr_t slot_mapping, uintptr_t rope_cache,
             int64_t max_positions, Int64Array kv_caches, int64_t block_stride, int64_t kv_stride,
             int64_t token_stride, int64_t head_stride, int32_t tokens_per_block, DType cache_dtype) {
            stack.forward(kernels, plan,
                          {ptr<void>(residual), ptr<void>(out), num_rows, ptr<const int64_t>(positions),
                           ptr<const int64_t>(slot_mapping),
                           stack_caches(stack, "forward", rope_cache, max_positions, kv_caches, block_stride,
                                        kv_stride, token_stride, head_stride, tokens_per_block, cache_dtype)});
          },
          "kernels"_a, "plan"_a, "residual"_a, "out"_a, "num_rows"_a, "positions"_a, "slot_mapping"_a, "rope_cache"_a,
          "max_positions"_a, "kv_caches"_a, "block_stride"_a, "kv_stride"_a, "token_stride"_a, "head_stride"_a,
          "tokens_per_block"_a, "cache_dtype"_a, nb::call_guard<nb::gil_scoped_release>(),
          "Every layer and the final norm for num_rows rows: residual [num_rows, hidden_size] (the embedded tokens) "
          "is the residual stream, out [num_rows, hidden_size] gets the final norm; writes each layer's KV "
          "(kv_caches: int64 addresses, one per layer).")
      .def(
          "decode",
          [](DecoderStack& stack, CpuKernels& kernels, Int64Array token_ids, Int64Array positions,
             BlockTables block_tables, int64_t num_blocks, uintptr_t rope_cache, int64_t max_positions,
             Int64Array kv_caches, int64_t block_stride, int64_t kv_stride, int64_t token_stride, int64_t head_stride,
             int32_t tokens_per_block, DType cache_dtype, int64_t sliding_window, std::optional<Logits> logits,
             std::optional<TokenIds> picked_token_ids, std::optional<FloatRow> temperatures,
             std::optional<Int64Array> top_ks, std::optional<FloatRow> top_ps, std::optional<DoubleRow> uniforms) {
            const size_t n = token_ids.shape(0);
            if (positions.shape(0) != n || block_tables.shape(0) != n || (logits && logits->shape(0) != n) ||
                (picked_token_ids && picked_token_ids->shape(0) != n)) {
              throw std::invalid_argument("DecoderStack.decode: token_ids [n], positions [n], block_tables [n, "
                                          "max_blocks], logits [n, vocab_size] and picked_token_ids [n] disagree");
            }
            // A row's sampling from the four arrays, all given or none.
            std::vector<RowSampling> sampling;
            if (temperatures || top_ks || top_ps || uniforms) {
              if (!temperatures || !top_ks || !top_ps || !uniforms || !picked_token_ids ||
                  temperatures->shape(0) != n || top_ks->shape(0) != n || top_ps->shape(0) != n ||
                  uniforms->shape(0) != n) {
                throw std::invalid_argument("DecoderStack.decode: a sampled step takes temperatures, top_ks, top_ps "
                                            "and uniforms, [n] each, and picked_token_ids to draw into");
              }
              for (size_t r = 0; r < n; ++r) {
                sampling.push_back(
                    {temperatures->data()[r], top_ks->data()[r], top_ps->data()[r], uniforms->data()[r]});
              }
            }
            if (logits && static_cast<int64_t>(logits->shape(1)) != stack.vocab_size()) {
              throw std::invalid_argument("DecoderStack.decode: logits of " + std::to_string(logits->shape(1)) +
                                          " columns for a vocabulary of " + std::to_string(stack.vocab_size()));
            }
            stack.decode(kernels, {token_ids.data(), positions.data(), block_tables.data(), static_cast<int64_t>(n),
                                   static_cast<int64_t>(block_tables.shape(1)), num_blocks, sliding_window,
                                   logits ? logits->data() : nullptr,
                                   picked_token_ids ? picked_token_ids->data() : nullptr,
                                   sampling.empty() ? nullptr : sampling.data(),
                                   stack_caches(stack, "decode", rope_cache, max_positions, kv_caches, block_stride,
                                                kv_stride, token_stride, head_stride, tokens_per_block,
                                                cache_dtype)});
          },
          "kernels"_a, "token_ids"_a, "positions"_a, "block_tables"_a, "num_blocks"_a, "rope_cache"_a,
          "max_positions"_a, "kv_caches"_a, "block_stride"_a, "kv_stride"_a, "token_stride"_a, "head_stride"_a,
          "tokens_per_block"_a, "cache_dtype"_a, "sliding_window"_a, "logits"_a.none(),
          "picked_token_ids"_a.none() = nb::none(), "temperatures"_a.none() = nb::none(),
          "top_ks"_a.none() = nb::none(), "top_ps"_a.none() = nb::none(), "uniforms"_a.none() = nb::none(),
          nb::call_guard<nb::gil_scoped_release>(),
          "A decode step of one new token per row (token_ids and positions int64 [n], block_tables int32 [n, "
          "max_blocks], -1 where no block) in one call: the tokens' embeddings, every layer (writing each layer's "
          "KV), the final norm and the LM head into logits float32 [n, vocab_size], and/or each row's token into "
          "picked_token_ids int64 [n]: its greedy pick (the first largest logit, a NaN the largest, as NumPy's "
          "argmax) where temperatures (float32 [n]) is None or its temperature 0, else a draw as CpuKernels.draw's "
          "at its temperature, top_ks (int64 [n]), top_ps (float32 [n]) and uniforms (float64 [n]); "
          "sliding_window 0: none.");

  nb::class_<TileWeight>(m, "TileWeight",
                         "A bfloat16 weight laid out once for tile products (CpuKernels.tile_linear, amx).")
      .def(
          "__init__",
          [](TileWeight* self, uintptr_t weight, int64_t num_weight_rows, int64_t in_features, int64_t stride,
             bool gated) {
            new (self) TileWeight(ptr<const uint16_t>(weight), num_weight_rows, in_features, stride, gated);
          },
          "weight"_a, "num_weight_rows"_a, "in_features"_a, "stride"_a, "gated"_a = false,
          nb::call_guard<nb::gil_scoped_release>(),
          "weight: bfloat16 [num_weight_rows, in_features], rows stride elements apart (copied). gated: a gate_up "
          "weight (the gate's rows, then the up's), whose product is SiLU(gate) * up.")
      .def_static("fits", &TileWeight::fits, "num_weight_rows"_a, "in_features"_a, "gated"_a = false,
                  "Whether such a weight can be laid out (in_features a multiple of 32; gated, rows of 32).")
      .def_prop_ro("in_features", &TileWeight::in_features)
      .def_prop_ro("out_features", &TileWeight::out_features, "The product's: the weight's rows, half if gated.")
      .def_prop_ro("gated", &TileWeight::gated)
      .def_prop_ro("num_bytes", &TileWeight::num_bytes);

  nb::class_<ArgMax>(m, "ArgMax", "The largest of a range of values and the index of its first occurrence.")
      .def_ro("value", &ArgMax::value)
      .def_ro("index", &ArgMax::index);

  nb::class_<CpuKernels>(m, "CpuKernels", "The kernels of one instruction set and the threads that run them.")
      .def(nb::init<const std::string&, int>(), "isa"_a = "auto", "num_threads"_a = 1,
           "isa: 'auto' (the best this CPU runs) or one of supported_isas(); num_threads counts the caller.")
      .def_prop_ro("isa", &CpuKernels::isa)
      .def_prop_ro("width", &CpuKernels::width, "Float lanes of a vector.")
      .def_prop_ro("num_threads", &CpuKernels::num_threads)
      .def(
          "rms_norm",
          [](CpuKernels& k, uintptr_t x, uintptr_t residual, uintptr_t weight, uintptr_t out, int64_t num_rows,
             int64_t dim, int64_t x_stride, int64_t residual_stride, int64_t out_stride, float eps, DType dtype) {
            k.rms_norm({ptr<const void>(x), ptr<void>(residual), ptr<const void>(weight), ptr<void>(out), num_rows, dim,
                        x_stride, residual_stride, out_stride, eps, dtype});
          },
          "x"_a, "residual"_a, "weight"_a, "out"_a, "num_rows"_a, "dim"_a, "x_stride"_a, "residual_stride"_a,
          "out_stride"_a, "eps"_a, "dtype"_a, nb::call_guard<nb::gil_scoped_release>(),
          "out[r] = rms_norm(x[r] + residual[r]) * weight, residual[r] becoming the sum (residual 0: none).")
      .def(
          "silu_mul",
          [](CpuKernels& k, uintptr_t gate_up, uintptr_t out, int64_t num_rows, int64_t dim, int64_t in_stride,
             int64_t out_stride, DType dtype) {
            k.silu_mul({ptr<const void>(gate_up), ptr<void>(out), num_rows, dim, in_stride, out_stride, dtype});
          },
          "gate_up"_a, "out"_a, "num_rows"_a, "dim"_a, "in_stride"_a, "out_stride"_a, "dtype"_a,
          nb::call_guard<nb::gil_scoped_release>(), "out[r] = silu(gate_up[r, :dim]) * gate_up[r, dim:].")
      .def(
          "rope_store_kv",
          [](CpuKernels& k, uintptr_t qkv, int64_t num_tokens, int64_t qkv_stride, int32_t num_heads,
             int32_t num_kv_heads, int32_t head_dim, uintptr_t positions, uintptr_t rope_cache, int64_t max_positions,
             uintptr_t q_norm_weight, uintptr_t k_norm_weight, float norm_eps, uintptr_t kv_cache,
             int64_t block_stride, int64_t kv_stride, int64_t token_stride, int64_t head_stride,
             uintptr_t slot_mapping, int32_t tokens_per_block, DType dtype, DType cache_dtype) {
            k.rope_store_kv({ptr<void>(qkv), num_tokens, qkv_stride, num_heads, num_kv_heads, head_dim,
                             ptr<const int64_t>(positions), ptr<const float>(rope_cache), max_positions,
                             ptr<const void>(q_norm_weight), ptr<const void>(k_norm_weight), norm_eps,
                             ptr<void>(kv_cache), block_stride, kv_stride, token_stride, head_stride,
                             ptr<const int64_t>(slot_mapping), tokens_per_block, dtype, cache_dtype});
          },
          "qkv"_a, "num_tokens"_a, "qkv_stride"_a, "num_heads"_a, "num_kv_heads"_a, "head_dim"_a, "positions"_a,
          "rope_cache"_a, "max_positions"_a, "q_norm_weight"_a, "k_norm_weight"_a, "norm_eps"_a, "kv_cache"_a,
          "block_stride"_a, "kv_stride"_a, "token_stride"_a, "head_stride"_a, "slot_mapping"_a, "tokens_per_block"_a,
          "dtype"_a, "cache_dtype"_a, nb::call_guard<nb::gil_scoped_release>(),
          "Rotates q and k of each token in place (after the optional per-head q/k RMSNorm; weight 0: none) "
          "and stores k and v at slot_mapping[t] of the layer's KV cache.")
      .def(
          "plan_attention",
          [](const CpuKernels& k, Int32Array query_start_loc, Int32Array seq_lens, Int32Array block_tables,
             int64_t num_blocks, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t tokens_per_block,
             int64_t sliding_window, DType dtype) {
            if (block_tables.ndim() != 2 || seq_lens.ndim() != 1 || query_start_loc.ndim() != 1 ||
                query_start_loc.shape(0) != seq_lens.shape(0) + 1 || block_tables.shape(0) != seq_lens.shape(0)) {
              throw std::invalid_argument("plan_attention: query_start_loc [n + 1], seq_lens [n] and block_tables "
                                          "[n, max_blocks] disagree");
            }
            return AttentionPlan(query_start_loc.data(), seq_lens.data(), static_cast<int64_t>(seq_lens.shape(0)),
                                 block_tables.data(), static_cast<int64_t>(block_tables.shape(1)), num_blocks,
                                 {num_heads, num_kv_heads, head_dim, tokens_per_block, sliding_window}, k.width(),
                                 k.num_threads(), k.rows_per_attention_task(dtype));
          },
          "query_start_loc"_a, "seq_lens"_a, "block_tables"_a, "num_blocks"_a, "num_heads"_a, "num_kv_heads"_a,
          "head_dim"_a, "tokens_per_block"_a, "sliding_window"_a, "dtype"_a,
          "The step's attention tasks (int32 arrays as in AttentionMetadata; sliding_window 0: none), shaped for "
          "queries and a cache of dtype.")
      .def(
          "attention",
          [](CpuKernels& k, const AttentionPlan& plan, uintptr_t query, int64_t query_stride, uintptr_t out,
             int64_t out_stride, uintptr_t kv_cache, int64_t block_stride, int64_t kv_stride, int64_t token_stride,
             int64_t head_stride, float scale, DType dtype, DType cache_dtype) {
            AttentionArgs args{};
            args.query = ptr<const void>(query);
            args.query_stride = query_stride;
            args.out = ptr<void>(out);
            args.out_stride = out_stride;
            args.kv_cache = ptr<const void>(kv_cache);
            args.block_stride = block_stride;
            args.kv_stride = kv_stride;
            args.token_stride = token_stride;
            args.head_stride = head_stride;
            args.scale = scale;
            args.dtype = dtype;
            args.cache_dtype = cache_dtype;
            k.attention(plan, args);
          },
          "plan"_a, "query"_a, "query_stride"_a, "out"_a, "out_stride"_a, "kv_cache"_a, "block_stride"_a,
          "kv_stride"_a, "token_stride"_a, "head_stride"_a, "scale"_a, "dtype"_a, "cache_dtype"_a,
          nb::call_guard<nb::gil_scoped_release>(),
          "One layer's attention for the planned step: query [tokens, heads, head_dim] -> out (same shape), "
          "over the paged KV cache.")
      .def(
          "linear",
          [](CpuKernels& k, uintptr_t x, uintptr_t weight, uintptr_t bias, uintptr_t out, int64_t num_rows,
             int64_t in_features, int64_t out_features, int64_t x_stride, int64_t weight_stride, int64_t out_stride,
             DType dtype) {
            k.linear({ptr<const void>(x), ptr<const void>(weight), ptr<const void>(bias), ptr<void>(out), num_rows,
                      in_features, out_features, x_stride, weight_stride, out_stride, dtype});
          },
          "x"_a, "weight"_a, "bias"_a, "out"_a, "num_rows"_a, "in_features"_a, "out_features"_a, "x_stride"_a,
          "weight_stride"_a, "out_stride"_a, "dtype"_a, nb::call_guard<nb::gil_scoped_release>(),
          "out[m, n] = x[m] . weight[n] (+ bias[n]; bias 0: none) for a few rows: each weight row is read once for "
          "all of them, the output features shared by the threads.")
      .def_prop_ro("has_tile_products", &CpuKernels::has_tile_products,
                   "Whether tile_linear runs here (the amx kernels).")
      .def(
          "tile_linear",
          [](CpuKernels& k, const TileWeight& weight, uintptr_t x, int64_t num_rows, int64_t x_stride, uintptr_t out,
             int64_t out_stride) {
            k.tile_linear(weight, ptr<const uint16_t>(x), num_rows, x_stride, ptr<uint16_t>(out), out_stride);
          },
          "weight"_a, "x"_a, "num_rows"_a, "x_stride"_a, "out"_a, "out_stride"_a,
          nb::call_guard<nb::gil_scoped_release>(),
          "out [num_rows, weight.out_features] = x [num_rows, weight.in_features] . weight^T (gated: SiLU(gate) * "
          "up), bfloat16, on AMX tiles (has_tile_products); strides in elements.")
      .def(
          "sum",
          [](CpuKernels& k, uintptr_t data, int64_t num_floats) { return k.sum(ptr<const float>(data), num_floats); },
          "data"_a, "num_floats"_a, nb::call_guard<nb::gil_scoped_release>(),
          "The sum of num_floats float32 values, each thread reading a share: a streaming read, to time memory "
          "bandwidth with.")
      .def(
          "argmax",
          [](CpuKernels& k, uintptr_t data, DType dtype, int64_t begin, int64_t end) {
            return k.argmax(ptr<const void>(data), dtype, begin, end);
          },
          "data"_a, "dtype"_a, "begin"_a, "end"_a, nb::call_guard<nb::gil_scoped_release>(),
          "The largest of data[begin:end] and the index of its first occurrence (a NaN the largest, its first "
          "taken, as NumPy's argmax), on the calling thread.")
      .def(
          "draw",
          [](CpuKernels& k, uintptr_t data, DType dtype, int64_t size, float temperature, int64_t top_k, float top_p,
             double u) {
            const ArgMax best = k.argmax(ptr<const void>(data), dtype, 0, size);
            std::vector<float> scratch(draw_scratch_floats(size));
            return k.draw(ptr<const void>(data), dtype, size, best, {temperature, top_k, top_p, u}, scratch.data());
          },
          "data"_a, "dtype"_a, "size"_a, "temperature"_a, "top_k"_a, "top_p"_a, "u"_a,
          nb::call_guard<nb::gil_scoped_release>(),
          "A draw from softmax(data[:size] / temperature), cut to its top_k largest (0: all) and then the fewest "
          "of those whose mass reaches top_p (1: all; ties with the last kept are kept), by inverse transform in "
          "the order of data: the first index whose running sum of the kept exp((x - max) / temperature) exceeds "
          "u (in [0, 1)) times their total, on the calling thread; argmax's index where the largest value is NaN "
          "or infinite.");
}
