#include "thread_pool.h"

#include <chrono>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVTOOL_CPU_RELAX() _mm_pause()
#else
#define KVTOOL_CPU_RELAX() std::this_thread::yield()
#endif

namespace kvtool::cpu {

namespace {

// Workers spin this long after a job before they sleep: the next layer's kernel usually comes
// within it, and a sleeping worker takes tens of microseconds to wake. Short, because on busy
// cores a spinning thread takes the time another needs (torch's libgomp spins briefly too).
constexpr auto kSpin = std::chrono::microseconds(50);

}  // namespace

void ThreadPool::Job::work(int thread) {
  for (int64_t task = next.fetch_add(1); task < num_tasks; task = next.fetch_add(1)) {
    fn(context, task, thread);
    done.fetch_add(1, std::memory_order_release);
  }
}

ThreadPool::ThreadPool(int num_threads) {
  for (int thread = 1; thread < num_threads; ++thread) workers_.emplace_back([this, thread] { worker_loop(thread); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void ThreadPool::run(int64_t num_tasks, TaskFn fn, const void* context) {
  if (num_tasks <= 0) return;
  if (workers_.empty() || num_tasks == 1) {
    for (int64_t task = 0; task < num_tasks; ++task) fn(context, task, 0);
    return;
  }
  std::lock_guard<std::mutex> one_run(run_mutex_);
  auto job = std::make_shared<Job>();
  job->fn = fn;
  job->context = context;
  job->num_tasks = num_tasks;
  std::atomic_store(&job_, job);
  generation_.fetch_add(1);
  if (sleeping_.load() > 0) {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    wake_.notify_all();
  }
  job->work(0);
  for (int spins = 0; job->done.load(std::memory_order_acquire) < num_tasks; ++spins) {
    if (spins < 4096) {
      KVTOOL_CPU_RELAX();
    } else {
      std::this_thread::yield();  // a worker was descheduled mid-task: let it run
    }
  }
}

void ThreadPool::worker_loop(int thread) {
  uint64_t seen = 0;
  while (true) {
    auto spin_until = std::chrono::steady_clock::now() + kSpin;
    while (generation_.load() == seen && std::chrono::steady_clock::now() < spin_until) KVTOOL_CPU_RELAX();
    if (generation_.load() == seen) {
      std::unique_lock<std::mutex> lock(wake_mutex_);
      sleeping_.fetch_add(1);
      wake_.wait(lock, [&] { return stop_ || generation_.load() != seen; });
      sleeping_.fetch_sub(1);
      if (stop_) return;
    }
    seen = generation_.load();
    std::shared_ptr<Job> job = std::atomic_load(&job_);
    job->work(thread);
  }
}

}  // namespace kvtool::cpu
