// Runs a kernel's tasks on the OpenMP threads. The extension links libgomp by its soname, so with
// torch imported first it shares torch's own OpenMP runtime: the kernels and torch's GEMMs take
// turns on one set of warm threads instead of two pools competing for the cores (a pool of our
// own had its idle workers asleep whenever a decode step's attention came, between GEMMs).
// Without OpenMP (a compiler lacking it) the tasks run on the calling thread.
//
// A team (run_team) keeps the threads for a whole decoder stack step: its kernels' run() calls share
// their tasks among the team's threads and end at a spin barrier (parallel.cpp: it yields soon, for
// processes sharing the cores), where a parallel region of their own each cost the fork and the
// join. Streaming SmolLM2-135M's 121 bfloat16 matrices, each split between two threads, took
// 1.03-1.09x the time in a region each than in one team with a barrier after each matrix (a C++ test
// on the AMD EPYC VM at ~80 GB/s).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

namespace kvtool::cpu {

class Parallel {
 public:
  using TaskFn = void (*)(const void* context, int64_t task, int thread);
  using BodyFn = void (*)(const void* context);
  using RangeFn = void (*)(const void* context, int64_t begin, int64_t end, int thread);

  // At most num_threads threads, the caller included (and no more than OpenMP's own limit).
  explicit Parallel(int num_threads);
  ~Parallel();
  Parallel(Parallel&&) noexcept;
  Parallel& operator=(Parallel&&) noexcept;

  int num_threads() const { return num_threads_; }

  // Runs fn(context, task, thread) for every task in [0, num_tasks) and returns when all are done.
  // Threads take the next task in turn (so list long tasks first); thread is in [0, num_threads).
  // Inside a team, every thread of it calls run() with the same arguments (a collective call), and
  // the team's threads share the tasks.
  void run(int64_t num_tasks, TaskFn fn, const void* context) const;
  // Runs fn(context, begin, end, thread) over [0, num_items) in ranges of at most `grain` items, each
  // item once: each thread walks a contiguous share of the items front to back (one sequential
  // stream), and a thread done with its own share takes ranges from the back of the others' until
  // none is left, so the threads end together however their speeds differ. Inside a team a collective
  // call, as run() is.
  void run_shares(int64_t num_items, int64_t grain, RangeFn fn, const void* context) const;

  // fn(context, 0, 0) on one thread: the caller's, or inside a team its thread 0 while the others
  // wait for it (a collective call).
  void run_one(TaskFn fn, const void* context) const;

  // Runs body(context) on every thread of a team at once and returns when all have. The body makes
  // the same collective calls in the same order on every thread, and throws nothing (check first):
  // an exception cannot leave a team. Not from inside another team.
  void run_team(BodyFn body, const void* context);
  template <typename F>
  void run_team(F& body) {
    run_team([](const void* context) { (*static_cast<F*>(const_cast<void*>(context)))(); }, &body);
  }

 private:
  struct Team;
  void wait_for_team() const;
  void end_collective_call(int64_t calls) const;

  int num_threads_;
  std::unique_ptr<Team> team_;  // its state while run_team runs (team_->active false otherwise)
};

}  // namespace kvtool::cpu
