// How fast two threads read a decode layer's KV blocks, by where the blocks lie and in what order they
// are read (kvtool/runtime/kv_pool.py, layer_major_zeros; csrc/cpu/attention_dims.h): SmolLM2-135M's
// bfloat16 blocks (32 tokens x 3 KV heads x 64, keys then values: 24 KB a layer), 34 blocks a layer
// (~1,085 tokens), 30 layers, each thread half of a layer's blocks; 8 MB of "weights" read between two
// layers (prefetchnta, as the row product asks for them) so that a layer's blocks come from memory.
//
// Placement: "side by side" (a layer's blocks one after another, as the CPU pool now lies) or
// "scattered" (each block 24 KB on its own: the block-major pool put a layer's blocks 30 x 24 KB apart).
// Orders: "in order" (each block's lines as they lie), "by head" (the decode kernel's: a head's two
// lines of each token, then the next head's, keys then values), each with nothing asked for ahead or
// the next block asked for a line or two per step (prefetcht0/t1/t2/nta), or the whole next block at
// once, or the block after next. Prints per round a plain 1 GiB read's rate, then each variant's
// median us a layer and GB/s (the VM's memory rate moves between rounds: compare within a round).
//
//   g++ -O2 -march=native -fopenmp bench/cpu_kv_read.cpp -o /tmp/kv_read && /tmp/kv_read
//
// Needs AVX-512.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr size_t kBlockBytes = 24576;  // a layer's block: keys, then values
constexpr size_t kHalfBytes = kBlockBytes / 2;
constexpr size_t kTokenBytes = 384;  // 3 KV heads x 64 bfloat16
constexpr size_t kHeadBytes = 128;
constexpr int kLayers = 30;
constexpr int kBlocksPerLayer = 34;
constexpr size_t kPoolBytes = size_t{1} << 31;
constexpr size_t kWeightBytes = 8 << 20;

enum class Order { kInOrder, kByHead };
enum class Ask { kNone, kNextT0, kNextT1, kNextT2, kNextNta, kNextAtOnceT1, kAfterNextT1 };

using ReadLayer = __m512 (*)(const char* pool, const int* ids, int n);
struct Variant {
  const char* name;
  ReadLayer read;
};

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

__m512 line(const char* p) { return _mm512_load_ps(reinterpret_cast<const float*>(p)); }

template <Ask A>
inline void ask_for(const char* p) {
  switch (A) {  // a constant: the variants are compiled apart, so that none pays for choosing
    case Ask::kNextT0: _mm_prefetch(p, _MM_HINT_T0); break;
    case Ask::kNextT2: _mm_prefetch(p, _MM_HINT_T2); break;
    case Ask::kNextNta: _mm_prefetch(p, _MM_HINT_NTA); break;
    case Ask::kNone: break;
    default: _mm_prefetch(p, _MM_HINT_T1); break;
  }
}

// Reads n blocks of a layer (pool + ids[b] * kBlockBytes) in order O, asking as A says.
template <Order O, Ask A>
__m512 read_layer(const char* pool, const int* ids, int n) {
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
  for (int i = 0; i < n; ++i) {
    const char* block = pool + size_t(ids[i]) * kBlockBytes;
    const int ahead = A == Ask::kAfterNextT1 ? 2 : 1;
    const char* next = i + ahead < n && A != Ask::kNone ? pool + size_t(ids[i + ahead]) * kBlockBytes : nullptr;
    if (A == Ask::kNextAtOnceT1 && next != nullptr) {
      for (size_t l = 0; l < kBlockBytes; l += 64) ask_for<A>(next + l);
      next = nullptr;
    }
    size_t asked = 0;  // a step per two lines read, whatever the order
    if (O == Order::kInOrder) {
      for (size_t l = 0; l < kBlockBytes; l += 128, asked += 128) {
        if (next != nullptr) {
          ask_for<A>(next + asked);
          ask_for<A>(next + asked + 64);
        }
        a = _mm512_fmadd_ps(line(block + l), line(block + l), a);
        b = _mm512_fmadd_ps(line(block + l + 64), line(block + l + 64), b);
      }
    } else {
      for (size_t kv = 0; kv < 2; ++kv)
        for (size_t h = 0; h < 3; ++h)
          for (size_t t = 0; t < 32; ++t, asked += 128) {
            const char* p = block + kv * kHalfBytes + t * kTokenBytes + h * kHeadBytes;
            if (next != nullptr) {
              ask_for<A>(next + asked);
              ask_for<A>(next + asked + 64);
            }
            a = _mm512_fmadd_ps(line(p), line(p), a);
            b = _mm512_fmadd_ps(line(p + 64), line(p + 64), b);
          }
    }
  }
  return _mm512_add_ps(a, b);
}

