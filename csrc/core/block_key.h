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

// Hash of n 32-bit values: four independent lanes, each folding a pair of 64-bit words per
// multiply (a block of 32 tokens is 16 words: 2 multiplies per lane), so the multiplies of a
// block overlap. The result feeds block_key, which mixes it with the parent's key.
inline uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

inline uint64_t hash_u32s(const void* data, size_t n, uint64_t seed) {
  constexpr uint64_t kP0 = 0xa0761d6478bd642fULL;
  constexpr uint64_t kP1 = 0xe7037ed1a0b428dbULL;
  constexpr uint64_t kP2 = 0x8ebc6af09c88c6e3ULL;
  constexpr uint64_t kP3 = 0x589965cc75374cc3ULL;
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* const end = p + (n / 16) * 64;  // whole 64-byte chunks
  uint64_t lane0 = seed ^ kP0, lane1 = seed ^ kP1, lane2 = seed ^ kP2, lane3 = seed ^ kP3;
  for (; p != end; p += 64) {
    lane0 = fold_mul(load64(p) ^ kP1, load64(p + 8) ^ lane0);
    lane1 = fold_mul(load64(p + 16) ^ kP2, load64(p + 24) ^ lane1);
    lane2 = fold_mul(load64(p + 32) ^ kP3, load64(p + 40) ^ lane2);
    lane3 = fold_mul(load64(p + 48) ^ kP0, load64(p + 56) ^ lane3);
  }
  for (size_t i = (n % 16) / 2; i > 0; --i, p += 8) lane0 = fold_mul(load64(p) ^ kP3, lane0 ^ kP1);
  if (n & 1) {
    uint32_t last;
    std::memcpy(&last, p, 4);
    lane1 = fold_mul((static_cast<uint64_t>(last) | (1ULL << 40)) ^ kP3, lane1 ^ kP2);
  }
  return fold_mul(lane0 ^ rotl64(lane2, 29), lane1 ^ rotl64(lane3, 41) ^ static_cast<uint64_t>(n));
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

// What a sequence contributes to every block key besides tokens: LoRA task id and cache salt.
inline uint64_t key_identity(uint64_t lora_task_id, uint64_t cache_salt) {
  return mix64(lora_task_id + 0x2545F4914F6CDD1DULL) ^ rotl64(mix64(cache_salt + 0x1B873593ULL), 31);
}

// Hash of one full block's own content: its token ids and, if any is non-zero, its extra ids.
// It does not depend on the parent, so the blocks of a sequence hash in parallel.
inline uint64_t block_content_hash(const TokenId* token_ids, const ExtraId* extra_ids, size_t n) {
  uint64_t h = hash_u32s(token_ids, n, 0x9E3779B97F4A7C15ULL);
  if (any_extra(extra_ids, n)) h ^= rotl64(hash_u32s(extra_ids, 2 * n, h ^ 0x51ED27A1ULL), 23);
  return h;
}

// Key of one full block, chained from its parent's key (0 at the root): one multiply per block
// on the chain. hash_bits < 64 truncates (test hook).
inline uint64_t block_key(uint64_t parent_key, uint64_t content_hash, uint64_t identity, int hash_bits) {
  const uint64_t h = fold_mul(parent_key ^ 0xd6e8feb86659fd93ULL, content_hash ^ identity);
  if (hash_bits >= 64) return h;
  if (hash_bits <= 0) return 0;
  return h & ((1ULL << hash_bits) - 1);
}

// Key of one full block from scratch. extra_ids may be null (all 0).
inline uint64_t block_key_hash(uint64_t parent_hash, const TokenId* token_ids, const ExtraId* extra_ids,
                               size_t n, uint64_t lora_task_id, uint64_t cache_salt, int hash_bits) {
  return block_key(parent_hash, block_content_hash(token_ids, extra_ids, n), key_identity(lora_task_id, cache_salt),
                   hash_bits);
}

}  // namespace kvtool
