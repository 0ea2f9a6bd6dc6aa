// Hash index of prefix-tree nodes: a multimap from a 64-bit key to node ids. The cache manager
// does a lookup, an insert or an erase per block it matches, stores or drops, at random places;
// std::unordered_multimap made the whole manager 2.5x slower (results/cache_manager.md).
// One cache line per bucket, so each touches a single line, which can be prefetched.
//
// A bucket holds 7 entries (32-bit tag of the key, node id) and an overflow count. An entry lives
// in its home bucket or, when that is full, in the next bucket with room; the overflow count of a
// bucket is the number of entries that live past it although their home is at or before it, so a
// lookup stops at the first bucket with none. No tombstones, no rehashing: the capacity is fixed
// at about twice the number of nodes.
#pragma once

#include <cstdint>
#include <vector>

namespace kvtool {

using NodeId = int32_t;
inline constexpr NodeId kNoNode = -1;

// Starts loading the cache line at p. The empty volatile asm keeps GCC from deleting a call to a
// helper made only of prefetches (it deems them free of side effects).
inline void prefetch_line(const void* p) {
  __builtin_prefetch(p);
  asm volatile("" : : "r"(p));
}
inline void prefetch_line_for_write(const void* p) {
  __builtin_prefetch(p, 1);
  asm volatile("" : : "r"(p));
}

class NodeIndex {
 public:
  explicit NodeIndex(size_t max_nodes) {
    size_t num_buckets = 2;
    while (num_buckets * kEntriesPerBucket < 2 * max_nodes + 2) num_buckets *= 2;
    buckets_.assign(num_buckets, Bucket{});
    mask_ = num_buckets - 1;
    shift_ = 64 - __builtin_ctzll(num_buckets);
  }

  // Calls visit(node) for each node indexed under key (and, rarely, one whose key shares the
  // 32-bit tag) until visit returns true; returns that node, or kNoNode.
  template <typename Visit>
  NodeId find(uint64_t key, Visit&& visit) const {
    const uint32_t tag = tag_of(key);
    for (size_t b = home(key);; b = (b + 1) & mask_) {
      const Bucket& bucket = buckets_[b];
      for (uint32_t hits = match_tags(bucket, tag); hits != 0; hits &= hits - 1) {
        const NodeId n = bucket.entries[__builtin_ctz(hits)].node;
        if (n != kNoNode && visit(n)) return n;
      }
      if (bucket.num_overflow == 0) return kNoNode;
    }
  }

  // Starts loading key's home bucket into the cache (many keys in flight overlap their misses).
  void prefetch_for_write(uint64_t key) const { prefetch_line_for_write(&buckets_[home(key)]); }

  void insert(uint64_t key, NodeId node) {
    for (size_t b = home(key);; b = (b + 1) & mask_) {
      Bucket& bucket = buckets_[b];
      const uint32_t free = match_nodes(bucket, kNoNode);
      if (free != 0) {
        Entry& e = bucket.entries[__builtin_ctz(free)];
        e.tag = tag_of(key);
        e.node = node;
        return;
      }
      ++bucket.num_overflow;  // full: the entry lives further on
    }
  }

  // Removes the entry of node under key (it must be there).
  void erase(uint64_t key, NodeId node) {
    const size_t start = home(key);
    for (size_t b = start;; b = (b + 1) & mask_) {
      const uint32_t hit = match_nodes(buckets_[b], node);
      if (hit != 0) {
        buckets_[b].entries[__builtin_ctz(hit)].node = kNoNode;
        for (size_t p = start; p != b; p = (p + 1) & mask_) --buckets_[p].num_overflow;
        return;
      }
      if (buckets_[b].num_overflow == 0) return;  // not indexed (a bug, but harmless here)
    }
  }

 private:
  static constexpr int kEntriesPerBucket = 7;
  struct Entry {
    uint32_t tag = 0;
    NodeId node = kNoNode;
  };
  struct alignas(64) Bucket {
    Entry entries[kEntriesPerBucket];
    uint32_t num_overflow = 0;
    uint32_t unused = 0;
  };
  static_assert(sizeof(Bucket) == 64, "a bucket is one cache line");

  // Keys are already hashes (block keys, partial keys): one multiply spreads them over the
  // buckets (its high bits), and the tag folds both halves.
  size_t home(uint64_t key) const { return static_cast<size_t>((key * 0x9E3779B97F4A7C15ULL) >> shift_); }
  static uint32_t tag_of(uint64_t key) { return static_cast<uint32_t>(key) ^ static_cast<uint32_t>(key >> 32); }

  // Bit k set when entry k's tag equals value (match_tags) or its node does (match_nodes).
  static uint32_t match_tags(const Bucket& bucket, uint32_t value) {
    uint32_t bits = 0;
    for (int k = 0; k < kEntriesPerBucket; ++k) bits |= static_cast<uint32_t>(bucket.entries[k].tag == value) << k;
    return bits;
  }
  static uint32_t match_nodes(const Bucket& bucket, NodeId value) {
    uint32_t bits = 0;
    for (int k = 0; k < kEntriesPerBucket; ++k) bits |= static_cast<uint32_t>(bucket.entries[k].node == value) << k;
    return bits;
  }

  std::vector<Bucket> buckets_;
  size_t mask_ = 0;
  int shift_ = 64;  // 64 - log2(number of buckets)
};

}  // namespace kvtool
