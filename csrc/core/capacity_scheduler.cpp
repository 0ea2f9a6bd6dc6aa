// The capacity scheduler: which requests hold KV cache blocks this step. Generating requests get
// room for their newest token first; then queued requests are admitted in order (paused ones at
// the front, never skipping one that does not fit) as the CapacitySchedulerPolicy allows (its
// values are described where they are bound, in bind_scheduler.cpp).
#include <algorithm>
#include <cstddef>

#include "scheduler_impl.h"

namespace kvtool {

void Scheduler::Impl::schedule_capacity(ScheduledBatch& batch) {
  // Under GUARANTEED_NO_EVICT and STATIC_BATCH admission reserved every block a running request
  // can need, and the cache manager's available blocks shrink only by the blocks it hands out, so
  // growing never pauses anyone (tests assert it, with and without block reuse). The pause path
  // stays as a safety valve: should that ever break, pausing keeps the run correct and alive.
  grow_generating_requests_or_pause(batch.paused_request_ids);
  // Blocks a pause just freed go to the requests still running, not straight back to the paused
  // one or a newcomer (which would be paused again at once). With none left running, admit.
  if (!batch.paused_request_ids.empty() && !running.empty()) return;
  switch (config.capacity_scheduler_policy) {
    case CapacitySchedulerPolicy::kGuaranteedNoEvict:
      admit_guaranteed();
      break;
    case CapacitySchedulerPolicy::kStaticBatch:
      if (running.empty()) admit_guaranteed();
      break;
    case CapacitySchedulerPolicy::kMaxUtilization:
      admit_max_utilization();
      break;
  }
}

void Scheduler::Impl::grow_generating_requests_or_pause(std::vector<int64_t>& paused_request_ids) {
  // running is in start order, so its back is the most recently started request.
  for (size_t i = 0; i < running.size(); ++i) {
    Request& r = record(running[i]);
    if (r.state != RequestState::kGeneration || r.num_allocated_tokens >= r.num_total_tokens()) continue;
    bool paused_itself = false;
    while (!cache_manager.can_allocate(r.request_id, r.num_total_tokens())) {
      Request& victim = record(running.back());
      paused_itself = victim.request_id == r.request_id;
      pause(victim);
      paused_request_ids.push_back(victim.request_id);
      if (paused_itself) break;
    }
    if (paused_itself) break;  // it was the last running request
    cache_manager.allocate(r.request_id, r.num_total_tokens());
    r.num_allocated_tokens = r.num_total_tokens();
  }
}

void Scheduler::Impl::pause(Request& r) {
  // Computed full blocks stay matchable, so the resumed request recomputes only what was evicted.
  cache_manager.release(r.request_id);
  remove_running(r.request_id);
  waiting.push_front(r.request_id);
  r.state = RequestState::kPaused;
  r.num_context_tokens = 0;
  r.num_computed_tokens = 0;
  r.num_allocated_tokens = 0;
  r.stats.num_pauses += 1;
}

void Scheduler::Impl::admit_guaranteed() {
  int64_t num_reserved_blocks = 0;
  for (int64_t request_id : running) num_reserved_blocks += num_remaining_blocks(record(request_id));
  size_t index = 0;  // requests before it wait for a prefix a running context is computing
  while (index < waiting.size() && static_cast<int32_t>(running.size()) < config.max_batch_size) {
    Request& r = record(waiting[index]);
    SequenceSpec spec = admission_spec(r);
    if (should_wait_for_in_flight_prefix(spec)) {
      ++index;
      continue;
    }
    const auto num_context_tokens = static_cast<int32_t>(spec.token_ids.size());
    bool fits = false;
    if (running.empty()) {
      // Alone, a request fits for its whole lifetime (add_request checked it against the pool):
      // it only needs its prompt blocks now.
      fits = cache_manager.can_add_sequence(spec, num_context_tokens);
    } else {
      // Blocks for the whole lifetime, less the cached prefix it shares.
      const int64_t num_needed_blocks = cache_manager.num_blocks_to_add(spec, num_context_tokens) +
                                        num_blocks_for(r.num_lifetime_tokens()) - num_blocks_for(num_context_tokens);
      fits = num_reserved_blocks + num_needed_blocks <= cache_manager.num_available_blocks();
    }
    if (!fits) break;
    admit(index, spec);
    num_reserved_blocks += num_remaining_blocks(r);
  }
}

void Scheduler::Impl::admit_max_utilization() {
  size_t index = 0;
  while (index < waiting.size() && static_cast<int32_t>(running.size()) < config.max_batch_size) {
    Request& r = record(waiting[index]);
    SequenceSpec spec = admission_spec(r);
    if (should_wait_for_in_flight_prefix(spec)) {
      ++index;
      continue;
    }
    if (!cache_manager.can_add_sequence(spec, static_cast<int32_t>(spec.token_ids.size()))) break;
    admit(index, spec);
  }
}

bool Scheduler::Impl::should_wait_for_in_flight_prefix(const SequenceSpec& spec) const {
  if (!config.enable_in_batch_prefix_reuse || !cache_manager.config().enable_block_reuse ||
      config.capacity_scheduler_policy == CapacitySchedulerPolicy::kStaticBatch) {
    return false;
  }
  // Full blocks of the prompt that could be matched (the last prompt token never is).
  const auto num_matchable_blocks = static_cast<int32_t>((spec.token_ids.size() - 1) / tokens_per_block);
  int32_t num_in_flight_blocks = 0;  // leading blocks a running context shares and has yet to compute
  for (int64_t request_id : running) {
    const Request& other = record(request_id);
    if (other.state != RequestState::kContext || other.spec.lora_task_id != spec.lora_task_id ||
        other.spec.cache_salt != spec.cache_salt) {
      continue;
    }
    const int32_t limit = std::min(num_matchable_blocks, other.num_context_tokens / tokens_per_block);
    int32_t num_common_blocks = 0;
    if (spec.extra_ids.empty() && other.spec.extra_ids.empty() && limit * tokens_per_block <= other.num_prompt_tokens()) {
      // Both prompts as plain arrays: one vectorized comparison (a shared 2k-token system prompt
      // compared token by token against every running context made admission quadratic in cost).
      const TokenId* mine = spec.token_ids.data();
      const TokenId* theirs = other.spec.token_ids.data();
      const auto span = static_cast<size_t>(limit) * static_cast<size_t>(tokens_per_block);
      const size_t same = static_cast<size_t>(std::mismatch(mine, mine + span, theirs).first - mine);
      num_common_blocks = static_cast<int32_t>(same / static_cast<size_t>(tokens_per_block));
    } else {
      for (int32_t pos = 0; num_common_blocks < limit; ++pos) {
        const ExtraId extra_id = static_cast<size_t>(pos) < spec.extra_ids.size() ? spec.extra_ids[pos] : 0;
        if (other.token_at(pos) != spec.token_ids[pos] || other.extra_id_at(pos) != extra_id) break;
        if ((pos + 1) % tokens_per_block == 0) ++num_common_blocks;
      }
    }
    if (num_common_blocks * tokens_per_block > other.num_computed_tokens) {
      num_in_flight_blocks = std::max(num_in_flight_blocks, num_common_blocks);
    }
  }
  return num_in_flight_blocks > 0 && num_in_flight_blocks > cache_manager.match_prefix(spec).num_matched_blocks;
}

void Scheduler::Impl::admit(size_t index, const SequenceSpec& spec) {
  Request& r = record(waiting[index]);
  const auto num_context_tokens = static_cast<int32_t>(spec.token_ids.size());
  const AddSequenceResult result = cache_manager.add_sequence(r.request_id, spec, num_context_tokens);
  waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(index));
  running.push_back(r.request_id);
  r.state = RequestState::kContext;
  r.num_context_tokens = num_context_tokens;
  r.num_computed_tokens = result.num_reused_tokens;  // reused tokens are not computed again
  r.num_allocated_tokens = num_context_tokens;
  if (!r.has_been_admitted) {
    r.has_been_admitted = true;
    r.stats.num_reused_tokens = result.num_reused_tokens;
    r.stats.num_reused_blocks = result.num_reused_blocks;
    r.stats.num_onboarded_blocks = result.num_onboarded_blocks;
    r.stats.num_early_reused_blocks = result.num_early_reused_blocks;
    r.stats.missed = result.missed;
  }
}

}  // namespace kvtool
