// Room for a decoder step's activations, placed where the row product reads them fastest.
//
// Why the place matters: a decode step's row product (kernels_impl.h, dot_row) loads a weight vector
// and the input row's vector at the same element, one pair per multiply-add. On an AMD Zen 4 core
// (cpuinfo family 25 model 17, 512-bit loads in two 256-bit halves), with the input row at a 32-byte
// boundary, as the weight rows are, two threads' products of 2,048-wide bfloat16 rows streamed at
// ~0.85x a plain read of the same bytes at the VM's ~55 GB/s rate; with the input row 8, 16 or 48
// bytes past one, at the plain read's rate (32 past: as slow as 0). Llama-3.2-1B's bfloat16 decode
// steps took 0.85x the time (in-process A/B, results/cpu_decode_rows.md). A std::vector's data lies
// wherever the allocator puts it (16-byte alignment), so the step's speed depended on that. Other CPUs
// keep the input at a cache line's start: there a load across two lines costs an extra access, and
// the effect is not measured.
#pragma once

#include <cstdint>
#include <vector>

namespace kvtool::cpu {

// Bytes past a 64-byte boundary an activation row starts at on this CPU.
inline int64_t activation_offset_bytes() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_is("amd")) return 16;
#endif
  return 0;
}

// Moves keep data() (the vector's heap room moves with it); a copy would point into the original's.
class ActivationBuffer {
 public:
  ActivationBuffer() = default;
  ActivationBuffer(const ActivationBuffer&) = delete;
  ActivationBuffer& operator=(const ActivationBuffer&) = delete;
  ActivationBuffer(ActivationBuffer&&) noexcept = default;
  ActivationBuffer& operator=(ActivationBuffer&&) noexcept = default;

  // Room for num_floats floats (or twice as many bfloat16 values) from data().
  void resize(int64_t num_floats, int64_t offset_bytes) {
    storage_.assign(num_floats + (kLineBytes + offset_bytes) / sizeof(float), 0.0f);
    const auto line = (reinterpret_cast<uintptr_t>(storage_.data()) + kLineBytes - 1) & ~uintptr_t{kLineBytes - 1};
    data_ = reinterpret_cast<float*>(line + offset_bytes);
  }
  float* data() const { return data_; }

 private:
  static constexpr int64_t kLineBytes = 64;
  std::vector<float> storage_;
  float* data_ = nullptr;
};

}  // namespace kvtool::cpu
