#include "parallel.h"

#include <algorithm>
#include <atomic>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace kvtool::cpu {

Parallel::Parallel(int num_threads) : num_threads_(std::max(1, num_threads)) {
#ifdef _OPENMP
  num_threads_ = std::min(num_threads_, omp_get_max_threads());
#else
  num_threads_ = 1;
#endif
}

void Parallel::run(int64_t num_tasks, TaskFn fn, const void* context) const {
  const int threads = static_cast<int>(std::min<int64_t>(num_threads_, num_tasks));
  if (threads <= 1) {
    for (int64_t task = 0; task < num_tasks; ++task) fn(context, task, 0);
    return;
  }
  std::atomic<int64_t> next{0};
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
  {
    const int thread = omp_get_thread_num();
    for (int64_t task = next.fetch_add(1); task < num_tasks; task = next.fetch_add(1)) fn(context, task, thread);
  }
#endif
}

}  // namespace kvtool::cpu
