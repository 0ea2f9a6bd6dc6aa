#include "attention_plan.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>

namespace kvtool::cpu {

namespace {

// A share of a split task has at least this many keys.
constexpr int64_t kMinKeysPerShare = 4 * kKeyTile;
// Decode sequences read their common leading blocks once when they share at least this many keys.
constexpr int64_t kMinSharedKeys = 4 * kKeyTile;

// Decode sequences (one new token each) whose block tables begin with the same blocks: a prompt
// prefix cached once and held by every request that sent it. Grouped by their first block; a
// group's prefix is the whole blocks all of them hold before their new token.
std::vector<SharedPrefix> find_shared_prefixes(const int32_t* query_start_loc, const int32_t* seq_lens,
                                               int64_t num_seqs, const int32_t* block_tables, int64_t max_blocks,
                                               int64_t tokens_per_block) {
  std::map<int32_t, std::vector<int64_t>> by_first_block;  // ordered: the same step makes the same plan
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    if (query_start_loc[seq + 1] - query_start_loc[seq] == 1 && seq_lens[seq] > kMinSharedKeys) {
      by_first_block[block_tables[seq * max_blocks]].push_back(seq);
    }
  }
  std::vector<SharedPrefix> prefixes;
  for (auto& [block, seqs] : by_first_block) {
    if (seqs.size() < 2) continue;
    const int32_t* first = block_tables + seqs[0] * max_blocks;
    int64_t num_blocks = max_blocks;
    for (int64_t seq : seqs) {
      const int32_t* table = block_tables + seq * max_blocks;
      // Whole blocks before the new token's position: the sequence's own task keeps at least that token.
      const int64_t limit = std::min(num_blocks, (seq_lens[seq] - 1) / tokens_per_block);
      int64_t common = 0;
      while (common < limit && table[common] == first[common]) ++common;
      num_blocks = common;
    }
    if (num_blocks * tokens_per_block >= kMinSharedKeys) {
      prefixes.push_back({std::move(seqs), num_blocks * tokens_per_block});
    }
  }
  return prefixes;
}

}  // namespace

