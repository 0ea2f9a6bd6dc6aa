// What the scheduler's binding hands Python for one step (bind_scheduler_results.cpp binds it,
// bind_scheduler.cpp returns it from Scheduler.schedule).
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <optional>
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

// A decode step's rows (every request one new token, and sampling) as the arrays a decode kernel reads:
// built in one call, where flattening the requests' arrays in Python took ~60 us of a ~7 ms CPU step.
struct DecodeRows {
  NumpyArray1D<int64_t> token_ids;                            // [num_rows]
  NumpyArray1D<int64_t> positions;                            // [num_rows]: the tokens each row has cached
  nanobind::ndarray<nanobind::numpy, int32_t, nanobind::ndim<2>> block_tables;  // [num_rows, max_blocks], -1 padded
};

// The batch's DecodeRows, or nullopt when it has no request or one with more than one new token or not
// sampling (a step for the general path).
std::optional<DecodeRows> decode_rows(const PyScheduledBatch& batch);

}  // namespace kvtool
