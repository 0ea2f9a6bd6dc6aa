// Where the input row of a one-row product should sit (csrc/cpu/activation_buffer.h): two threads'
// products over 512 MB of weights (each thread half of the rows, the input row loaded beside each
// weight vector, as kvtool's dot_row does) with the input row 0, 16, 32 or 48 bytes past a 64-byte
// boundary, against a plain streaming read of the same bytes. Rounds alternate the variants after a
// 64 MB read; each prints GB/s per round (the VM's memory rate moves between rounds: compare within a
// round's line, at the same rate).
//
//   g++ -O3 -march=native -fopenmp bench/cpu_row_input_offset.cpp -o /tmp/row_offset && /tmp/row_offset 4
//
// Needs AVX-512 (bfloat16 rows: AVX512-BF16; the AVX2 rows use 256-bit loads on the same CPU).
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

using Fn = void (*)(const void* w, const void* x, float* y, int64_t rows, int64_t d);

// A bfloat16 row product, four pair-product chains (the weights' dtype: uint16_t).
template <int Offset>
void bf16_rows(const void* weights, const void* x0, float* y, int64_t rows, int64_t d) {
#if defined(__AVX512BF16__)
  const auto* x = reinterpret_cast<const uint16_t*>(static_cast<const char*>(x0) + Offset);
  for (int64_t n = 0; n < rows; ++n) {
    const uint16_t* w = static_cast<const uint16_t*>(weights) + n * d;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t k = 0;
    for (; k + 128 <= d; k += 128)
      for (int u = 0; u < 4; ++u)
        acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)_mm512_loadu_si512(w + k + 32 * u),
                                  (__m512bh)_mm512_loadu_si512(x + k + 32 * u));
    for (; k + 32 <= d; k += 32)
      acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
    y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
  }
#endif
}

// A float32 row product on 512-bit loads.
template <int Offset>
void f32_rows(const void* weights, const void* x0, float* y, int64_t rows, int64_t d) {
  const auto* x = reinterpret_cast<const float*>(static_cast<const char*>(x0) + Offset);
  for (int64_t n = 0; n < rows; ++n) {
    const float* w = static_cast<const float*>(weights) + n * d;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k + 64 <= d; k += 64)
      for (int u = 0; u < 4; ++u)
        acc[u] = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16 * u), _mm512_loadu_ps(x + k + 16 * u), acc[u]);
    y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
  }
}

// A float32 row product on 256-bit loads (kvtool's AVX2 code).
template <int Offset>
void f32_rows_avx2(const void* weights, const void* x0, float* y, int64_t rows, int64_t d) {
  const auto* x = reinterpret_cast<const float*>(static_cast<const char*>(x0) + Offset);
  for (int64_t n = 0; n < rows; ++n) {
    const float* w = static_cast<const float*>(weights) + n * d;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t k = 0; k + 32 <= d; k += 32)
      for (int u = 0; u < 4; ++u)
        acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8 * u), _mm256_loadu_ps(x + k + 8 * u), acc[u]);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    float sum = 0.0f;
    for (float lane : lanes) sum += lane;
    y[n] = sum;
  }
}

// The plain read the memory floor's probe does (rows of d floats).
void plain_read(const void* weights, const void*, float* y, int64_t rows, int64_t d) {
  const auto* p = static_cast<const float*>(weights);
  const int64_t n = rows * d;
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t i = 0; i + 64 <= n; i += 64)
    for (int u = 0; u < 4; ++u) acc[u] = _mm512_add_ps(acc[u], _mm512_loadu_ps(p + i + 16 * u));
  y[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

struct Variant {
  const char* name;
  Fn fn;
  int element_bytes;
};

}  // namespace

int main(int argc, char** argv) {
  const int64_t total = int64_t{512} << 20;
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 4;
  auto* weights = static_cast<char*>(std::aligned_alloc(1 << 21, total));
  madvise(weights, total, MADV_HUGEPAGE);  // as kvtool's weights lie (kvtool/runtime/host_allocator.py)
  for (int64_t i = 0; i < total / 4; ++i) reinterpret_cast<float*>(weights)[i] = 1.0f / static_cast<float>(1 + (i & 7));
  auto* x = static_cast<char*>(std::aligned_alloc(4096, 65536 + 64));
  for (int64_t i = 0; i < (65536 + 64) / 2; ++i) reinterpret_cast<uint16_t*>(x)[i] = 0x3f80;  // bfloat16 1.0
  std::vector<float> flush(int64_t{64} << 20 >> 2, 1.0f), y(total / 4 / 64 + 16);
  const Variant variants[] = {
      {"read", plain_read, 4},
#if defined(__AVX512BF16__)
      {"bf16+0", bf16_rows<0>, 2}, {"bf16+16", bf16_rows<16>, 2}, {"bf16+32", bf16_rows<32>, 2}, {"bf16+48", bf16_rows<48>, 2},
#endif
      {"f32+0", f32_rows<0>, 4}, {"f32+16", f32_rows<16>, 4}, {"f32+32", f32_rows<32>, 4},
      {"avx2 f32+0", f32_rows_avx2<0>, 4}, {"avx2 f32+16", f32_rows_avx2<16>, 4},
  };
  const int num_variants = sizeof(variants) / sizeof(Variant);
  for (int64_t d : {576, 1536, 2048, 8192}) {
    std::printf("in_features %ld (GB/s a round)\n", static_cast<long>(d));
    std::vector<std::vector<double>> rates(num_variants);
    for (int r = 0; r < rounds; ++r) {
      for (int i = 0; i < num_variants; ++i) {
        const int v = (i + r) % num_variants;
        float s = 0.0f;
        for (size_t j = 0; j < flush.size(); j += 16) s += flush[j];
        flush[r] = s;
        const int64_t row_bytes = d * variants[v].element_bytes, rows = total / row_bytes;
        const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(2)
        {
          const int t = omp_get_thread_num();
          const int64_t begin = t * rows / 2, end = (t + 1) * rows / 2;
          variants[v].fn(weights + begin * row_bytes, x, y.data() + begin, end - begin, d);
        }
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        rates[v].push_back(static_cast<double>(total) / seconds / 1e9);
      }
    }
    for (int v = 0; v < num_variants; ++v) {
      std::printf("  %-12s", variants[v].name);
      for (double rate : rates[v]) std::printf(" %5.1f", rate);
      std::printf("\n");
    }
  }
}
