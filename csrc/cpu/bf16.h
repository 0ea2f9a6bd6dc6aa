// bfloat16 <-> float32 as torch converts them: widening is exact, narrowing rounds to nearest even
// and keeps NaN a (quiet) NaN. Static: each ISA's translation unit keeps its own copy, so the linker
// never hands code built for AVX-512 to the portable path.
#pragma once

#include <cstdint>
#include <cstring>

static inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

static inline uint16_t float_to_bf16(float f) {
  if (f != f) return 0x7fc0;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
