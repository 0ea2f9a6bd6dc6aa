#include "parallel.h"

#include <algorithm>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace kvtool::cpu {

namespace {

// A waiting thread spins this many times (~10 us) before it yields its core at each look: a step's
// phases are microseconds apart, but a thread the scheduler has taken off its core must get it
// back. Two kvtool processes of two threads each on the 2-core VM generated 64 tokens in 8.4-8.8 s
// each at 16k spins, 0.8-1.1 s at 512 (1.1-1.35 s with a region per kernel, 0.4-0.5 s alone); as
// an OpenMP barrier a step took about the regions' time again.
constexpr int kSpinsBeforeYield = 1 << 9;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

inline int team_thread() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

}  // namespace

struct Parallel::Team {
  struct alignas(64) Slot {
    int64_t calls = 0;  // collective run() calls this thread has made in the team
  };

  explicit Team(int num_threads) : slots(num_threads) {}

  bool active = false;  // set before the team's threads start, cleared after they end
  int size = 1;
  // The task counters of alternate run() calls: a call's counter is zeroed during the call before,
  // when no thread can be taking tasks from it.
  std::atomic<int64_t> next[2] = {0, 0};
  std::vector<Slot> slots;
  alignas(64) std::atomic<int> arrived{0};
  std::atomic<int64_t> generation{0};
};

Parallel::Parallel(int num_threads) : num_threads_(std::max(1, num_threads)) {
#ifdef _OPENMP
  num_threads_ = std::min(num_threads_, omp_get_max_threads());
#else
  num_threads_ = 1;
#endif
  team_ = std::make_unique<Team>(num_threads_);
}

Parallel::~Parallel() = default;
Parallel::Parallel(Parallel&&) noexcept = default;
Parallel& Parallel::operator=(Parallel&&) noexcept = default;

void Parallel::wait_for_team() const {
  Team& team = *team_;
  // Read before arriving: the last thread to arrive moves the generation on.
  const int64_t generation = team.generation.load(std::memory_order_acquire);
  if (team.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == team.size) {
    team.arrived.store(0, std::memory_order_relaxed);
    team.generation.store(generation + 1, std::memory_order_release);
    return;
  }
  for (int spins = 0; team.generation.load(std::memory_order_acquire) == generation; ++spins) {
    if (spins < kSpinsBeforeYield) {
      cpu_relax();
    } else {
      std::this_thread::yield();
    }
  }
}

void Parallel::run(int64_t num_tasks, TaskFn fn, const void* context) const {
  if (team_->active) {
    Team& team = *team_;
    const int thread = team_thread();
    int64_t& calls = team.slots[thread].calls;
    std::atomic<int64_t>& next = team.next[calls % 2];
    ++calls;
    for (int64_t task = next.fetch_add(1); task < num_tasks; task = next.fetch_add(1)) fn(context, task, thread);
    if (thread == 0) team.next[calls % 2].store(0, std::memory_order_relaxed);
    wait_for_team();
    return;
  }
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

void Parallel::run_one(TaskFn fn, const void* context) const {
  if (!team_->active) {
    fn(context, 0, 0);
    return;
  }
  if (team_thread() == 0) fn(context, 0, 0);
  wait_for_team();
}

void Parallel::run_team(BodyFn body, const void* context) {
  if (num_threads_ <= 1) {
    body(context);  // a team of one: run() and run_one() run on this thread as they do outside a team
    return;
  }
  Team& team = *team_;
  team.active = true;
#ifdef _OPENMP
#pragma omp parallel num_threads(num_threads_)
  {
    // OpenMP may give fewer threads than asked for (a limit of its own): the barrier counts these.
#pragma omp single
    team.size = omp_get_num_threads();
    body(context);
  }
#else
  team.size = 1;
  body(context);
#endif
  team.active = false;
  team.next[0] = 0;
  team.next[1] = 0;
  for (Team::Slot& slot : team.slots) slot.calls = 0;
}

}  // namespace kvtool::cpu
