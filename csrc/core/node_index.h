// Hash index of prefix-tree nodes: a multimap from a 64-bit key to node ids, one cache line per
// bucket so that a lookup, an insert and an erase each touch a single line (the cache manager
// does one of each per block it stores or drops, at random places: these are its cache misses).
//
// A bucket holds 7 entries (32-bit tag from the key's mixed hash, node id) and an overflow count.
// An entry lives in its home bucket or, when that is full, in the next bucket with room; the
// overflow count of a bucket is the number of entries that live past it although their home is
// at or before it, so a lookup stops at the first bucket with none. No tombstones, no rehashing:
// the capacity is fixed at about twice the number of nodes (buckets are rarely full).
#pragma once

#include <cstdint>
#include <vector>

#include "block_key.h"
#include "huge_page_allocator.h"

namespace kvtool {

using NodeId = int32_t;
inline constexpr NodeId kNoNode = -1;

// Starts loading the cache line at p. GCC deems __builtin_prefetch free of side effects, so a
// helper (or lambda) made only of prefetches counts as a pure function, and calls to it whose
// result is unused are deleted: the empty volatile asm keeps every prefetch in the program.
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
    size_t num_buckets = 1;
    while (num_buckets * kEntriesPerBucket < 2 * max_nodes + 2) num_buckets *= 2;
    buckets_.assign(num_buckets, Bucket{});
    mask_ = num_buckets - 1;
  }

  // Calls visit(node) for each node indexed under key (and, rarely, one whose key shares the
  // 32-bit tag) until visit returns true; returns that node, or kNoNode.
  template <typename Visit>
  NodeId find(uint64_t key, Visit&& visit) const {
    const uint64_t h = mix64(key);
    const uint32_t tag = tag_of(h);
    for (size_t b = h & mask_;; b = (b + 1) & mask_) {
      const Bucket& bucket = buckets_[b];
      for (const Entry& e : bucket.entries) {
        if (e.tag == tag && e.node != kNoNode && visit(e.node)) return e.node;
      }
      if (bucket.num_overflow == 0) return kNoNode;
    }
  }

  // Starts loading key's home bucket into the cache (many keys in flight overlap their misses).
  void prefetch(uint64_t key) const { prefetch_line(&buckets_[mix64(key) & mask_]); }
  void prefetch_for_write(uint64_t key) const { prefetch_line_for_write(&buckets_[mix64(key) & mask_]); }

  void insert(uint64_t key, NodeId node) {
    const uint64_t h = mix64(key);
    for (size_t b = h & mask_;; b = (b + 1) & mask_) {
      Bucket& bucket = buckets_[b];
      for (Entry& e : bucket.entries) {
        if (e.node == kNoNode) {
          e.tag = tag_of(h);
          e.node = node;
          return;
        }
      }
      ++bucket.num_overflow;  // full: the entry lives further on
    }
  }

  // Removes the entry of node under key (it must be there).
  void erase(uint64_t key, NodeId node) {
    const uint64_t h = mix64(key);
    const size_t home = h & mask_;
    for (size_t b = home;; b = (b + 1) & mask_) {
      for (Entry& e : buckets_[b].entries) {
        if (e.node == node) {
          e.node = kNoNode;
          for (size_t p = home; p != b; p = (p + 1) & mask_) --buckets_[p].num_overflow;
          return;
        }
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

  static uint32_t tag_of(uint64_t h) { return static_cast<uint32_t>(h >> 32); }

  std::vector<Bucket, HugePageAllocator<Bucket>> buckets_;
  size_t mask_ = 0;
};

}  // namespace kvtool
