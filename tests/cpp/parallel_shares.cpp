// Parallel::run_shares: every item once, in or out of a team, and a slow thread's share finished by
// the others. Built and run by tests/test_parallel_shares.py; prints what failed and exits 1, or 77
// when OpenMP gives fewer than two threads.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "parallel.h"

using kvtool::cpu::Parallel;

namespace {

struct Visits {
  std::vector<std::atomic<int>> count;
  std::vector<int> thread;  // the thread that took each item
  explicit Visits(int64_t n) : count(n), thread(n, -1) {}
};

// Each range's items counted and marked with its thread; thread 1 sleeps in every range it takes.
void visit(const void* context, int64_t begin, int64_t end, int thread) {
  auto* v = static_cast<Visits*>(const_cast<void*>(context));
  for (int64_t i = begin; i < end; ++i) {
    v->count[i].fetch_add(1);
    v->thread[i] = thread;
  }
  if (thread == 1) std::this_thread::sleep_for(std::chrono::microseconds(300));
}

int failures = 0;

void check(const Visits& v, int64_t n, int64_t grain, const char* where) {
  for (int64_t i = 0; i < n; ++i) {
    if (v.count[i].load() != 1) {
      std::printf("%s: %lld items in ranges of %lld: item %lld taken %d times\n", where, static_cast<long long>(n),
                  static_cast<long long>(grain), static_cast<long long>(i), v.count[i].load());
      ++failures;
      return;
    }
  }
  // Thread 1's share (the second half) has several ranges and thread 1 sleeps in each: thread 0 took some.
  if (n / 2 >= 4 * grain) {
    bool taken_by_0 = false;
    for (int64_t i = n / 2 + 1; i < n; ++i) taken_by_0 = taken_by_0 || v.thread[i] == 0;
    if (!taken_by_0) {
      std::printf("%s: %lld items in ranges of %lld: thread 0 took nothing from the slow thread's share\n", where,
                  static_cast<long long>(n), static_cast<long long>(grain));
      ++failures;
    }
  }
}

}  // namespace

int main() {
  Parallel pool(2);
  if (pool.num_threads() < 2) return 77;
  const int64_t sizes[] = {0, 1, 2, 7, 64, 1000, 4099};
  const int64_t grains[] = {1, 3, 64};
  for (int64_t n : sizes) {
    for (int64_t grain : grains) {
      Visits alone(n);
      pool.run_shares(n, grain, visit, &alone);
      check(alone, n, grain, "outside a team");
      // In a team: two calls in a row (each alternate call's state cleared by the one before) and a
      // run() between, as a decoder step makes them.
      Visits first(n), second(n);
      std::atomic<int> tasks{0};
      auto body = [&] {
        pool.run_shares(n, grain, visit, &first);
        pool.run(
            5, [](const void* c, int64_t, int) { static_cast<std::atomic<int>*>(const_cast<void*>(c))->fetch_add(1); },
            &tasks);
        pool.run_shares(n, grain, visit, &second);
      };
      pool.run_team(body);
      check(first, n, grain, "a team's first call");
      check(second, n, grain, "a team's third call");
      if (tasks.load() != 5) {
        std::printf("run() between two run_shares() calls ran %d of 5 tasks\n", tasks.load());
        ++failures;
      }
    }
  }
  if (failures == 0) std::printf("ok\n");
  return failures == 0 ? 0 : 1;
}
