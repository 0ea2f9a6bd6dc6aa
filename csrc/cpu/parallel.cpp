#include "parallel.h"

#include <algorithm>
#include <optional>
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

// What has been taken of one thread's share in a run_shares() call: ranges from its front (by the
// thread itself) in the low 32 bits, from its back (by the others) in the high 32.
struct alignas(64) ShareTaken {
  std::atomic<uint64_t> taken{0};
};

// The index of the next range a claim takes from a share of num_ranges ranges: from the front or
// from the back; none when the share is all taken.
std::optional<int64_t> claim(ShareTaken& share, int64_t num_ranges, bool front) {
  uint64_t old = share.taken.load(std::memory_order_relaxed);
  for (;;) {
    const auto from_front = static_cast<int64_t>(old & 0xffffffffu), from_back = static_cast<int64_t>(old >> 32);
    if (from_front + from_back >= num_ranges) return std::nullopt;
    const uint64_t next = old + (front ? uint64_t{1} : uint64_t{1} << 32);
    if (share.taken.compare_exchange_weak(old, next, std::memory_order_relaxed)) {
      return front ? from_front : num_ranges - 1 - from_back;
    }
  }
}

// One thread's part of a run_shares() call over `num_shares` shares (one a thread): its own share
// from the front, then the others' from the back.
void walk_shares(ShareTaken* shares, int num_shares, int thread, int64_t num_items, int64_t grain,
                 Parallel::RangeFn fn, const void* context) {
  auto walk = [&](int share, bool front) {
    const int64_t begin = share * num_items / num_shares, end = (share + 1) * num_items / num_shares;
    const int64_t num_ranges = (end - begin + grain - 1) / grain;
    for (auto range = claim(shares[share], num_ranges, front); range.has_value();
         range = claim(shares[share], num_ranges, front)) {
      const int64_t first = begin + *range * grain;
      fn(context, first, std::min(end, first + grain), thread);
    }
  };
  walk(thread, true);
  for (int k = 1; k < num_shares; ++k) walk((thread + k) % num_shares, false);
}

}  // namespace

struct Parallel::Team {
  struct alignas(64) Slot {
    int64_t calls = 0;  // collective run() and run_shares() calls this thread has made in the team
  };

  explicit Team(int num_threads) : slots(num_threads), shares{std::vector<ShareTaken>(num_threads),
                                                                std::vector<ShareTaken>(num_threads)} {}

  bool active = false;  // set before the team's threads start, cleared after they end
  int size = 1;
  // The task counters of alternate run() calls: a call's counter is zeroed during the call before,
  // when no thread can be taking tasks from it.
  std::atomic<int64_t> next[2] = {0, 0};
  std::vector<Slot> slots;
  // What each thread's share has given of alternate run_shares() calls, cleared as `next` is.
  std::vector<ShareTaken> shares[2];
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
    end_collective_call(calls);
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

void Parallel::end_collective_call(int64_t calls) const {
  Team& team = *team_;
  // The next call's state, which no thread touches before it has passed this call's barrier.
  if (team_thread() == 0) {
    team.next[calls % 2].store(0, std::memory_order_relaxed);
    for (ShareTaken& share : team.shares[calls % 2]) share.taken.store(0, std::memory_order_relaxed);
  }
  wait_for_team();
}

void Parallel::run_shares(int64_t num_items, int64_t grain, RangeFn fn, const void* context) const {
  grain = std::max<int64_t>(1, grain);
  if (team_->active) {
    Team& team = *team_;
    const int thread = team_thread();
    int64_t& calls = team.slots[thread].calls;
    ShareTaken* shares = team.shares[calls % 2].data();
    ++calls;
    walk_shares(shares, team.size, thread, num_items, grain, fn, context);
    end_collective_call(calls);
    return;
  }
  const int threads = static_cast<int>(std::min<int64_t>(num_threads_, (num_items + grain - 1) / grain));
  if (threads <= 1) {
    if (num_items > 0) fn(context, 0, num_items, 0);
    return;
  }
  std::vector<ShareTaken> shares(threads);
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
  walk_shares(shares.data(), omp_get_num_threads(), omp_get_thread_num(), num_items, grain, fn, context);
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
  for (std::vector<ShareTaken>& shares : team.shares) {
    for (ShareTaken& share : shares) share.taken = 0;
  }
  for (Team::Slot& slot : team.slots) slot.calls = 0;
}

}  // namespace kvtool::cpu
