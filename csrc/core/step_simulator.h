// Runs a scheduler's steps back to back without a model: each step costs what a linear step cost
// model predicts for its shape, and each request that samples gets the simulation's token. What
// kvtool simulate's CostModelExecutor does one step at a time from Python, for many steps per call:
// the same schedule() and complete_step(), so every batch, block and counter is the one a
// step-by-step simulation has, and the clock adds the same costs in the same order.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "scheduler.h"

namespace kvtool {

// The token a simulated request samples after `last_token`, with `num_tokens` tokens (prompt and
// generated) before it: a function of the two, so requests with the same prompt get the same answer,
// as greedy decoding gives. In [0, vocab_size).
TokenId simulated_token(int64_t last_token, int64_t num_tokens, int32_t vocab_size);

// Seconds per unit of each term of a step's shape (kvtool/simulate/cost_model.py's TERMS, in order).
// seconds = step + context_row * rows + ... + copied_byte * bytes, added left to right as Python's
// CostModel.predict adds them, so both give the same double.
struct StepCosts {
  double step = 0;
  double context_row = 0;
  double context_token = 0;
  double context_cached_token = 0;
  double context_pair = 0;
  double decode_row = 0;
  double decode_kv_token = 0;
  double copied_byte = 0;
  int64_t bytes_per_token = 0;  // of the KV cache: copies cost per byte

  // Seconds of a step of these scheduled requests and copies.
  double seconds(const std::vector<ScheduledRequest>& requests, const std::vector<CopyOp>& copies) const;
};

// What one StepSimulator::run did.
struct SimulatedSteps {
  double end_time = 0;                       // the clock after the last step
  int32_t num_steps = 0;                     // steps that computed something
  std::vector<int64_t> finished_request_ids;  // finished by the last step, in complete_step's order
  std::vector<int64_t> paused_request_ids;   // paused in these steps, once per pause (MAX_UTILIZATION)
  bool stalled = false;  // the last step had no request while some are unfinished: nothing fits
};

class StepSimulator {
 public:
  StepSimulator(StepCosts costs, int32_t vocab_size);  // throws std::invalid_argument for a bad one

  // Runs steps of `scheduler` from clock `now` until, after a step, a request has finished, the clock
  // has reached `until`, or `max_steps` steps ran; stops early at a step with no request (its copies
  // still cost their time). Each sampled token's time is kept for take_token_times.
  SimulatedSteps run(Scheduler& scheduler, double now, double until, int32_t max_steps);

  // The times of the tokens a request sampled in runs since the last call for it (then forgotten).
  std::vector<double> take_token_times(int64_t request_id);

 private:
  StepCosts costs_;
  int32_t vocab_size_;
  std::unordered_map<int64_t, std::vector<double>> token_times_;
};

}  // namespace kvtool
