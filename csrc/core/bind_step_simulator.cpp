// Python bindings of the step simulator (step_simulator.h): StepCosts, SimulatedSteps, StepSimulator
// and simulated_token, what kvtool simulate's CostModelExecutor runs many steps with.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "numpy_arrays.h"
#include "step_simulator.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvtool {

namespace {

void bind_step_costs(nb::module_& m) {
  nb::class_<StepCosts>(m, "StepCosts",
                        "Seconds per unit of each term of a step's shape (kvtool.simulate.cost_model.TERMS), and "
                        "the KV cache's bytes per token (copies cost per byte).")
      .def(
          "__init__",
          [](StepCosts* self, double step, double context_row, double context_token, double context_cached_token,
             double context_pair, double decode_row, double decode_kv_token, double copied_byte,
             int64_t bytes_per_token) {
            new (self) StepCosts{step, context_row, context_token, context_cached_token, context_pair,
                                 decode_row, decode_kv_token, copied_byte, bytes_per_token};
          },
          nb::kw_only(), "step"_a = 0.0, "context_row"_a = 0.0, "context_token"_a = 0.0,
          "context_cached_token"_a = 0.0, "context_pair"_a = 0.0, "decode_row"_a = 0.0, "decode_kv_token"_a = 0.0,
          "copied_byte"_a = 0.0, "bytes_per_token"_a = 0)
      .def_ro("step", &StepCosts::step)
      .def_ro("context_row", &StepCosts::context_row)
      .def_ro("context_token", &StepCosts::context_token)
      .def_ro("context_cached_token", &StepCosts::context_cached_token)
      .def_ro("context_pair", &StepCosts::context_pair)
      .def_ro("decode_row", &StepCosts::decode_row)
      .def_ro("decode_kv_token", &StepCosts::decode_kv_token)
      .def_ro("copied_byte", &StepCosts::copied_byte)
      .def_ro("bytes_per_token", &StepCosts::bytes_per_token);
}

void bind_simulated_steps(nb::module_& m) {
  nb::class_<SimulatedSteps>(m, "SimulatedSteps", "What one StepSimulator.run did.")
      .def_ro("end_time", &SimulatedSteps::end_time, "The clock after the last step (seconds).")
      .def_ro("num_steps", &SimulatedSteps::num_steps, "Steps that computed something.")
      .def_ro("finished_request_ids", &SimulatedSteps::finished_request_ids,
              "list[int]: requests the last step finished, in complete_step's order.")
      .def_ro("paused_request_ids", &SimulatedSteps::paused_request_ids,
              "list[int]: requests paused in these steps, once per pause (MAX_UTILIZATION).")
      .def_ro("stalled", &SimulatedSteps::stalled,
              "The last step had no request while some are unfinished: no queued request fits.");
}

void bind_simulator(nb::module_& m) {
  nb::class_<StepSimulator>(m, "StepSimulator",
                            "Runs a Scheduler's steps back to back without a model: each costs StepCosts' prediction "
                            "for its shape, each sampling request gets simulated_token.")
      .def(nb::init<StepCosts, int32_t>(), "costs"_a, "vocab_size"_a, "Raises ValueError for a bad one.")
      .def("run", &StepSimulator::run, "scheduler"_a, "now"_a, "until"_a = std::numeric_limits<double>::infinity(),
           "max_steps"_a = std::numeric_limits<int32_t>::max(),
           "Runs steps from clock `now` until, after a step, a request has finished, the clock has reached "
           "`until` or max_steps ran; stops early at a step with no request (stalled when requests are left). "
           "The same schedule() and complete_step() as a step-by-step run.")
      .def(
          "take_token_times",
          [](StepSimulator& self, int64_t request_id) { return to_numpy(self.take_token_times(request_id)); },
          "request_id"_a,
          "float64 array: the times of the tokens the request sampled in runs since the last call for it "
          "(then forgotten).");
  m.def("simulated_token", &simulated_token, "last_token"_a, "num_tokens"_a, "vocab_size"_a,
        "The token a simulated request samples after last_token with num_tokens tokens before it (prompt and "
        "generated): the same prompt gives the same answer, as greedy decoding does.");
}

}  // namespace

void bind_step_simulator(nb::module_& m) {
  bind_step_costs(m);
  bind_simulated_steps(m);
  bind_simulator(m);
}

}  // namespace kvtool
