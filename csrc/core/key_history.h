// What the KV cache manager remembers about block keys it no longer caches, so that a missed
// prompt block can be told apart (docs/architecture.md#kv-cache-rules): a key's flags say from
// which pool its node was last dropped, and whether a node with these tokens but another
// identity (cache salt, LoRA task id, extra ids) was stored, under the tokens' plain key.
//
// Bounded, so that a long-running server does not grow: two generations of at most `capacity`
// keys. Writing a key that the newer generation lacks while it is full first forgets the older
// generation and makes the newer one the older, so a key is remembered for at least `capacity`
// writes of other keys after its own.
//
// Every drop writes one line at a random place of a table of megabytes, and the manager's other
// work is bound by such misses too: once the pools are full this costs about 17% per 2,048-token
// request on bench/cache_manager.py (8% on its median over the whole trace), of which classifying
// is about 2%. results/cache_manager.md has the variants measured (slot size, batching, capacity).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "node_index.h"

namespace kvtool {

class KeyHistory {
 public:
  static constexpr uint8_t kDroppedFromPrimary = 1;  // last dropped from the primary pool
  static constexpr uint8_t kDroppedFromHost = 2;     // last dropped from the secondary (host) pool
  static constexpr uint8_t kStoredPlain = 4;         // the plain key of a node stored with another identity
  static constexpr uint8_t kDroppedFromTier3 = 8;    // last dropped from the third tier (or gone from the store)
  static constexpr uint8_t kFetchFailed = 16;        // last dropped because staging it from the third tier failed
  static constexpr uint8_t kDropped = kDroppedFromPrimary | kDroppedFromHost | kDroppedFromTier3 | kFetchFailed;

  // capacity 0 remembers nothing (block reuse off: no node is ever stored).
  explicit KeyHistory(size_t capacity) : capacity_(capacity) {
    if (capacity_ == 0) return;
    size_t num_slots = 2;
    while (num_slots < 2 * capacity_) num_slots *= 2;
    mask_ = num_slots - 1;
    shift_ = 64 - __builtin_ctzll(num_slots);
    recent_.assign(num_slots, 0);
    older_.assign(num_slots, 0);
  }

  // The key's flags, 0 when nothing is remembered: the drop bits of the newer generation that has
  // any (the last drop), kStoredPlain of either. Reads applied updates only: flush() first.
  uint8_t flags(uint64_t key) const {
    if (capacity_ == 0) return 0;
    const uint64_t tag = key << kFlagBits;
    const uint8_t newer = recent_[slot_of(recent_, tag)] & kFlagMask;
    const uint8_t older = older_[slot_of(older_, tag)] & kFlagMask;
    const uint8_t dropped = (newer & kDropped) != 0 ? newer & kDropped : older & kDropped;
    return static_cast<uint8_t>(dropped | ((newer | older) & kStoredPlain));
  }

  // The key gains flag `set` in the newer generation; a drop bit replaces the other one. Queued:
  // flush() applies the queue in order.
  void update(uint64_t key, uint8_t set) {
    if (capacity_ == 0) return;
    pending_[num_pending_++] = (key << kFlagBits) | set;
    if (num_pending_ == kMaxPending) flush();
  }

  // The queued updates' lines are requested all at once and then written, so the misses overlap:
  // written one at a time (prefetched by the eviction scout) they cost more over the whole trace.
  void flush() {
    for (size_t i = 0; i < num_pending_; ++i) prefetch_line_for_write(&recent_[home(pending_[i])]);
    for (size_t i = 0; i < num_pending_; ++i) apply(pending_[i]);
    num_pending_ = 0;
  }

 private:
  // A slot, and a queued update, is (key << 5) | flags; a slot is 0 when empty. A key loses its
  // top 5 bits, so two full 64-bit keys share a slot with a chance of 2^-59.
  static constexpr int kFlagBits = 5;
  static constexpr uint64_t kFlagMask = (1u << kFlagBits) - 1;
  static constexpr size_t kMaxPending = 64;  // 16 or 256 were slower

  // The bits of a tagged key above its flags, spread by one multiply (its high bits are the home).
  size_t home(uint64_t tagged) const {
    return static_cast<size_t>(((tagged & ~kFlagMask) * 0x9E3779B97F4A7C15ULL) >> shift_);
  }

  // The slot of the tagged key, or the empty slot where it would go (linear probing; a table is
  // at most half full).
  size_t slot_of(const std::vector<uint64_t>& table, uint64_t tag) const {
    size_t s = home(tag);
    while (table[s] != 0 && (table[s] & ~kFlagMask) != tag) s = (s + 1) & mask_;
    return s;
  }

  void apply(uint64_t update) {
    const uint64_t tag = update & ~kFlagMask;
    const auto set = static_cast<uint8_t>(update & kFlagMask);
    size_t s = slot_of(recent_, tag);
    if (recent_[s] == 0) {
      if (recent_size_ == capacity_) {  // full: the older generation is forgotten
        std::swap(recent_, older_);
        std::fill(recent_.begin(), recent_.end(), 0);
        recent_size_ = 0;
        s = slot_of(recent_, tag);
      }
      ++recent_size_;
    }
    const uint64_t kept = recent_[s] & ((set & kDropped) != 0 ? kStoredPlain : kFlagMask);
    recent_[s] = tag | kept | set;
  }

  size_t capacity_ = 0;  // keys per generation
  size_t mask_ = 0;      // slots per table - 1
  int shift_ = 64;       // 64 - log2(slots per table)
  size_t recent_size_ = 0;
  std::vector<uint64_t> recent_;
  std::vector<uint64_t> older_;
  uint64_t pending_[kMaxPending] = {};
  size_t num_pending_ = 0;
};

}  // namespace kvtool