AttentionPlan::AttentionPlan(const int32_t* query_start_loc, const int32_t* seq_lens, int64_t num_seqs,
                             const int32_t* block_tables, int64_t max_blocks, int64_t num_blocks,
                             const AttentionShape& shape, int32_t width, int32_t num_threads,
                             int32_t max_rows_per_task)
    : shape_(shape), max_blocks_(max_blocks), block_tables_(block_tables, block_tables + num_seqs * max_blocks) {
  if (shape.num_kv_heads <= 0 || shape.num_heads % shape.num_kv_heads != 0) {
    throw std::invalid_argument("attention: num_heads " + std::to_string(shape.num_heads) +
                                " is not a multiple of num_kv_heads " + std::to_string(shape.num_kv_heads));
  }
  const int64_t group = shape.num_heads / shape.num_kv_heads;
  int64_t queries_per_task = std::max<int64_t>(1, max_rows_per_task / group);
  // A short chunk (a hit's few new tokens) makes fewer tasks than two per thread: smaller runs of
  // queries then, as long as a task's rows still fill a vector.
  int64_t num_tasks = 0, num_queries = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t query_len = query_start_loc[seq + 1] - query_start_loc[seq];
    num_tasks += (query_len + queries_per_task - 1) / queries_per_task * shape.num_kv_heads;
    num_queries += query_len;
  }
  if (num_tasks > 0 && num_tasks < 2 * num_threads) {
    const int64_t fewest = (width + group - 1) / group;
    int64_t even = (num_queries * shape.num_kv_heads + 2 * num_threads - 1) / (2 * num_threads);
    // Rounded down to whole vectors of rows where that leaves a vector's worth: padding rows cost a
    // vector's work (a 32-token hit of SmolLM2's group of 3: 24 queries a task padded 72 rows to 80
    // and left 24 in a task of their own, 16 queries a task fill 48 rows).
    const int64_t whole = width / std::gcd(group, static_cast<int64_t>(width));
    if (even / whole * whole >= fewest) even = even / whole * whole;
    queries_per_task = std::max(fewest, std::min(queries_per_task, even));
  }
  const int64_t tpb = shape.tokens_per_block;
  std::vector<bool> in_shared_prefix(num_seqs, false);
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t query_len = query_start_loc[seq + 1] - query_start_loc[seq];
    const int64_t seq_len = seq_lens[seq];
    if (query_len <= 0) continue;
    if (query_len > seq_len) {
      throw std::invalid_argument("attention: sequence " + std::to_string(seq) + " has " + std::to_string(query_len) +
                                  " new tokens but seq_len " + std::to_string(seq_len));
    }
    const int64_t first_position = seq_len - query_len;
    const int64_t first_key = shape.sliding_window > 0 ? std::max<int64_t>(0, first_position - shape.sliding_window + 1) : 0;
    if ((seq_len - 1) / tpb >= max_blocks) {
      throw std::invalid_argument("attention: sequence " + std::to_string(seq) + " of " + std::to_string(seq_len) +
                                  " tokens has a block table of " + std::to_string(max_blocks) + " blocks");
    }
    for (int64_t block = first_key / tpb; block <= (seq_len - 1) / tpb; ++block) {
      const int32_t id = block_tables[seq * max_blocks + block];
      if (id < 0 || id >= num_blocks) {
        throw std::invalid_argument("attention: block_tables row " + std::to_string(seq) + " has block id " +
                                    std::to_string(id) + " at index " + std::to_string(block) +
                                    ", inside the attention window (a pool of " + std::to_string(num_blocks) +
                                    " blocks)");
      }
    }
  }
  // Only after every sequence's blocks are checked: the prefixes compare block ids.
  if (shape.sliding_window == 0) {
    for (const SharedPrefix& prefix : find_shared_prefixes(query_start_loc, seq_lens, num_seqs, block_tables,
                                                           max_blocks, tpb)) {
      add_shared_prefix(prefix, query_start_loc, seq_lens, width, num_threads);
      for (int64_t seq : prefix.seqs) in_shared_prefix[seq] = true;
    }
  }
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t query_len = query_start_loc[seq + 1] - query_start_loc[seq];
    const int64_t seq_len = seq_lens[seq];
    if (query_len <= 0 || in_shared_prefix[seq]) continue;
    const int64_t first_position = seq_len - query_len;
    for (int64_t begin = 0; begin < query_len; begin += queries_per_task) {
      const int64_t count = std::min(queries_per_task, query_len - begin);
      const int64_t position = first_position + begin;
      const int64_t key_begin = shape.sliding_window > 0 ? std::max<int64_t>(0, position - shape.sliding_window + 1) : 0;
      const int64_t key_end = position + count;
      // A few rows per KV head (decode) take every KV head in one task, reading each token's keys
      // and values as one run rather than a head's share of it; a chunk's rows, a task per head.
      const bool per_head = rows_in_lanes(count * group, width);
      const int32_t heads_per_task = per_head ? 1 : shape.num_kv_heads;
      for (int32_t kv_head = 0; kv_head < shape.num_kv_heads; kv_head += heads_per_task) {
        tasks_.push_back({static_cast<int32_t>(seq), kv_head, heads_per_task,
                          static_cast<int32_t>(query_start_loc[seq] + begin), static_cast<int32_t>(count),
                          static_cast<int32_t>(position), static_cast<int32_t>(key_begin),
                          static_cast<int32_t>(key_end), -1, -1, per_head});
      }
      work_ += 2.0 * static_cast<double>(count * shape.num_heads) * static_cast<double>(key_end - key_begin) *
               static_cast<double>(shape.head_dim);
      scratch_floats_ = std::max(scratch_floats_, attention_scratch_floats(count * group * heads_per_task,
                                                                           shape.head_dim, heads_per_task, width));
    }
  }
  split_for_threads(num_threads);
  // Longest first, so that no thread is left with a long task at the end.
  std::stable_sort(tasks_.begin(), tasks_.end(), [](const AttentionTask& a, const AttentionTask& b) {
    return static_cast<int64_t>(a.num_queries) * (a.key_end - a.key_begin) >
           static_cast<int64_t>(b.num_queries) * (b.key_end - b.key_begin);
  });
}