char* huge_buffer(size_t bytes) {
  char* p = static_cast<char*>(aligned_alloc(size_t{1} << 21, bytes));
  madvise(p, bytes, MADV_HUGEPAGE);
  memset(p, 1, bytes);
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 3;
  char* pool = huge_buffer(kPoolBytes);
  char* weights = huge_buffer(4 * kWeightBytes);
  const int num_blocks = static_cast<int>(kPoolBytes / kBlockBytes);
  std::vector<int> side_by_side(kLayers * kBlocksPerLayer), scattered(kLayers * kBlocksPerLayer);
  std::vector<int> shuffled(num_blocks);
  for (int i = 0; i < num_blocks; ++i) shuffled[i] = i;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(1));
  for (int l = 0; l < kLayers; ++l)
    for (int b = 0; b < kBlocksPerLayer; ++b) {
      side_by_side[l * kBlocksPerLayer + b] = l * (num_blocks / kLayers) + b;
      scattered[l * kBlocksPerLayer + b] = shuffled[l * kBlocksPerLayer + b];
    }
  const Variant variants[] = {
      {"in order, nothing asked", read_layer<Order::kInOrder, Ask::kNone>},
      {"by head, nothing asked", read_layer<Order::kByHead, Ask::kNone>},
      {"by head, next t1", read_layer<Order::kByHead, Ask::kNextT1>},
      {"by head, next t0", read_layer<Order::kByHead, Ask::kNextT0>},
      {"in order, next t1", read_layer<Order::kInOrder, Ask::kNextT1>},
      {"in order, next t0", read_layer<Order::kInOrder, Ask::kNextT0>},
      {"in order, next t2", read_layer<Order::kInOrder, Ask::kNextT2>},
      {"in order, next nta", read_layer<Order::kInOrder, Ask::kNextNta>},
      {"in order, next at once t1", read_layer<Order::kInOrder, Ask::kNextAtOnceT1>},
      {"in order, after next t1", read_layer<Order::kInOrder, Ask::kAfterNextT1>},
  };
  float sink = 0;
  for (int round = 0; round < rounds; ++round) {
    double start = now();
#pragma omp parallel num_threads(2) reduction(+ : sink)
    {
      const size_t half = kPoolBytes / 2, first = omp_get_thread_num() * half;
      __m512 a = _mm512_setzero_ps();
      for (size_t o = first; o < first + half; o += 64) a = _mm512_add_ps(a, line(pool + o));
      sink += _mm512_reduce_add_ps(a);
    }
    printf("round %d: a 2 GiB read at %.1f GB/s\n", round, kPoolBytes / (now() - start) / 1e9);
    for (const auto* placement : {&side_by_side, &scattered}) {
      for (const Variant& v : variants) {
        std::vector<double> us;
        for (int repeat = 0; repeat < 5; ++repeat) {
          double total = 0;
          for (int l = 0; l < kLayers; ++l) {
#pragma omp parallel num_threads(2) reduction(+ : sink)
            {
              const size_t half = kWeightBytes / 2, first = omp_get_thread_num() * half;
              const char* w = weights + (l % 4) * kWeightBytes;
              __m512 a = _mm512_setzero_ps();
              for (size_t o = first; o < first + half; o += 64) {
                _mm_prefetch(w + o + 4096, _MM_HINT_NTA);
                a = _mm512_add_ps(a, line(w + o));
              }
              sink += _mm512_reduce_add_ps(a);
            }
            const double layer_start = now();
#pragma omp parallel num_threads(2) reduction(+ : sink)
            {
              const int* ids = placement->data() + l * kBlocksPerLayer + omp_get_thread_num() * (kBlocksPerLayer / 2);
              sink += _mm512_reduce_add_ps(v.read(pool, ids, kBlocksPerLayer / 2));
            }
            total += now() - layer_start;
          }
          us.push_back(total / kLayers * 1e6);
        }
        std::sort(us.begin(), us.end());
        const char* where = placement == &side_by_side ? "side by side" : "scattered";
        printf("  %-12s %-28s %6.1f us a layer  %5.1f GB/s\n", where, v.name, us[2],
               kBlocksPerLayer * kBlockBytes / us[2] / 1e3);
      }
    }
  }
  printf("(%g)\n", sink);
}
