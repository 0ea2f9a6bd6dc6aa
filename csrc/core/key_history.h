// What the KV cache manager remembers about block keys it no longer caches, so that a missed
// prompt block can be told apart (docs/architecture.md#kv-cache-rules): a key's flags say from
// which pool its node was last dropped, and whether a node with these tokens but another
// identity (cache salt, LoRA task id, extra ids) was stored, under the tokens' plain key.
//
// Bounded, so that a long-running server does not grow: two generations of at most `capacity`
// keys. Writing a key that the newer generation lacks while it is full first forgets the older
// generation and makes the newer one the older, so a key is remembered for at least `capacity`
// writes of other keys after its own.
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
  static constexpr uint8_t kDropped = kDroppedFromPrimary | kDroppedFromHost;
  static constexpr uint8_t kStoredPlain = 4;         // the plain key of a node stored with another identity

  // capacity 0 remembers nothing (block reuse off: no node is ever stored).
  explicit KeyHistory(size_t capacity)
      : capacity_(capacity), num_slots_(capacity == 0 ? 0 : capacity + capacity / 3 + 1) {
    recent_.assign(num_slots_, 0);
    older_.assign(num_slots_, 0);
    pending_.reserve(kMaxPending);
  }

  // The key's flags, 0 when nothing is remembered: the drop bits of the newer generation that has
  // any (the last drop), kStoredPlain of either. Reads applied updates only: flush() first.
  uint8_t flags(uint64_t key) const {
    if (capacity_ == 0) return 0;
    const uint8_t newer = recent_[slot_of(recent_, key)] & kFlagMask;
    const uint8_t older = older_[slot_of(older_, key)] & kFlagMask;
    const uint8_t dropped = (newer & kDropped) != 0 ? newer & kDropped : older & kDropped;
    return static_cast<uint8_t>(dropped | ((newer | older) & kStoredPlain));
  }

  // The key's flags lose the `clear` bits and gain the `set` bits (set != 0), in the newer
  // generation. Queued: flush() applies the queue in order.
  void update(uint64_t key, uint8_t clear, uint8_t set) {
    if (capacity_ == 0) return;
    pending_.push_back(Update{key, clear, set});
    if (pending_.size() == kMaxPending) flush();
  }

  // Drops write at random places of a table of megabytes, one cache miss each. Queued, their lines
  // are requested all at once and then written, so the misses overlap: written one at a time, with
  // or without a prefetch from the eviction scout, they cost the manager 9-12% more per request
  // instead of 3-5% (results/cache_manager.md).
  void flush() {
    for (const Update& u : pending_) prefetch_line_for_write(&recent_[home(u.key)]);
    for (const Update& u : pending_) apply(u);
    pending_.clear();
  }

 private:
  struct Update {
    uint64_t key;
    uint8_t clear;
    uint8_t set;
  };
  static constexpr size_t kMaxPending = 64;  // 32 or 256 were slower

  // A slot is (key << 3) | flags, 0 when empty: 8 bytes, so the tables stay small. A key loses its
  // top 3 bits, so two full 64-bit keys share a slot with a chance of 2^-61.
  static constexpr int kFlagBits = 3;
  static constexpr uint64_t kFlagMask = (1u << kFlagBits) - 1;

  // A table has a third more slots than it takes keys (at most 3/4 full); any number of slots:
  // the home is the high word of the mixed key times their number.
  size_t home(uint64_t key) const {
    return static_cast<size_t>((static_cast<__uint128_t>(key * 0x9E3779B97F4A7C15ULL) * num_slots_) >> 64);
  }

  // The key's slot, or the empty slot where it would go (linear probing; a table is never full).
  size_t slot_of(const std::vector<uint64_t>& table, uint64_t key) const {
    const uint64_t tagged = key << kFlagBits;
    for (size_t s = home(key);; s = s + 1 == num_slots_ ? 0 : s + 1) {
      if (table[s] == 0 || (table[s] & ~kFlagMask) == tagged) return s;
    }
  }

  void apply(const Update& u) {
    size_t s = slot_of(recent_, u.key);
    if (recent_[s] == 0) {
      if (recent_size_ == capacity_) {  // full: the older generation is forgotten
        std::swap(recent_, older_);
        std::fill(recent_.begin(), recent_.end(), 0);
        recent_size_ = 0;
        s = slot_of(recent_, u.key);
      }
      ++recent_size_;
    }
    recent_[s] = (u.key << kFlagBits) | (((recent_[s] & kFlagMask) & ~u.clear) | u.set);
  }

  size_t capacity_ = 0;   // keys per generation
  size_t num_slots_ = 0;  // per table
  size_t recent_size_ = 0;
  std::vector<uint64_t> recent_;
  std::vector<uint64_t> older_;
  std::vector<Update> pending_;
};

}  // namespace kvtool
