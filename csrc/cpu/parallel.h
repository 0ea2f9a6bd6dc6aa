// Runs a kernel's tasks on the OpenMP threads. The extension links libgomp by its soname, so with
// torch imported first it shares torch's own OpenMP runtime: the kernels and torch's GEMMs take
// turns on one set of warm threads instead of two pools competing for the cores (a pool of our
// own had its idle workers asleep whenever a decode step's attention came, between GEMMs).
// Without OpenMP (a compiler lacking it) the tasks run on the calling thread.
#pragma once

#include <cstdint>

namespace kvtool::cpu {

class Parallel {
 public:
  using TaskFn = void (*)(const void* context, int64_t task, int thread);

  // At most num_threads threads, the caller included (and no more than OpenMP's own limit).
  explicit Parallel(int num_threads);

  int num_threads() const { return num_threads_; }

  // Runs fn(context, task, thread) for every task in [0, num_tasks) and returns when all are done.
  // Threads take the next task in turn (so list long tasks first); thread is in [0, num_threads).
  void run(int64_t num_tasks, TaskFn fn, const void* context) const;

 private:
  int num_threads_;
};

}  // namespace kvtool::cpu
