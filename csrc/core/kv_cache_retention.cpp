// Retention by token range (TensorRT-LLM's KvCacheRetentionConfig): which priority a block gets,
// and its reverting to kDefaultPriority once its duration has run out on the manager's clock.
// Rules: docs/architecture.md#kv-cache-rules
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kv_cache_manager_impl.h"

namespace kvtool {

namespace {
std::string str(int64_t v) { return std::to_string(v); }
}  // namespace

void validate_retention(const std::vector<RetentionRange>& ranges) {
  for (size_t i = 0; i < ranges.size(); ++i) {
    const RetentionRange& r = ranges[i];
    const std::string name = "retention range " + str(static_cast<int64_t>(i)) + " (tokens " + str(r.token_start) +
                             ".." + (r.token_end < 0 ? std::string("end") : str(r.token_end)) + ")";
    if (r.token_start < 0) throw std::invalid_argument(name + ": token_start is negative; tokens count from 0");
    if (r.token_end >= 0 && r.token_end <= r.token_start) {
      throw std::invalid_argument(name + ": token_end must be past token_start (or None: to the end)");
    }
    if (r.priority < 0 || r.priority > 100) {
      throw std::invalid_argument(name + ": priority=" + str(r.priority) + " is outside 0..100");
    }
    if (r.duration_ms != -1 && r.duration_ms <= 0) {
      throw std::invalid_argument(name + ": duration_ms=" + str(r.duration_ms) +
                                  " must be positive (or None: the priority never reverts)");
    }
    if (i > 0) {
      const RetentionRange& before = ranges[i - 1];
      if (before.token_end < 0 || r.token_start < before.token_end) {
        throw std::invalid_argument(name + " overlaps or precedes the range before it: give ranges sorted by "
                                           "token_start, each ending before the next starts");
      }
    }
  }
}

// The clock of a priority with a duration starts when its block is released (as TensorRT-LLM's
// eviction policy does on each release); a sequence referencing it again stops it.
void KVCacheManager::Impl::start_retention_clock(NodeId n) {
  NodeClock& c = node_clock[n];
  if (c.duration_ms < 0 || nodes[n].priority == kDefaultPriority) return;
  c.expires_at_ms = c.duration_ms > kNever - now_ms ? kNever : now_ms + c.duration_ms;
  if (c.expires_at_ms == kNever) return;
  // Stale entries (a node referenced again, released again, dropped) are skipped when popped; the
  // heap is rebuilt from the live nodes before they outnumber them.
  if (expiry_heap.size() > 2 * nodes.size() + 64) {
    expiry_heap.clear();
    for (NodeId m = 0; m < static_cast<NodeId>(nodes.size()); ++m) {
      if (m != n && nodes[m].live && node_clock[m].expires_at_ms != kNever) {
        expiry_heap.push_back(Expiry{node_clock[m].expires_at_ms, m, nodes[m].generation});
      }
    }
    std::make_heap(expiry_heap.begin(), expiry_heap.end(), [](const Expiry& a, const Expiry& b) {
      return a.expires_at_ms > b.expires_at_ms;
    });
  }
  expiry_heap.push_back(Expiry{c.expires_at_ms, n, nodes[n].generation});
  std::push_heap(expiry_heap.begin(), expiry_heap.end(),
                 [](const Expiry& a, const Expiry& b) { return a.expires_at_ms > b.expires_at_ms; });
}

// Every priority due by now_ms reverts to the default; an unreferenced block moves to the end of
// the default priority's LRU list, as if used now. Blocks due together move in the order they
// were due, then least recently used first.
void KVCacheManager::Impl::expire_retention() {
  const auto later = [](const Expiry& a, const Expiry& b) { return a.expires_at_ms > b.expires_at_ms; };
  std::vector<NodeId> due;
  while (!expiry_heap.empty() && expiry_heap.front().expires_at_ms <= now_ms) {
    std::pop_heap(expiry_heap.begin(), expiry_heap.end(), later);
    const Expiry e = expiry_heap.back();
    expiry_heap.pop_back();
    const Node& x = nodes[e.node];
    if (x.live && x.generation == e.generation && node_clock[e.node].expires_at_ms == e.expires_at_ms) {
      due.push_back(e.node);
    }
  }
  std::sort(due.begin(), due.end(), [&](NodeId a, NodeId b) {
    const int64_t ta = node_clock[a].expires_at_ms, tb = node_clock[b].expires_at_ms;
    return ta != tb ? ta < tb : nodes[a].lru_stamp < nodes[b].lru_stamp;
  });
  for (NodeId n : due) {
    Node& x = nodes[n];
    if (node_clock[n].expires_at_ms == kNever) continue;  // a duplicate entry, applied already
    const bool listed = x.in_lru;
    if (listed) lru_remove(n);
    x.priority = static_cast<uint8_t>(kDefaultPriority);
    node_clock[n] = NodeClock{};
    if (listed) lru_push(n);
  }
}

void KVCacheManager::set_time(int64_t now_ms) {
  Impl& m = *impl_;
  if (now_ms < m.now_ms) {
    throw std::invalid_argument("now_ms=" + str(now_ms) + " is before the manager's time " + str(m.now_ms) +
                                ": the clock never goes back");
  }
  m.now_ms = now_ms;
  m.expire_retention();
}

int64_t KVCacheManager::time() const { return impl_->now_ms; }

}  // namespace kvtool
