// How one step's attention is split into tasks: built once per step from the step's sequence
// layout (host arrays), used by every layer.
#pragma once

#include <cstdint>
#include <vector>

#include "kernel_args.h"

namespace kvtool::cpu {

struct AttentionShape {
  int32_t num_heads, num_kv_heads, head_dim, tokens_per_block;
  int64_t sliding_window;  // 0: none
};

// Decode sequences whose first num_keys keys lie in the same blocks (see AttentionTask::shared).
struct SharedPrefix {
  std::vector<int64_t> seqs;
  int64_t num_keys;
};

class AttentionPlan {
 public:
  // query_start_loc [num_seqs + 1] and seq_lens [num_seqs] as in AttentionMetadata; block_tables
  // [num_seqs, max_blocks] row-major, -1 where no block. Every block a query can see must be a block
  // of the pool (0 <= id < num_blocks); std::invalid_argument names the first that is not.
  // width: float lanes of the kernels that will run the plan; num_threads: the threads that will
  // (too few tasks for them, and long decode tasks are split by keys, their shares merged);
  // max_rows_per_task: a prompt's query rows (queries x a group's heads) per task, what those kernels
  // run best (CpuKernels::rows_per_attention_task).
  // Decode sequences that begin with the same blocks (a cached prompt prefix they share) read those
  // blocks' keys and values once, in tasks that hold all their queries (no sliding window).
  AttentionPlan(const int32_t* query_start_loc, const int32_t* seq_lens, int64_t num_seqs, const int32_t* block_tables,
                int64_t max_blocks, int64_t num_blocks, const AttentionShape& shape, int32_t width,
                int32_t num_threads, int32_t max_rows_per_task);

  const std::vector<AttentionTask>& tasks() const { return tasks_; }
  const std::vector<AttentionMerge>& merges() const { return merges_; }
  const std::vector<SharedQuery>& shared_queries() const { return shared_queries_; }
  int64_t num_shared_prefixes() const { return num_shared_prefixes_; }
  int64_t num_partial_floats() const { return num_partial_floats_; }
  const int32_t* block_tables() const { return block_tables_.data(); }
  int64_t block_table_stride() const { return max_blocks_; }
  const AttentionShape& shape() const { return shape_; }
  int64_t scratch_floats() const { return scratch_floats_; }
  // Multiply-adds of the scores and the weighted sum, all tasks together (what is worth threads).
  double work() const { return work_; }

 private:
  AttentionShape shape_;
  int64_t max_blocks_;
  std::vector<int32_t> block_tables_;
  void split_for_threads(int32_t num_threads);
  void add_shared_prefix(const SharedPrefix& prefix, const int32_t* query_start_loc, const int32_t* seq_lens,
                         int32_t width, int32_t num_threads);

  std::vector<AttentionTask> tasks_;
  std::vector<AttentionMerge> merges_;
  std::vector<SharedQuery> shared_queries_;
  int64_t num_shared_prefixes_ = 0;
  int64_t num_partial_floats_ = 0;
  int64_t scratch_floats_ = 0;
  double work_ = 0.0;
};

}  // namespace kvtool::cpu
