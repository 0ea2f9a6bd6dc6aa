// The step simulator: schedule, cost, sample and complete, step after step (step_simulator.h).
#include "step_simulator.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvtool {

TokenId simulated_token(int64_t last_token, int64_t num_tokens, int32_t vocab_size) {
  // Both factors are below 2^32 and the ids below 2^31, so nothing overflows int64.
  return static_cast<TokenId>((last_token * 2654435761LL + num_tokens * 40503LL + 1) % vocab_size);
}

double StepCosts::seconds(const std::vector<ScheduledRequest>& requests, const std::vector<CopyOp>& copies) const {
  // The shape as kvtool/simulate/cost_model.py's step_shape takes it: a one-token row is a decode row
  // (a generation token, or a fully cached prompt's last token), any other a context chunk.
  int64_t context_rows = 0, context_tokens = 0, context_cached = 0, decode_rows = 0, decode_kv = 0;
  double pairs = 0.0;
  for (const ScheduledRequest& r : requests) {
    const auto n = static_cast<int64_t>(r.token_ids.size());
    const int64_t cached = r.num_cached_tokens;
    if (n == 1) {
      decode_rows += 1;
      decode_kv += cached + 1;
    } else {
      context_rows += 1;
      context_tokens += n;
      context_cached += cached;
      pairs += static_cast<double>(n) * (static_cast<double>(cached) + static_cast<double>(n + 1) / 2.0);
    }
  }
  int64_t copied_tokens = 0;
  for (const CopyOp& op : copies) copied_tokens += op.num_tokens;
  const int64_t copied_bytes = copied_tokens * bytes_per_token;
  // CostModel.predict's sum, term by term in the same order (built without contracting into FMAs).
  return step + context_row * static_cast<double>(context_rows) + context_token * static_cast<double>(context_tokens) +
         context_cached_token * static_cast<double>(context_cached) + context_pair * pairs +
         decode_row * static_cast<double>(decode_rows) + decode_kv_token * static_cast<double>(decode_kv) +
         copied_byte * static_cast<double>(copied_bytes);
}

StepSimulator::StepSimulator(StepCosts costs, int32_t vocab_size) : costs_(costs), vocab_size_(vocab_size) {
  if (vocab_size < 1) {
    throw std::invalid_argument("StepSimulator: vocab_size must be >= 1, got " + std::to_string(vocab_size));
  }
  if (costs.bytes_per_token < 0) {
    throw std::invalid_argument("StepCosts.bytes_per_token must be >= 0, got " +
                                std::to_string(costs.bytes_per_token));
  }
  for (double c : {costs.step, costs.context_row, costs.context_token, costs.context_cached_token, costs.context_pair,
                   costs.decode_row, costs.decode_kv_token, costs.copied_byte}) {
    if (!std::isfinite(c)) throw std::invalid_argument("StepCosts: every coefficient must be a finite number");
  }
}

SimulatedSteps StepSimulator::run(Scheduler& scheduler, double now, double until, int32_t max_steps) {
  SimulatedSteps result;
  std::vector<int64_t> sampled_ids;
  std::vector<TokenId> sampled_tokens;
  for (int32_t i = 0; i < max_steps; ++i) {
    // Retention durations run on the simulated clock, in whole milliseconds, as Engine.step sets it.
    scheduler.cache_manager().set_time(static_cast<int64_t>(now * 1000.0));
    const ScheduledBatch batch = scheduler.schedule();
    if (batch.requests.empty()) {
      if (!batch.copy_ops.empty()) now += costs_.seconds(batch.requests, batch.copy_ops);
      result.stalled = scheduler.has_unfinished_requests();
      break;
    }
    // (A step without requests is not a step the engine counts pauses of: the run ends there.)
    result.paused_request_ids.insert(result.paused_request_ids.end(), batch.paused_request_ids.begin(),
                                     batch.paused_request_ids.end());
    result.num_steps += 1;
    now += costs_.seconds(batch.requests, batch.copy_ops);
    sampled_ids.clear();
    sampled_tokens.clear();
    for (const ScheduledRequest& r : batch.requests) {
      if (!r.samples) continue;
      // The last token known and how many there are: a generation row's one token, or the end of a context.
      const int64_t num_tokens = r.num_cached_tokens + static_cast<int64_t>(r.token_ids.size());
      sampled_ids.push_back(r.request_id);
      sampled_tokens.push_back(simulated_token(r.token_ids.back(), num_tokens, vocab_size_));
      token_times_[r.request_id].push_back(now);
    }
    result.finished_request_ids = scheduler.complete_step(sampled_ids, sampled_tokens);
    if (!result.finished_request_ids.empty() || now >= until) break;
  }
  result.end_time = now;
  return result;
}

std::vector<double> StepSimulator::take_token_times(int64_t request_id) {
  auto it = token_times_.find(request_id);
  if (it == token_times_.end()) return {};
  std::vector<double> times = std::move(it->second);
  token_times_.erase(it);
  return times;
}

}  // namespace kvtool
