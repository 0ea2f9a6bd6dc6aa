// Block keys: a 64-bit hash chained from the parent block's key over the block's token ids, extra
// ids, LoRA task id and cache salt. The hash only finds candidates; the prefix tree compares the
// stored key fields too, so a collision never reuses wrong KV.
#pragma once

#include <cstdint>
#include <cstring>

#include "kv_cache_types.h"

namespace kvtool {

constexpr uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// The well-known 64-bit finalizer (MurmurHash3's fmix64): every input bit flips about half of the
// output bits, so truncated or sequential inputs still spread over a hash table.
constexpr uint64_t mix64(uint64_t x) {
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

inline uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Keys of the 32-byte stripes of a block by position (16 stripes x 4 words: splitmix64 of
// 1..64), so that equal stripes at different places contribute differently.
struct HashSecret {
  uint64_t words[64];
  constexpr HashSecret() : words() {
    uint64_t state = 0;
    for (uint64_t& w : words) {
      state += 0x9E3779B97F4A7C15ULL;
      uint64_t z = state;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
      w = z ^ (z >> 31);
    }
  }
};
inline constexpr HashSecret kHashSecret{};
inline constexpr size_t kStripesPerRound = 16;  // lanes are stirred after each round (512 bytes)

// Hash of num_bytes bytes (a multiple of 4): XXH3's accumulate step over 32-byte stripes. Each of
// four independent lanes adds the product of the halves of (word ^ key) and the neighbouring raw
// word, so the lanes' multiplies overlap (and the compiler may vectorize them).
inline uint64_t hash_bytes(const void* data, size_t num_bytes, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  const size_t num_stripes = num_bytes / 32;
  uint64_t acc[4] = {seed ^ 0xa0761d6478bd642fULL, seed ^ 0xe7037ed1a0b428dbULL, seed ^ 0x8ebc6af09c88c6e3ULL,
                     seed ^ 0x589965cc75374cc3ULL};
  for (size_t s = 0; s < num_stripes; ++s) {
    const uint64_t* key = &kHashSecret.words[4 * (s % kStripesPerRound)];
    uint64_t w[4];
    for (int i = 0; i < 4; ++i) w[i] = load64(p + 32 * s + 8 * i);
    for (int i = 0; i < 4; ++i) {
      const uint64_t x = w[i] ^ key[i];
      acc[i] += (x & 0xFFFFFFFFULL) * (x >> 32) + w[i ^ 1];
    }
    if (s % kStripesPerRound == kStripesPerRound - 1) {
      for (uint64_t& a : acc) a = mix64(a);
    }
  }
  // The 4-, 8-, 12- or 16-byte rest, then the four lanes folded into one word.
  p += 32 * num_stripes;
  size_t rest = num_bytes % 32;
  for (; rest >= 8; rest -= 8, p += 8) acc[0] = fold_mul(load64(p) ^ 0x8ebc6af09c88c6e3ULL, acc[0] ^ 0x589965cc75374cc3ULL);
  if (rest == 4) {
    uint32_t last;
    std::memcpy(&last, p, 4);
    acc[1] = fold_mul((static_cast<uint64_t>(last) | (1ULL << 40)) ^ 0x589965cc75374cc3ULL, acc[1] ^ 0x8ebc6af09c88c6e3ULL);
  }
  return fold_mul(acc[0] ^ rotl64(acc[2], 29) ^ 0x1d8e4e27c47d124fULL,
                  acc[1] ^ rotl64(acc[3], 41) ^ static_cast<uint64_t>(num_bytes));
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
constexpr uint64_t key_identity(uint64_t lora_task_id, uint64_t cache_salt) {
  return mix64(lora_task_id + 0x2545F4914F6CDD1DULL) ^ rotl64(mix64(cache_salt + 0x1B873593ULL), 31);
}

// Hash of one full block's own content: its token ids and, if any is non-zero, its extra ids.
inline uint64_t block_content_hash(const TokenId* token_ids, const ExtraId* extra_ids, size_t n) {
  uint64_t h = hash_bytes(token_ids, n * sizeof(TokenId), 0x9E3779B97F4A7C15ULL);
  if (any_extra(extra_ids, n)) h ^= rotl64(hash_bytes(extra_ids, n * sizeof(ExtraId), h ^ 0x51ED27A1ULL), 23);
  return h;
}

// Key of one full block, chained from its parent's key (0 at the root). hash_bits < 64 truncates
// (test hook).
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
