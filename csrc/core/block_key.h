// Block keys: a fast non-cryptographic 64-bit hash chained from the parent block's key over the
// block's token ids, extra ids, LoRA task id and cache salt. The hash only finds candidates;
// the prefix tree compares the stored key fields too, so a collision never reuses wrong KV.
#pragma once

#include <cstdint>
#include <cstring>

#include "kv_cache_types.h"

namespace kvtool {

inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// Final avalanche (the well-known 64-bit finalizer constants): every input bit flips about half
// of the output bits, so truncated or sequential inputs still spread over a hash table.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

// 64x64 -> 128-bit multiply folded to 64 bits: one multiply mixes two input words.
inline uint64_t fold_mul(uint64_t a, uint64_t b) {
  const __uint128_t r = static_cast<__uint128_t>(a) * b;
  return static_cast<uint64_t>(r) ^ static_cast<uint64_t>(r >> 64);
}

// Hash of n 32-bit values: two independent lanes, each folding a pair of 64-bit words per
// multiply (a block of 32 tokens is 16 words: 4 multiplies per lane), so the CPU overlaps them.
inline uint64_t hash_u32s(const void* data, size_t n, uint64_t seed) {
  constexpr uint64_t kP0 = 0xa0761d6478bd642fULL;
  constexpr uint64_t kP1 = 0xe7037ed1a0b428dbULL;
  constexpr uint64_t kP2 = 0x8ebc6af09c88c6e3ULL;
  constexpr uint64_t kP3 = 0x589965cc75374cc3ULL;
  const auto* bytes = static_cast<const unsigned char*>(data);
  uint64_t lane0 = seed ^ kP0, lane1 = rotl64(seed, 32) ^ kP1;
  const size_t num_words = n / 2;
  size_t i = 0;
  uint64_t w[4];
  for (; i + 4 <= num_words; i += 4) {
    std::memcpy(w, bytes + i * 8, 32);
    lane0 = fold_mul(w[0] ^ kP1, w[1] ^ lane0);
    lane1 = fold_mul(w[2] ^ kP2, w[3] ^ lane1);
  }
  for (; i < num_words; ++i) {
    std::memcpy(w, bytes + i * 8, 8);
    lane0 = fold_mul(w[0] ^ kP3, lane0 ^ kP1);
  }
  if (n & 1) {
    uint32_t last;
    std::memcpy(&last, bytes + (n - 1) * 4, 4);
    lane1 = fold_mul((static_cast<uint64_t>(last) | (1ULL << 40)) ^ kP3, lane1 ^ kP2);
  }
  return mix64(fold_mul(lane0 ^ kP2, lane1 ^ kP3 ^ static_cast<uint64_t>(n)));
}

// True when any of the n extra ids is non-zero. A block whose extra ids are all 0 has the key of
// the same tokens without extra ids (0 means "normal token").
inline bool any_extra(const ExtraId* extra_ids, size_t n) {
  if (extra_ids == nullptr) return false;
  for (size_t i = 0; i < n; ++i) {
    if (extra_ids[i] != 0) return true;
  }
  return false;
}

// Key of one full block. extra_ids may be null (all 0). hash_bits < 64 truncates (test hook).
inline uint64_t block_key_hash(uint64_t parent_hash, const TokenId* token_ids, const ExtraId* extra_ids,
                               size_t n, uint64_t lora_task_id, uint64_t cache_salt, int hash_bits) {
  uint64_t h = hash_u32s(token_ids, n, parent_hash);
  if (any_extra(extra_ids, n)) h ^= rotl64(hash_u32s(extra_ids, 2 * n, h ^ 0x51ED27A1ULL), 23);
  h = mix64(h ^ mix64(lora_task_id + 0x2545F4914F6CDD1DULL) ^ rotl64(mix64(cache_salt + 0x1B873593ULL), 31));
  if (hash_bits >= 64) return h;
  if (hash_bits <= 0) return 0;
  return h & ((1ULL << hash_bits) - 1);
}

}  // namespace kvtool
