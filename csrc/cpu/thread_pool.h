// A small pool of worker threads for the CPU kernels (no torch, so not torch's OpenMP pool). The
// kernels run between torch's GEMMs, never beside them, so each pool keeps its cores in turn.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kvtool::cpu {

class ThreadPool {
 public:
  using TaskFn = void (*)(const void* context, int64_t task, int thread);

  // num_threads counts the calling thread: num_threads - 1 workers are started.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(context, task, thread) for every task in [0, num_tasks) and returns when all are done.
  // Threads take the next task in turn (so list long tasks first); the caller is thread 0, the
  // workers 1 .. num_threads - 1. One run at a time (later callers wait).
  void run(int64_t num_tasks, TaskFn fn, const void* context);

 private:
  struct Job {
    TaskFn fn;
    const void* context;
    int64_t num_tasks;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    void work(int thread);
  };

  void worker_loop(int thread);

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex wake_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleeping_{0};
  bool stop_ = false;  // under wake_mutex_
  // The current job; a worker that wakes late finds its tasks taken and does nothing.
  std::shared_ptr<Job> job_;
};

}  // namespace kvtool::cpu
