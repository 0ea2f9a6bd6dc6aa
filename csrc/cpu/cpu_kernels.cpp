#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace kvtool::cpu {

namespace {

// Below these sizes a kernel runs on the calling thread alone: waking the workers costs more.
constexpr int64_t kMinParallelElements = 64 * 1024;
constexpr double kMinParallelAttentionWork = 5e5;  // multiply-adds
// The ranges run_shares hands out for a streaming kernel: long enough that taking one (an atomic
// operation on a line its share's owner holds) costs nothing beside reading it, short enough to even
// out the threads' ends (16, 64 and 256 KB measured alike in a decode step).
constexpr int64_t kShareRangeBytes = 64 * 1024;
// A tile product's task: 64 rows by up to 8 weight groups (256 columns), its weight in L2 while its
// rows pass. On the family 6 model 207 Xeon (two threads, SmolLM2-135M's four products of 1,053 rows,
// a C++ prototype) 64 x 256 took 0.56-0.82x oneDNN's time, 256 x 128 0.44-0.82x and 1,056 x 32
// 0.60-0.99x; 64 x 256 gives the threads the most tasks to end together on. Fewer rows (a hit's) take
// fewer groups a task, for kTileTasksPerThread tasks a thread: three tasks on two threads leave one
// waiting a third of the product.
constexpr int64_t kTileRowGroupsPerTask = 2, kTileGroupsPerTask = 8, kTileTasksPerThread = 4;

#if defined(__x86_64__) || defined(_M_X64)
// CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
bool has_amx_bf16() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  return (edx >> 22 & 1) && (edx >> 24 & 1);
}

// Linux lets a process use the tiles' 8 KB of state only once it has asked (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA); without it the first tile instruction kills the process. The
// answer holds for every thread of the process, and asking again is harmless (oneDNN asks too).
bool may_use_amx_tiles() {
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
#endif

bool cpu_supports(const std::string& isa) {
  if (isa == "generic") return true;
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
  }
  if (isa == "avx512_bf16") return cpu_supports("avx512") && __builtin_cpu_supports("avx512bf16");
  if (isa == "amx") return cpu_supports("avx512_bf16") && has_amx_bf16() && may_use_amx_tiles();
#endif
  return false;
}

const KernelTable* table_for(const std::string& isa) {
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == "amx") return &amx_kernels();
  if (isa == "avx512_bf16") return &avx512_bf16_kernels();
  if (isa == "avx512") return &avx512_kernels();
  if (isa == "avx2") return &avx2_kernels();
#endif
  return &generic_kernels();
}

const KernelTable* choose(const std::string& isa) {
  std::vector<std::string> supported = supported_isas();
  if (isa == "auto") return table_for(supported.front());
  if (std::find(supported.begin(), supported.end(), isa) == supported.end()) {
    std::string known;
    for (const std::string& name : supported) known += (known.empty() ? "" : ", ") + name;
    throw std::invalid_argument("CPU kernels for '" + isa + "' do not run on this CPU (it runs: " + known + ")");
  }
  return table_for(isa);
}

template <typename Args>
struct RowsJob {
  void (*kernel)(const Args&, int64_t, int64_t);
  const Args* args;
  int64_t num_rows, rows_per_task;

  // Rows [task * rows_per_task, ...) of the kernel.
  static void run(const void* context, int64_t task, int) {
    const auto* j = static_cast<const RowsJob*>(context);
    j->kernel(*j->args, task * j->rows_per_task, std::min(j->num_rows, (task + 1) * j->rows_per_task));
  }
  // Rows [begin, end) of the kernel (Parallel::run_shares).
  static void run_range(const void* context, int64_t begin, int64_t end, int) {
    const auto* j = static_cast<const RowsJob*>(context);
    j->kernel(*j->args, begin, end);
  }
};

struct AttentionJob {
  const KernelTable* table;
  const AttentionPlan* plan;
  const AttentionArgs* args;
  std::vector<std::vector<float>>* scratch;

  // The plan's task on the given thread's scratch.
  static void run(const void* context, int64_t task, int thread) {
    const auto* j = static_cast<const AttentionJob*>(context);
    j->table->attention(*j->args, j->plan->tasks()[task], (*j->scratch)[thread].data());
  }
};

}  // namespace

std::vector<std::string> supported_isas() {
  std::vector<std::string> isas;
  for (const char* isa : {"amx", "avx512_bf16", "avx512", "avx2"}) {
    if (cpu_supports(isa)) isas.emplace_back(isa);
  }
  isas.emplace_back("generic");
  return isas;
}

CpuKernels::CpuKernels(const std::string& isa, int num_threads)
    : table_(choose(isa)), pool_(std::max(1, num_threads)), scratch_(pool_.num_threads()) {}