void AttentionPlan::add_shared_prefix(const SharedPrefix& prefix, const int32_t* query_start_loc,
                                      const int32_t* seq_lens, int32_t width, int32_t num_threads) {
  const int64_t group = shape_.num_heads / shape_.num_kv_heads, d = shape_.head_dim;
  const auto members = static_cast<int64_t>(prefix.seqs.size());
  // Each member's output is merged from the prefix's shares (split by keys for the threads) and one
  // share of its own keys, each the size of a decode task's partial of all heads.
  const int64_t share_floats = partial_floats(shape_.num_heads, d);
  const int64_t shares = std::clamp<int64_t>(prefix.num_keys / kMinKeysPerShare, 1, num_threads);
  const auto first_query = static_cast<int32_t>(shared_queries_.size());
  // A sequence's own keys: one query's task (its rows as a decode step's, by layout), the last share.
  const bool own_in_lanes = rows_in_lanes(group, width);
  const int32_t own_heads_per_task = own_in_lanes ? 1 : shape_.num_kv_heads;
  for (int64_t seq : prefix.seqs) {
    const int32_t row = query_start_loc[seq], seq_len = seq_lens[seq];
    const auto first_partial = static_cast<int32_t>(num_partial_floats_);
    num_partial_floats_ += (shares + 1) * share_floats;
    merges_.push_back({row, 1, 0, shape_.num_kv_heads, first_partial, static_cast<int32_t>(shares + 1)});
    for (int32_t kv_head = 0; kv_head < shape_.num_kv_heads; kv_head += own_heads_per_task) {
      tasks_.push_back({static_cast<int32_t>(seq), kv_head, own_heads_per_task, row, 1, seq_len - 1,
                        static_cast<int32_t>(prefix.num_keys), seq_len, static_cast<int32_t>(shares * share_floats),
                        static_cast<int32_t>(shared_queries_.size()), own_in_lanes});
    }
    shared_queries_.push_back({row, first_partial});
    work_ += 2.0 * static_cast<double>(shape_.num_heads * (seq_len - prefix.num_keys) * d);
    scratch_floats_ = std::max(scratch_floats_, attention_scratch_floats(group * own_heads_per_task, d,
                                                                         own_heads_per_task, width));
  }
  // The prefix's tasks: every member's query rows, a KV head each once they fill the lanes with at
  // most a quarter of them padding (18 rows take two 16-lane vectors: the head dimension along the
  // lanes then does 18 rows' products where the rows would do 32).
  const int64_t rows = members * group;
  const bool in_lanes = rows_in_lanes(rows, width) && round_up(rows, width) * 3 <= rows * 4;
  const int32_t heads_per_task = in_lanes ? 1 : shape_.num_kv_heads;
  const int64_t tiles = (prefix.num_keys + kKeyTile - 1) / kKeyTile;
  for (int64_t share = 0; share < shares; ++share) {
    const auto key_begin = static_cast<int32_t>(tiles * share / shares * kKeyTile);
    const auto key_end = static_cast<int32_t>(std::min(prefix.num_keys, tiles * (share + 1) / shares * kKeyTile));
    for (int32_t kv_head = 0; kv_head < shape_.num_kv_heads; kv_head += heads_per_task) {
      // Every key of the prefix is visible to every member's new token: no mask.
      tasks_.push_back({static_cast<int32_t>(prefix.seqs[0]), kv_head, heads_per_task, -1,
                        static_cast<int32_t>(members), static_cast<int32_t>(prefix.num_keys - 1), key_begin, key_end,
                        static_cast<int32_t>(share * share_floats), first_query, in_lanes});
    }
  }
  work_ += 2.0 * static_cast<double>(members * shape_.num_heads * prefix.num_keys * d);
  scratch_floats_ = std::max(scratch_floats_, attention_scratch_floats(rows * heads_per_task, d,
                                                                       heads_per_task, width));
  ++num_shared_prefixes_;
}

void AttentionPlan::split_for_threads(int32_t num_threads) {
  // A step of a few decode tokens has a task per sequence: fewer than the threads can share evenly.
  // Such tasks (few rows, the head dimension in the lanes) split by keys into shares, as few as
  // spread them evenly over the threads (a multiple of them): each share starts by waiting for its
  // first tile from memory, and a decode layer of one sequence split in four for two threads took
  // 1.11x the time of one split in two (bfloat16 cache from memory; whole steps 1.02x).
  const auto num_tasks = static_cast<int64_t>(tasks_.size());
  if (num_threads <= 1 || num_tasks == 0 || num_tasks >= 2 * num_threads) return;
  const int64_t group = shape_.num_heads / shape_.num_kv_heads;
  const int64_t wanted = num_threads / std::gcd(num_tasks, static_cast<int64_t>(num_threads));
  std::vector<AttentionTask> tasks;
  for (const AttentionTask& task : tasks_) {
    const int64_t keys = task.key_end - task.key_begin;
    const int64_t shares = std::min(wanted, keys / kMinKeysPerShare);
    if (task.partial >= 0 || task.rows_in_lanes || shares < 2) {
      tasks.push_back(task);
      continue;
    }
    const auto first_partial = static_cast<int32_t>(num_partial_floats_);
    const int64_t share_floats = partial_floats(task.num_queries * group * task.num_kv_heads, shape_.head_dim);
    merges_.push_back({task.first_row, task.num_queries, task.kv_head, task.num_kv_heads, first_partial,
                       static_cast<int32_t>(shares)});
    // Shares of whole key tiles, as even as they come.
    const int64_t tiles = (keys + kKeyTile - 1) / kKeyTile;
    for (int64_t share = 0; share < shares; ++share) {
      AttentionTask part = task;
      part.key_begin = static_cast<int32_t>(task.key_begin + tiles * share / shares * kKeyTile);
      part.key_end = static_cast<int32_t>(std::min<int64_t>(task.key_end,
                                                            task.key_begin + tiles * (share + 1) / shares * kKeyTile));
      part.partial = static_cast<int32_t>(first_partial + share * share_floats);
      tasks.push_back(part);
    }
    num_partial_floats_ += shares * share_floats;
  }
  tasks_ = std::move(tasks);
}

}  // namespace kvtool::cpu
