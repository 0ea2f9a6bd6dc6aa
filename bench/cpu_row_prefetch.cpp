// How far ahead, and into which cache, a one-row product should ask for its weights (csrc/cpu/kernels_impl.h,
// ask_row_ahead): two threads' bfloat16 products over a 302 MB weight of 576-element rows (each thread
// half of the rows, as kvtool's dot_row reads them: four pair-product chains, the 256 bytes of an
// iteration asked for AHEAD bytes on with one prefetch a line), asking nothing, into L1 (prefetcht0) or
// into L2 (prefetcht1), or each thread's rows as two, four or eight streams walked side by side (asking
// 4 KB ahead into L2, or nothing), against a plain streaming read of 1 GiB. Each round runs every
// variant (best of two) and prints GB/s (the VM's memory rate moves between rounds: compare within a
// round's line).
//
//   g++ -O3 -march=native -std=c++17 -pthread bench/cpu_row_prefetch.cpp -o /tmp/row_prefetch && /tmp/row_prefetch 6
//
// Needs AVX512-BF16.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kRowElements = 576;  // SmolLM2-135M's hidden size
constexpr int64_t kNumRows = 262144;   // 302 MB of bfloat16 weights
constexpr int kNumThreads = 2;

using Fn = void (*)(const uint16_t* w, const uint16_t* x, float* y, int64_t begin, int64_t end);

inline __m512bh load_pairs(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// Rows [begin, end) of y = w x, each row's 256-byte iterations asking for the lines Ahead bytes on
// (Ahead 0: none) with the hint Hint.
template <int Ahead, int Hint>
void rows(const uint16_t* w, const uint16_t* x, float* y, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const uint16_t* row = w + n * kRowElements;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t k = 0;
    for (; k + 128 <= kRowElements; k += 128) {
      if constexpr (Ahead > 0) {
        for (int line = 0; line < 4; ++line) {
          _mm_prefetch(reinterpret_cast<const char*>(row + k) + Ahead + 64 * line, static_cast<_mm_hint>(Hint));
        }
      }
      for (int u = 0; u < 4; ++u) acc[u] = _mm512_dpbf16_ps(acc[u], load_pairs(row + k + 32 * u), load_pairs(x + k + 32 * u));
    }
    for (; k + 32 <= kRowElements; k += 32) acc[0] = _mm512_dpbf16_ps(acc[0], load_pairs(row + k), load_pairs(x + k));
    y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
  }
}

// Rows [begin, end) as Streams runs of equal length walked side by side, a row of each in turn, each
// asking Ahead bytes ahead into L2 (kvtool's amx build walks four, 4 KB ahead:
// KernelTable::row_product_streams), or nothing (Ahead 0: the hardware prefetcher alone).
template <int Streams, int Ahead>
void streams(const uint16_t* w, const uint16_t* x, float* y, int64_t begin, int64_t end) {
  const int64_t length = (end - begin + Streams - 1) / Streams;
  for (int64_t n = 0; n < length; ++n) {
    for (int s = 0; s < Streams; ++s) {
      const int64_t row = begin + s * length + n;
      if (row < end) rows<Ahead, _MM_HINT_T1>(w, x, y, row, row + 1);
    }
  }
}

float stream_sum(const float* data, int64_t begin, int64_t end) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t i = begin; i + 64 <= end; i += 64) {
    for (int u = 0; u < 4; ++u) acc[u] = _mm512_add_ps(acc[u], _mm512_loadu_ps(data + i + 16 * u));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

// Seconds of f(thread) on kNumThreads threads.
template <typename F>
double on_threads(F f) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < kNumThreads; ++t) threads.emplace_back(f, t);
  for (std::thread& thread : threads) thread.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 6;
  std::vector<uint16_t> w(kNumRows * kRowElements);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint16_t>(0x3f80 + i % 7);  // 1.0 .. 1.05
  std::vector<uint16_t> x(kRowElements, 0x3f80);
  std::vector<float> y(kNumRows), data((int64_t{1} << 30) / 4, 1.0f), sums(kNumThreads);
  struct Variant {
    const char* name;
    Fn fn;
  };
  const Variant variants[] = {{"none", rows<0, 0>},
                              {"L1 2K", rows<2048, _MM_HINT_T0>},
                              {"L1 4K", rows<4096, _MM_HINT_T0>},
                              {"L2 2K", rows<2048, _MM_HINT_T1>},
                              {"L2 4K", rows<4096, _MM_HINT_T1>},
                              {"L2 8K", rows<8192, _MM_HINT_T1>},
                              {"L2 16K", rows<16384, _MM_HINT_T1>},
                              {"L2 4K x2", streams<2, 4096>},
                              {"L2 4K x4", streams<4, 4096>},
                              {"none x2", streams<2, 0>},
                              {"none x4", streams<4, 0>},
                              {"none x8", streams<8, 0>}};
  const auto size = static_cast<int64_t>(data.size());
  for (int round = 0; round < rounds; ++round) {
    const double read = on_threads([&](int t) {
      sums[t] = stream_sum(data.data(), t * size / kNumThreads, (t + 1) * size / kNumThreads);
    });
    std::printf("round %d  read %5.1f GB/s |", round, size * 4 / read / 1e9);
    for (const Variant& v : variants) {
      double best = 1e9;
      for (int rep = 0; rep < 2; ++rep) {
        best = std::min(best, on_threads([&](int t) {
          v.fn(w.data(), x.data(), y.data(), t * kNumRows / kNumThreads, (t + 1) * kNumRows / kNumThreads);
        }));
      }
      std::printf(" %s %5.1f |", v.name, kNumRows * kRowElements * 2 / best / 1e9);
    }
    std::printf("\n");
  }
  return sums[0] == 0.0f && y[0] == 0.0f;  // keeps the reads
}
