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

// Hash of n 32-bit values: four independent multiply-rotate lanes over 64-bit words, so the
// CPU overlaps them (a block of 32 tokens is 16 words, 4 per lane).
inline uint64_t hash_u32s(const void* data, size_t n, uint64_t seed) {
  constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL;
  constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4FULL;
  const auto* bytes = static_cast<const unsigned char*>(data);
  uint64_t lane[4] = {seed + kP1, seed ^ kP2, seed - kP1, rotl64(seed, 17) + kP2};
  const size_t num_words = n / 2;
  size_t i = 0;
  for (; i + 4 <= num_words; i += 4) {
    for (int l = 0; l < 4; ++l) {
      uint64_t w;
      std::memcpy(&w, bytes + (i + l) * 8, 8);
      lane[l] = rotl64(lane[l] + w * kP2, 31) * kP1;
    }
  }
  for (; i < num_words; ++i) {
    uint64_t w;
    std::memcpy(&w, bytes + i * 8, 8);
    lane[0] = rotl64(lane[0] + w * kP2, 31) * kP1;
  }
  if (n & 1) {
    uint32_t w;
    std::memcpy(&w, bytes + (n - 1) * 4, 4);
    lane[1] = rotl64(lane[1] + (static_cast<uint64_t>(w) | (1ULL << 40)) * kP2, 31) * kP1;
  }
  uint64_t h = rotl64(lane[0], 1) + rotl64(lane[1], 7) + rotl64(lane[2], 12) + rotl64(lane[3], 18);
  return mix64(h ^ (static_cast<uint64_t>(n) * kP1));
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
