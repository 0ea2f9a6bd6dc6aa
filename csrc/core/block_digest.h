// Third-tier block keys: SHA-256 (FIPS 180-4) chained over the plan identity and every block of
// the prefix. The 64-bit block keys of block_key.h only find candidates in this process, which then
// compares the stored key fields; a store shared by engines has no such fields to compare, so its key
// must itself make KV identical: the model, dtype and shapes (plan_digest), the tokens and extra ids
// of the block and of its whole prefix, the LoRA task id and the cache salt. A collision of SHA-256
// is out of reach, and the store keeps the key beside the value, so a value found under a truncated
// or mistaken key is detected (kvtool/runtime/tier3_store.py).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kv_cache_types.h"

namespace kvtool {

// SHA-256 of a byte string, fed in pieces.
class Sha256 {
 public:
  Sha256() { reset(); }

  void reset() {
    static constexpr uint32_t kInit[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                          0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    std::memcpy(state_, kInit, sizeof(state_));
    num_bytes_ = 0;
    num_buffered_ = 0;
  }

  void update(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    num_bytes_ += n;
    if (num_buffered_ > 0) {
      const size_t take = std::min(n, size_t{64} - num_buffered_);
      std::memcpy(buffer_ + num_buffered_, p, take);
      num_buffered_ += take;
      p += take;
      n -= take;
      if (num_buffered_ < 64) return;
      compress(buffer_);
      num_buffered_ = 0;
    }
    for (; n >= 64; p += 64, n -= 64) compress(p);
    std::memcpy(buffer_, p, n);
    num_buffered_ = n;
  }

  // Integers are fed little-endian, so a key does not depend on the host's byte order.
  void update_u64(uint64_t v) {
    uint8_t b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(v >> (8 * i));
    update(b, 8);
  }
  void update_u32(uint32_t v) {
    uint8_t b[4];
    for (int i = 0; i < 4; ++i) b[i] = static_cast<uint8_t>(v >> (8 * i));
    update(b, 4);
  }

  BlockDigest finish() {
    const uint64_t num_bits = num_bytes_ * 8;
    const uint8_t pad = 0x80;
    update(&pad, 1);
    const uint8_t zero = 0;
    while (num_buffered_ != 56) update(&zero, 1);
    uint8_t length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(num_bits >> (56 - 8 * i));  // big-endian
    update(length, 8);
    BlockDigest out;
    for (int i = 0; i < 8; ++i) {
      for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<uint8_t>(state_[i] >> (24 - 8 * j));
    }
    reset();
    return out;
  }

 private:
  static uint32_t rotr(uint32_t x, int r) { return (x >> r) | (x << (32 - r)); }

  void compress(const uint8_t* block) {
    static constexpr uint32_t kRound[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
      w[i] = (uint32_t{block[4 * i]} << 24) | (uint32_t{block[4 * i + 1]} << 16) | (uint32_t{block[4 * i + 2]} << 8) |
             uint32_t{block[4 * i + 3]};
    }
    for (int i = 16; i < 64; ++i) {
      const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
    uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
    for (int i = 0; i < 64; ++i) {
      const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[i] + w[i];
      const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state_[0] += a;
    state_[1] += b;
    state_[2] += c;
    state_[3] += d;
    state_[4] += e;
    state_[5] += f;
    state_[6] += g;
    state_[7] += h;
  }

  uint32_t state_[8];
  uint64_t num_bytes_ = 0;
  uint8_t buffer_[64];
  size_t num_buffered_ = 0;
};

inline constexpr char kDigestDomain[] = "kvtool tier-3 block key v1";

// The parent key of a prompt's first block: the plan identity under kvtool's key domain, so the
// blocks of two plans (another model, dtype, block size or KV shape) never share a key.
inline BlockDigest root_digest(const BlockDigest& plan_digest) {
  Sha256 h;
  h.update(kDigestDomain, sizeof(kDigestDomain));  // with its terminating zero
  h.update(plan_digest.data(), plan_digest.size());
  return h.finish();
}

// The key of one full block below the block keyed parent: LoRA task id, cache salt, its token ids
// and, when any is non-zero, its extra ids (all-zero extra ids key as none, as block_key.h does).
inline BlockDigest block_digest(const BlockDigest& parent, const TokenId* token_ids, const ExtraId* extra_ids,
                                size_t num_tokens, uint64_t lora_task_id, uint64_t cache_salt) {
  Sha256 h;
  h.update(parent.data(), parent.size());
  h.update_u64(lora_task_id);
  h.update_u64(cache_salt);
  h.update_u32(static_cast<uint32_t>(num_tokens));
  for (size_t i = 0; i < num_tokens; ++i) h.update_u32(static_cast<uint32_t>(token_ids[i]));
  bool any = false;
  for (size_t i = 0; extra_ids != nullptr && i < num_tokens; ++i) any = any || extra_ids[i] != 0;
  const uint8_t flag = any ? 1 : 0;
  h.update(&flag, 1);
  for (size_t i = 0; any && i < num_tokens; ++i) h.update_u64(extra_ids[i]);
  return h.finish();
}

}  // namespace kvtool
