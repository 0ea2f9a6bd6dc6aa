// Block keys: a fast non-cryptographic 64-bit hash chained from the parent block's key over the
// block's token ids, extra ids, LoRA task id and cache salt. The hash only finds candidates;
// the prefix tree compares the stored key fields too, so a collision never reuses wrong KV.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

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

inline uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Keys of the 32-byte stripes of a block by position (16 stripes x 4 words: splitmix64 of
// 1..64), so that equal stripes at different places contribute differently.
struct HashSecret {
  alignas(32) uint64_t words[64];
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

// hash_bytes, after its 32-byte stripes: the 4-, 8-, 12- or 16-byte rest, then the fold of the
// four lanes into one word.
inline uint64_t hash_finish(uint64_t acc0, uint64_t acc1, uint64_t acc2, uint64_t acc3, const unsigned char* p,
                            size_t rest, size_t num_bytes) {
  for (; rest >= 8; rest -= 8, p += 8) acc0 = fold_mul(load64(p) ^ 0x8ebc6af09c88c6e3ULL, acc0 ^ 0x589965cc75374cc3ULL);
  if (rest == 4) {
    uint32_t last;
    std::memcpy(&last, p, 4);
    acc1 = fold_mul((static_cast<uint64_t>(last) | (1ULL << 40)) ^ 0x589965cc75374cc3ULL, acc1 ^ 0x8ebc6af09c88c6e3ULL);
  }
  return fold_mul(acc0 ^ rotl64(acc2, 29) ^ 0x1d8e4e27c47d124fULL, acc1 ^ rotl64(acc3, 41) ^ static_cast<uint64_t>(num_bytes));
}

// Hash of num_bytes bytes (a multiple of 4). Each 32-byte stripe goes into four 64-bit lanes as
// in XXH3's accumulate step: lane i adds the product of the two halves of (word i ^ its key)
// and the raw neighbouring word i ^ 1. The lanes are independent and a multiply takes 32x32
// bits, so the stripes vectorize: SSE2 does two lanes per instruction, AVX2
// (hash_bytes_avx2, same result) four. The result feeds block_key, which mixes in the parent.
inline uint64_t hash_bytes(const void* data, size_t num_bytes, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  const size_t num_stripes = num_bytes / 32;
  uint64_t acc[4] = {seed ^ 0xa0761d6478bd642fULL, seed ^ 0xe7037ed1a0b428dbULL, seed ^ 0x8ebc6af09c88c6e3ULL,
                     seed ^ 0x589965cc75374cc3ULL};
#if defined(__SSE2__) && !defined(KVTOOL_HASH_SCALAR)  // KVTOOL_HASH_SCALAR: test the scalar form
  __m128i lanes01 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(acc));
  __m128i lanes23 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(acc + 2));
  for (size_t s = 0; s < num_stripes; ++s) {
    const auto* key = reinterpret_cast<const __m128i*>(&kHashSecret.words[4 * (s % kStripesPerRound)]);
    const __m128i d01 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * s));
    const __m128i d23 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * s + 16));
    const __m128i x01 = _mm_xor_si128(d01, _mm_load_si128(key));
    const __m128i x23 = _mm_xor_si128(d23, _mm_load_si128(key + 1));
    lanes01 = _mm_add_epi64(lanes01, _mm_add_epi64(_mm_mul_epu32(x01, _mm_srli_epi64(x01, 32)),
                                                   _mm_shuffle_epi32(d01, _MM_SHUFFLE(1, 0, 3, 2))));
    lanes23 = _mm_add_epi64(lanes23, _mm_add_epi64(_mm_mul_epu32(x23, _mm_srli_epi64(x23, 32)),
                                                   _mm_shuffle_epi32(d23, _MM_SHUFFLE(1, 0, 3, 2))));
    if (s % kStripesPerRound == kStripesPerRound - 1) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(acc), lanes01);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(acc + 2), lanes23);
      for (uint64_t& a : acc) a = mix64(a);
      lanes01 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(acc));
      lanes23 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(acc + 2));
    }
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(acc), lanes01);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(acc + 2), lanes23);
#else
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
#endif
  return hash_finish(acc[0], acc[1], acc[2], acc[3], p + 32 * num_stripes, num_bytes % 32, num_bytes);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVTOOL_HASH_AVX2 1
// hash_bytes with one AVX2 instruction per step for all four lanes; callers check
// cpu_has_avx2() first.
__attribute__((target("avx2"))) inline uint64_t hash_bytes_avx2(const void* data, size_t num_bytes, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  const size_t num_stripes = num_bytes / 32;
  alignas(32) uint64_t acc[4] = {seed ^ 0xa0761d6478bd642fULL, seed ^ 0xe7037ed1a0b428dbULL,
                                 seed ^ 0x8ebc6af09c88c6e3ULL, seed ^ 0x589965cc75374cc3ULL};
  __m256i lanes = _mm256_load_si256(reinterpret_cast<const __m256i*>(acc));
  for (size_t s = 0; s < num_stripes; ++s) {
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * s));
    const __m256i x = _mm256_xor_si256(
        d, _mm256_load_si256(reinterpret_cast<const __m256i*>(&kHashSecret.words[4 * (s % kStripesPerRound)])));
    lanes = _mm256_add_epi64(lanes, _mm256_add_epi64(_mm256_mul_epu32(x, _mm256_srli_epi64(x, 32)),
                                                     _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2))));
    if (s % kStripesPerRound == kStripesPerRound - 1) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(acc), lanes);
      for (uint64_t& a : acc) a = mix64(a);
      lanes = _mm256_load_si256(reinterpret_cast<const __m256i*>(acc));
    }
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(acc), lanes);
  return hash_finish(acc[0], acc[1], acc[2], acc[3], p + 32 * num_stripes, num_bytes % 32, num_bytes);
}

inline bool cpu_has_avx2() {
  __builtin_cpu_init();  // idempotent; needed where no constructor has run it yet
  return __builtin_cpu_supports("avx2");
}
#else
inline bool cpu_has_avx2() { return false; }
#endif

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
  uint64_t h = hash_bytes(token_ids, n * sizeof(TokenId), 0x9E3779B97F4A7C15ULL);
  if (any_extra(extra_ids, n)) h ^= rotl64(hash_bytes(extra_ids, n * sizeof(ExtraId), h ^ 0x51ED27A1ULL), 23);
  return h;
}

#if KVTOOL_HASH_AVX2
__attribute__((target("avx2"))) inline uint64_t block_content_hash_avx2(const TokenId* token_ids,
                                                                        const ExtraId* extra_ids, size_t n) {
  uint64_t h = hash_bytes_avx2(token_ids, n * sizeof(TokenId), 0x9E3779B97F4A7C15ULL);
  if (any_extra(extra_ids, n)) h ^= rotl64(hash_bytes_avx2(extra_ids, n * sizeof(ExtraId), h ^ 0x51ED27A1ULL), 23);
  return h;
}
#endif

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
