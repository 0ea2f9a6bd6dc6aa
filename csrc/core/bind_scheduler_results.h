// What the scheduler's binding hands Python for one step (bind_scheduler_results.cpp binds it,
// bind_scheduler.cpp returns it from Scheduler.schedule).
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <vector>

#include "numpy_arrays.h"
#include "scheduler.h"

namespace kvtool {

// A ScheduledBatch as Python sees it: converted once, so repeated attribute reads copy nothing.
struct PyScheduledBatch {
  int64_t step_id = 0;
  nanobind::list requests;                  // ScheduledRequest, context chunks first
  CopyOpArrays copy_ops;                    // run these, in order, before the forward
  std::vector<int64_t> paused_request_ids;  // paused this step (MAX_UTILIZATION)
  int32_t num_tokens = 0;                   // tokens computed in the step
};

PyScheduledBatch to_python(ScheduledBatch&& batch);

}  // namespace kvtool
