// The scheduler's private state, shared by scheduler.cpp (requests and step bookkeeping),
// capacity_scheduler.cpp (admission, growth, pausing) and micro_batch_scheduler.cpp (the step's
// requests and context chunks). Not part of the public interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <unordered_map>
#include <vector>

#include "scheduler.h"

namespace kvtool {

// Everything the scheduler tracks about one request.
struct Request {
  int64_t request_id = 0;
  SequenceSpec spec;  // the prompt as submitted, with its identity
  int32_t max_new_tokens = 1;
  RequestState state = RequestState::kQueued;
  std::vector<TokenId> generated_token_ids;

  // Of the current admission. A resumed request is re-added with prompt + generated tokens as its
  // "prompt", so its context phase covers those and only the uncached part is recomputed.
  int32_t num_context_tokens = 0;    // tokens the context phase covers
  int32_t num_computed_tokens = 0;   // tokens whose KV is in the cache
  int32_t num_allocated_tokens = 0;  // tokens the block table covers

  bool has_been_admitted = false;
  RequestStats stats;

  int32_t num_prompt_tokens() const { return static_cast<int32_t>(spec.token_ids.size()); }
  // Token at a position of prompt + generated tokens.
  TokenId token_at(int32_t position) const {
    return position < num_prompt_tokens() ? spec.token_ids[position]
                                          : generated_token_ids[position - num_prompt_tokens()];
  }
  // Extra id at a position (0 for normal and generated tokens).
  ExtraId extra_id_at(int32_t position) const {
    return static_cast<size_t>(position) < spec.extra_ids.size() ? spec.extra_ids[position] : 0;
  }
  // Prompt + generated tokens: the tokens known to the cache manager while running.
  int32_t num_total_tokens() const {
    return num_prompt_tokens() + static_cast<int32_t>(generated_token_ids.size());
  }
  // The most tokens the request can ever hold: prompt + max_new_tokens.
  int32_t num_lifetime_tokens() const { return num_prompt_tokens() + max_new_tokens; }
};

// One request's share of the outstanding step, kept until complete_step applies it.
struct ScheduledWork {
  int64_t request_id = 0;
  int32_t num_computed_tokens_after = 0;  // num_cached_tokens + tokens computed in the step
  bool samples = false;
};

struct Scheduler::Impl {
  Impl(CacheConfig cache_config, SchedulerConfig scheduler_config);

  SchedulerConfig config;
  KVCacheManager cache_manager;
  int32_t tokens_per_block = 0;

  std::unordered_map<int64_t, Request> requests;
  std::deque<int64_t> waiting;   // QUEUED and PAUSED requests in admission order (paused at the front)
  std::vector<int64_t> running;  // CONTEXT and GENERATION requests in start order (oldest first)

  int64_t next_step_id = 0;
  bool has_outstanding_batch = false;
  int64_t outstanding_step_id = 0;
  std::vector<ScheduledWork> outstanding_work;

  Request& record(int64_t request_id);
  const Request& record(int64_t request_id) const;
  Request* find(int64_t request_id);  // nullptr for an unknown (or removed) id
  int32_t num_blocks_for(int32_t num_tokens) const {
    return (num_tokens + tokens_per_block - 1) / tokens_per_block;
  }
  // Blocks a running request may still allocate until it finishes.
  // Every reason add_request refuses a prompt but a known id; `name` starts each message.
  std::optional<std::string> prompt_problem(const std::string& name, const PromptSummary& prompt,
                                            int32_t max_new_tokens) const;
  int32_t num_remaining_blocks(const Request& r) const;
  // The spec a request is (re-)added to the cache manager with: prompt + generated tokens so far.
  SequenceSpec admission_spec(const Request& r) const;
  void remove_running(int64_t request_id);
  // Marks a request finished: releases its blocks if running, takes it off the queue if waiting.
  void finish(Request& r);

  // capacity_scheduler.cpp: grows generating requests by one token, pausing the most recently
  // started request when blocks lack (MAX_UTILIZATION), and admits queued requests per the policy.
  void schedule_capacity(ScheduledBatch& batch);
  void grow_generating_requests_or_pause(std::vector<int64_t>& paused_request_ids);
  void pause(Request& r);
  void admit_guaranteed();
  void admit_max_utilization();
  // Admits waiting[index].
  void admit(size_t index, const SequenceSpec& spec);
  // Whether a request with this spec would reuse more blocks by waiting for a running context
  // to compute them (enable_in_batch_prefix_reuse).
  bool should_wait_for_in_flight_prefix(const SequenceSpec& spec) const;

  // micro_batch_scheduler.cpp: picks this step's generation requests and context chunks within
  // max_batch_size and max_num_tokens.
  void form_micro_batch(ScheduledBatch& batch) const;
  ScheduledRequest context_chunk(const Request& r, int32_t num_new_tokens) const;
  ScheduledRequest generation_token(const Request& r) const;
};

}  // namespace kvtool