template <typename Args>
void CpuKernels::run_rows(void (*kernel)(const Args&, int64_t, int64_t), const Args& args, int64_t num_rows,
                          int64_t row_size, int tasks_per_thread) {
  if (num_rows * row_size < kMinParallelElements || pool_.num_threads() == 1) {
    const RowsJob<Args> job{kernel, &args, num_rows, num_rows};  // one task of every row
    pool_.run_one(RowsJob<Args>::run, &job);
    return;
  }
  const int64_t num_tasks = std::min<int64_t>(num_rows, tasks_per_thread * pool_.num_threads());
  const RowsJob<Args> job{kernel, &args, num_rows, (num_rows + num_tasks - 1) / num_tasks};
  pool_.run((num_rows + job.rows_per_task - 1) / job.rows_per_task, RowsJob<Args>::run, &job);
}

void CpuKernels::rms_norm(const RmsNormArgs& args) { run_rows(table_->rms_norm, args, args.num_rows, args.dim); }

void CpuKernels::silu_mul(const SiluMulArgs& args) { run_rows(table_->silu_mul, args, args.num_rows, 2 * args.dim); }

void CpuKernels::rope_store_kv(const RopeKvArgs& args) {
  for (int64_t t = 0; t < args.num_tokens; ++t) {
    if (args.positions[t] < 0 || args.positions[t] >= args.max_positions) {
      throw std::invalid_argument("rope_store_kv: position " + std::to_string(args.positions[t]) + " of token " +
                                  std::to_string(t) + " is outside the RoPE table of " +
                                  std::to_string(args.max_positions) + " positions");
    }
  }
  const int64_t row = static_cast<int64_t>(args.num_heads + 2 * args.num_kv_heads) * args.head_dim;
  run_rows(table_->rope_store_kv, args, args.num_tokens, row);
}

void CpuKernels::attention(const AttentionPlan& plan, AttentionArgs args) {
  const AttentionShape& shape = plan.shape();
  args.block_tables = plan.block_tables();
  args.block_table_stride = plan.block_table_stride();
  args.num_heads = shape.num_heads;
  args.num_kv_heads = shape.num_kv_heads;
  args.head_dim = shape.head_dim;
  args.tokens_per_block = shape.tokens_per_block;
  args.sliding_window = shape.sliding_window;
  reserve_attention(plan);
  args.partials = partials_.data();
  args.shared_queries = plan.shared_queries().data();
  const AttentionJob job{table_, &plan, &args, &scratch_};
  const auto num_tasks = static_cast<int64_t>(plan.tasks().size());
  if (plan.work() < kMinParallelAttentionWork) {
    pool_.run_one(
        [](const void* context, int64_t, int) {
          const auto* j = static_cast<const AttentionJob*>(context);
          const auto num_tasks = static_cast<int64_t>(j->plan->tasks().size());
          for (int64_t task = 0; task < num_tasks; ++task) AttentionJob::run(j, task, 0);
        },
        &job);
  } else {
    pool_.run(num_tasks, AttentionJob::run, &job);
  }
  if (plan.merges().empty()) return;
  pool_.run_one(
      [](const void* context, int64_t, int) {
        const auto* j = static_cast<const AttentionJob*>(context);
        for (const AttentionMerge& merge : j->plan->merges()) j->table->merge_attention(*j->args, merge);
      },
      &job);
}

void CpuKernels::reserve_attention(const AttentionPlan& plan) {
  if (static_cast<int64_t>(partials_.size()) < plan.num_partial_floats()) partials_.resize(plan.num_partial_floats());
  reserve_scratch(plan.scratch_floats());
}

void CpuKernels::linear(const LinearArgs& args) {
  if (args.num_rows < 1 || args.in_features < 1 || args.out_features < 1) {
    throw std::invalid_argument("linear: num_rows, in_features and out_features must be >= 1");
  }
  if (args.out_features * args.in_features < kMinParallelElements || pool_.num_threads() == 1) {
    run_rows(table_->linear, args, args.out_features, args.in_features, 1);
    return;
  }
  // Each thread streams one contiguous share of the weight rows, one output feature per row (each
  // share is a stream the hardware prefetcher finds anew; at four a thread SmolLM2-135M's four
  // bfloat16 projections of one row took 5.9 ms for 30 layers' weights read from memory, at one 5.3),
  // and one done early takes ranges from the back of the other's: with fixed halves one thread of a
  // bfloat16 decode step waited 0.3-1.6 ms a step at the products' barriers, with shares 0.1-0.2 ms.
  // The step gained ~1% (a thread streaming alone gets most of the memory its partner leaves), more
  // where a thread loses its core (results/cpu_decode_rows.md).
  // Where the build walks several streams a thread (KernelTable::row_product_streams, a product of few
  // rows), the items shared are the first stream's features, each standing for one feature of every
  // stream: a thread's share, and a range taken from its back, is then a run of each stream.
  LinearArgs streamed = args;
  const int64_t streams = args.num_rows < kMinBlockRows ? table_->row_product_streams : 1;
  const int64_t num_items = (args.out_features + streams - 1) / streams;
  streamed.stream_rows = streams > 1 ? num_items : 0;
  const int64_t row_bytes = args.in_features * element_bytes(args.dtype);
  const int64_t items_per_range = std::max<int64_t>(1, kShareRangeBytes / row_bytes / streams);
  const RowsJob<LinearArgs> job{table_->linear, &streamed, num_items, items_per_range};
  pool_.run_shares(num_items, items_per_range, RowsJob<LinearArgs>::run_range, &job);
}

