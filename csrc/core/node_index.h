// Hash index of prefix-tree nodes: an open-addressing table from a 64-bit key to the first node
// of a chain of nodes sharing that key (colliding keys chain through a caller-owned link array).
// Fixed capacity (at least twice the number of nodes), linear probing, backward-shift deletion:
// no tombstones, so lookups stay short however many nodes come and go.
#pragma once

#include <cstdint>
#include <vector>

#include "block_key.h"
#include "huge_page_allocator.h"

namespace kvtool {

using NodeId = int32_t;
inline constexpr NodeId kNoNode = -1;

class NodeIndex {
 public:
  explicit NodeIndex(size_t max_nodes) {
    size_t capacity = 16;
    while (capacity < 2 * max_nodes + 2) capacity *= 2;
    slots_.assign(capacity, Slot{});
    mask_ = capacity - 1;
  }

  // First node of the chain with this key, or kNoNode.
  NodeId head(uint64_t key) const {
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.head == kNoNode) return kNoNode;
      if (s.key == key) return s.head;
    }
  }

  // Starts loading key's home slot into the cache (lookups of many keys overlap their misses).
  void prefetch(uint64_t key) const { __builtin_prefetch(&slots_[home(key)]); }

  // Puts node at the front of key's chain. next[node] receives the previous head.
  void insert(uint64_t key, NodeId node, std::vector<NodeId>& next) {
    size_t i = home(key);
    for (;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.head == kNoNode) {
        s.key = key;
        s.head = node;
        next[node] = kNoNode;
        return;
      }
      if (s.key == key) {
        next[node] = s.head;
        s.head = node;
        return;
      }
    }
  }

  // Unlinks node from key's chain; frees the slot when the chain empties.
  void erase(uint64_t key, NodeId node, std::vector<NodeId>& next) {
    size_t i = home(key);
    for (;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.head == kNoNode) return;  // not indexed
      if (s.key == key) break;
    }
    Slot& s = slots_[i];
    if (s.head == node) {
      s.head = next[node];
    } else {
      for (NodeId n = s.head; n != kNoNode; n = next[n]) {
        if (next[n] == node) {
          next[n] = next[node];
          break;
        }
      }
    }
    next[node] = kNoNode;
    if (s.head == kNoNode) remove_slot(i);
  }

 private:
  struct Slot {
    uint64_t key = 0;
    NodeId head = kNoNode;
  };

  size_t home(uint64_t key) const { return static_cast<size_t>(mix64(key)) & mask_; }

  // Backward-shift deletion: moves later entries of the probe run into the hole.
  void remove_slot(size_t hole) {
    slots_[hole].head = kNoNode;
    for (size_t j = (hole + 1) & mask_; slots_[j].head != kNoNode; j = (j + 1) & mask_) {
      const size_t want = home(slots_[j].key);
      // Entry j may move into the hole when its home is not in the (hole, j] cyclic range.
      const bool home_in_range = (hole <= j) ? (hole < want && want <= j) : (hole < want || want <= j);
      if (!home_in_range) {
        slots_[hole] = slots_[j];
        slots_[j].head = kNoNode;
        hole = j;
      }
    }
  }

  std::vector<Slot, HugePageAllocator<Slot>> slots_;
  size_t mask_ = 0;
};

}  // namespace kvtool
