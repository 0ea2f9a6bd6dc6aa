#include "draw_cut.h"

#include <algorithm>
#include <cstring>
#include <functional>

namespace kvtool::cpu {
namespace {

// Buckets by a weight's top 12 bits past the sign (8 of exponent, 4 of mantissa): each spans at most
// 1/16 of its values' magnitude, and a larger bucket holds only larger floats. Zero is bucket 0, 1.0
// (the largest weight) the last.
constexpr int kBucketShift = 19;
constexpr int kNumBuckets = (0x3F800000 >> kBucketShift) + 1;

inline int bucket_of(float w) {
  uint32_t bits;
  std::memcpy(&bits, &w, sizeof(bits));
  return std::min(static_cast<int>(bits >> kBucketShift), kNumBuckets - 1);
}

// On the stack (32 KB): draw_cut runs on a team's threads, which must not throw (no allocation).
struct Histogram {
  int64_t counts[kNumBuckets] = {};
  double masses[kNumBuckets] = {};
};

// The weights of bucket b that are >= floor, largest first, into out; returns how many.
int64_t bucket_values(const float* weights, int64_t size, int b, float floor, float* out) {
  int64_t n = 0;
  for (int64_t i = 0; i < size; ++i) {
    if (bucket_of(weights[i]) == b && weights[i] >= floor) out[n++] = weights[i];
  }
  std::sort(out, out + n, std::greater<float>());
  return n;
}

}  // namespace

float draw_cut(const float* weights, int64_t size, int64_t top_k, float top_p, float* bucket_scratch) {
  const bool cut_k = top_k > 0 && top_k < size, cut_p = top_p < 1.0f;
  if (!cut_k && !cut_p) return 0.0f;
  Histogram h;
  for (int64_t i = 0; i < size; ++i) {
    const int b = bucket_of(weights[i]);
    ++h.counts[b];
    h.masses[b] += weights[i];
  }
  // The top-k: the bucket where the count from the top reaches k, then its values in order.
  float floor = 0.0f;      // the smallest weight kept so far
  double kept_mass = 0.0;  // of the weights >= floor
  int floor_bucket = 0;    // the bucket `floor` lies in
  if (!cut_k) {
    for (int b = kNumBuckets - 1; b >= 0; --b) kept_mass += h.masses[b];
  } else {
    int64_t count = 0;
    double mass = 0.0;
    int b = kNumBuckets - 1;
    while (count + h.counts[b] < top_k) {
      count += h.counts[b];
      mass += h.masses[b];
      --b;
    }
    const int64_t n = bucket_values(weights, size, b, 0.0f, bucket_scratch);
    floor = bucket_scratch[top_k - count - 1];
    for (int64_t j = 0; j < n && bucket_scratch[j] >= floor; ++j) mass += bucket_scratch[j];
    kept_mass = mass;
    floor_bucket = b;
  }
  if (!cut_p) return floor;
  // The top-p of what is kept: the fewest largest whose mass reaches top_p of the kept mass.
  const double needed = static_cast<double>(top_p) * kept_mass;
  double before = 0.0;
  for (int b = kNumBuckets - 1; b >= floor_bucket; --b) {
    // The floor's bucket counts only its values >= floor.
    if (b != floor_bucket && before + h.masses[b] < needed) {
      before += h.masses[b];
      continue;
    }
    const int64_t n = bucket_values(weights, size, b, b == floor_bucket ? floor : 0.0f, bucket_scratch);
    for (int64_t j = 0; j < n; ++j) {
      if (before >= needed && before > 0.0) return bucket_scratch[j - 1];
      before += bucket_scratch[j];
    }
    if (before >= needed || b == floor_bucket) return n > 0 ? bucket_scratch[n - 1] : floor;
  }
  return floor;
}

}  // namespace kvtool::cpu