void CpuKernels::reserve_scratch(int64_t num_floats) {
  for (std::vector<float>& scratch : scratch_) {
    if (static_cast<int64_t>(scratch.size()) < num_floats) scratch.resize(num_floats);
  }
}

void CpuKernels::tile_linear(const TileWeight& weight, const uint16_t* x, int64_t num_rows, int64_t x_stride,
                             uint16_t* out, int64_t out_stride) {
  if (!has_tile_products()) {
    throw std::invalid_argument("tile_linear: the " + isa() + " kernels have no tile products (they need amx)");
  }
  if (num_rows < 1 || x_stride < weight.in_features() || out_stride < weight.out_features()) {
    throw std::invalid_argument("tile_linear: num_rows must be >= 1 and the strides at least a row");
  }
  const int64_t row_tasks = (num_rows + kTileRowGroupsPerTask * 32 - 1) / (kTileRowGroupsPerTask * 32);
  const int64_t wanted_column_tasks = (kTileTasksPerThread * pool_.num_threads() + row_tasks - 1) / row_tasks;
  const int64_t groups_per_task = std::clamp<int64_t>(
      (weight.num_groups() + wanted_column_tasks - 1) / wanted_column_tasks, 1, kTileGroupsPerTask);
  const TileLinearArgs args{x, weight.group(0), out, num_rows, weight.in_features(), weight.out_features(), x_stride,
                            out_stride, weight.num_groups(), weight.gated(), kTileRowGroupsPerTask, groups_per_task};
  // A last row group of fewer than 32 rows is copied out, padded with zero rows: 32 rows of bfloat16.
  reserve_scratch(weight.in_features() * 16);
  struct TileJob {
    const KernelTable* table;
    const TileLinearArgs* args;
    std::vector<std::vector<float>>* scratch;
  };
  const TileJob job{table_, &args, &scratch_};
  const int64_t column_tasks = (weight.num_groups() + groups_per_task - 1) / groups_per_task;
  pool_.run(
      row_tasks * column_tasks,
      [](const void* context, int64_t task, int thread) {
        const auto* j = static_cast<const TileJob*>(context);
        j->table->tile_linear(*j->args, task, reinterpret_cast<uint16_t*>((*j->scratch)[thread].data()));
      },
      &job);
}

ArgMax CpuKernels::argmax(const void* data, DType dtype, int64_t begin, int64_t end) const {
  if (begin < 0 || begin >= end) {
    throw std::invalid_argument("argmax: the range [" + std::to_string(begin) + ", " + std::to_string(end) +
                                ") must hold at least one value");
  }
  return table_->argmax(data, dtype, begin, end);
}

std::string sampling_problem(const RowSampling& s) {
  if (!(s.temperature >= 0.0f)) return "the temperature (" + std::to_string(s.temperature) + ") must be 0 or above";
  if (s.top_k < 0) return "top_k (" + std::to_string(s.top_k) + ") must be 0 (every token) or above";
  if (!(s.top_p > 0.0f && s.top_p <= 1.0f)) return "top_p (" + std::to_string(s.top_p) + ") must be in (0, 1]";
  if (s.temperature > 0.0f && !(s.u >= 0.0 && s.u < 1.0)) {
    return "a draw's uniform number (" + std::to_string(s.u) + ") must be in [0, 1)";
  }
  return "";
}

int64_t CpuKernels::draw(const void* data, DType dtype, int64_t size, ArgMax best, const RowSampling& sampling,
                         float* scratch) const {
  const std::string problem = sampling_problem(sampling);
  if (!problem.empty() || !(sampling.temperature > 0.0f)) {
    throw std::invalid_argument("draw: " + (problem.empty() ? "the temperature must be above 0" : problem));
  }
  const float inv_temperature = 1.0f / sampling.temperature;
  if (!std::isfinite(best.value) || !std::isfinite(inv_temperature)) return best.index;
  return table_->draw(data, dtype, size, {best.value, inv_temperature, sampling.top_k, sampling.top_p, sampling.u},
                      scratch);
}

double CpuKernels::sum(const float* data, int64_t num_floats) {
  struct SumJob {
    const KernelTable* table;
    const float* data;
    std::vector<double> partial;  // a thread's
  };
  // Shared as the products share their weights: a streaming read at the rate both threads reach
  // together, not at the slower one's.
  SumJob job{table_, data, std::vector<double>(pool_.num_threads())};
  pool_.run_shares(
      num_floats, kShareRangeBytes / static_cast<int64_t>(sizeof(float)),
      [](const void* context, int64_t begin, int64_t end, int thread) {
        auto* j = static_cast<SumJob*>(const_cast<void*>(context));
        j->partial[thread] += j->table->sum(j->data, begin, end);
      },
      &job);
  double total = 0.0;
  for (double part : job.partial) total += part;
  return total;
}

}  // namespace kvtool::cpu
