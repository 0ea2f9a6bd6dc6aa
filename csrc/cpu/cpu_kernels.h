// The kernels of the best (or a chosen) instruction set, with the threads that run them. The
// Python side hands raw data pointers and element strides of torch tensors (kvtool/cpu_kernels).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attention_plan.h"
#include "kernel_args.h"
#include "parallel.h"
#include "tile_weight.h"

namespace kvtool::cpu {

// The instruction sets this CPU runs kernels for, best first ("amx", "avx512_bf16", "avx512", "avx2", "generic").
std::vector<std::string> supported_isas();

// How a row's token is sampled (DecoderStack::decode, CpuKernels::draw).
struct RowSampling {
  float temperature;  // 0: greedy
  int64_t top_k;      // 0: every token
  float top_p;        // in (0, 1]
  double u;           // uniform in [0, 1): a draw's number
};

// What is wrong with a row's sampling ("" if nothing): a temperature below 0, a top_k below 0, a top_p
// outside (0, 1], or a draw's u outside [0, 1).
std::string sampling_problem(const RowSampling& sampling);

class CpuKernels {
 public:
  // isa: "auto" (the best supported) or one of supported_isas(); std::invalid_argument otherwise.
  CpuKernels(const std::string& isa, int num_threads);

  std::string isa() const { return table_->isa; }
  int32_t width() const { return table_->width; }
  int num_threads() const { return pool_.num_threads(); }
  // A prompt's query rows per attention task for a cache of `dtype` (the plan's max_rows_per_task).
  int32_t rows_per_attention_task(DType dtype) const {
    return has_tile_products() && dtype == DType::kBFloat16 ? kAmxRowsPerAttentionTask : kRowsPerAttentionTask;
  }

  void rms_norm(const RmsNormArgs& args);
  void silu_mul(const SiluMulArgs& args);
  void rope_store_kv(const RopeKvArgs& args);  // positions must be < args.max_positions (checked)
  void attention(const AttentionPlan& plan, AttentionArgs args);
  // Sizes the room attention() needs for the plan's steps (attention() does it too, but a team's
  // threads must find it sized: Parallel::run_team).
  void reserve_attention(const AttentionPlan& plan);
  // A projection of a few rows (LinearArgs), its output features shared by the threads.
  void linear(const LinearArgs& args);
  // Whether tile_linear runs here (the amx kernels).
  bool has_tile_products() const { return table_->tile_linear != nullptr; }
  // out [num_rows, weight.out_features()] = x [num_rows, weight.in_features()] . weight^T (gated: SiLU(gate)
  // * up), bfloat16, on AMX tiles: a prompt's projections. std::invalid_argument without tile products.
  void tile_linear(const TileWeight& weight, const uint16_t* x, int64_t num_rows, int64_t x_stride, uint16_t* out,
                   int64_t out_stride);
  // The sum of num_floats floats read by every thread (a share each): times a streaming read.
  double sum(const float* data, int64_t num_floats);
  // The largest of data[begin, end) and its first index (a NaN the largest), on the calling thread.
  ArgMax argmax(const void* data, DType dtype, int64_t begin, int64_t end) const;
  // A row's sampled token, on the calling thread: a draw from softmax(data[0, size) / temperature), cut
  // to its top_k largest (0: all) and then the fewest of those whose mass reaches top_p (1: all), by
  // inverse transform of u (draw.h); best: argmax(data, dtype, 0, size); scratch: draw_scratch_floats(size)
  // floats. Where a draw means nothing (a NaN or infinite largest value, a temperature whose inverse
  // overflows) it is best's index. std::invalid_argument: sampling_problem's.
  int64_t draw(const void* data, DType dtype, int64_t size, ArgMax best, const RowSampling& sampling,
               float* scratch) const;

  // The threads: a team of them runs the kernels' calls of a whole decoder stack step (DecoderStack).
  Parallel& parallel() { return pool_; }

 private:
  template <typename Args>
  // Rows in tasks_per_thread tasks a thread (more: threads that finish early take over the rest).
  void run_rows(void (*kernel)(const Args&, int64_t, int64_t), const Args& args, int64_t num_rows, int64_t row_size,
                int tasks_per_thread = 4);

  // Grows every thread's scratch to at least num_floats.
  void reserve_scratch(int64_t num_floats);

  const KernelTable* table_;
  Parallel pool_;
  std::vector<std::vector<float>> scratch_;  // one per thread
  std::vector<float> partials_;              // the shares of split attention tasks
};

}  // namespace kvtool::cpu
