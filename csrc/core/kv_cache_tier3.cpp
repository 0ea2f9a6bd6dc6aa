// The third tier of KVCacheManager: looking up, staging and confirming blocks of the disk files or
// the remote store. Spilling into it is part of eviction (kv_cache_eviction.cpp).
//
// A block comes back from the third tier into the host tier, never straight into the primary pool:
// its bytes land in host memory anyway (a file read, a socket receive), so that copy is the whole
// fetch, and the host -> primary onboard then runs as for any host block (pinned, asynchronous,
// layer by layer on a GPU). And a fetch can fail (a remote store evicted the block, is down or
// slow, a value does not verify): staged into the host tier and confirmed before a request is
// admitted, a failed fetch is a miss, never a forward over KV that did not arrive. So does SGLang's
// HiCache (L3 -> L2 prefetch while the request waits); LMCache keeps what it retrieves in its CPU
// backend too. Rules: docs/architecture.md#kv-cache-rules
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kv_cache_manager_impl.h"

namespace kvtool {

namespace {
std::string str(int64_t v) { return std::to_string(v); }

void require_tier3(bool has_t3, const char* what) {
  if (!has_t3) {
    throw std::invalid_argument(std::string(what) +
                                ": the cache has no third tier; give num_tier3_blocks > 0 (with block reuse on)");
  }
}
}  // namespace

void KVCacheManager::Impl::check_no_staging(const char* what) const {
  if (!staging.empty()) {
    throw std::logic_error(std::string(what) + " while a staging is open: run its fetches (take_copy_ops) and "
                                               "call complete_staging first");
  }
}

KVCacheManager::Impl::Tier3Walk KVCacheManager::Impl::walk_tier3(const SequenceSpec& spec, size_t max_blocks) const {
  Tier3Walk w;
  const uint64_t identity = key_identity(spec.lora_task_id, spec.cache_salt);
  const TokenId* tokens = spec.token_ids.data();
  const ExtraId* extras = spec.extra_ids.empty() ? nullptr : spec.extra_ids.data();
  // As find_prefix: the block holding the last prompt token is never matched, so never staged.
  const size_t num_matchable = (spec.token_ids.size() - 1) / static_cast<size_t>(tpb);
  NodeId parent = root;
  size_t i = 0;
  for (; i < num_matchable; ++i) {
    extend_hashes(w.hashes, tokens, extras, identity, i + 1);
    const NodeId n = nodes[parent].num_children == 0
                         ? kNoNode
                         : find_child(parent, w.hashes[i], tokens + i * tpb, extras ? extras + i * tpb : nullptr,
                                      spec.lora_task_id, spec.cache_salt);
    if (n == kNoNode || !is_local(n)) break;
    w.local.push_back(n);
    parent = n;
  }
  BlockDigest key = digest_of(parent);
  for (; i < num_matchable && w.nodes.size() < max_blocks; ++i) {
    extend_hashes(w.hashes, tokens, extras, identity, i + 1);
    const TokenId* t = tokens + i * tpb;
    const ExtraId* e = extras ? extras + i * tpb : nullptr;
    // Below a block the tier does not hold, nothing is cached (a child lives where its parent
    // does or in a slower tier).
    const NodeId n = parent == kNoNode || nodes[parent].num_children == 0
                         ? kNoNode
                         : find_child(parent, w.hashes[i], t, e, spec.lora_task_id, spec.cache_salt);
    key = n != kNoNode ? node_digests[n] : block_digest(key, t, e, tpb, spec.lora_task_id, spec.cache_salt);
    w.nodes.push_back(n);
    w.keys.push_back(key);
    parent = n;
  }
  return w;
}

Tier3Lookup KVCacheManager::tier3_lookup(const SequenceSpec& spec) const {
  const Impl& m = *impl_;
  m.validate_spec(spec);
  require_tier3(m.has_t3, "tier3_lookup");
  Impl::Tier3Walk w = m.walk_tier3(spec, SIZE_MAX);
  Tier3Lookup out;
  out.num_local_blocks = static_cast<int32_t>(w.local.size());
  while (out.num_known_blocks < static_cast<int32_t>(w.nodes.size()) && w.nodes[out.num_known_blocks] != kNoNode) {
    ++out.num_known_blocks;
  }
  out.keys = std::move(w.keys);
  return out;
}

StageResult KVCacheManager::stage_tier3(const SequenceSpec& spec, int32_t num_present) {
  Impl& m = *impl_;
  m.validate_spec(spec);
  require_tier3(m.has_t3, "stage_tier3");
  m.check_no_staging("stage_tier3");
  if (num_present < 0) throw std::invalid_argument("num_present=" + str(num_present) + " is negative");
  // One block past what the store holds: a remote index entry there is gone from the store.
  Impl::Tier3Walk w = m.walk_tier3(spec, static_cast<size_t>(num_present) + 1);
  const size_t k = w.local.size();
  const size_t num_wanted = std::min(w.nodes.size(), static_cast<size_t>(num_present));
  // Acquiring host blocks spills host victims, and their slots may drop third-tier leaves: the
  // chain being staged, above and below, is pinned meanwhile.
  for (NodeId n : w.local) {
    if (m.nodes[n].pool == PoolKind::kSecondary) m.nodes[n].pinned = true;
  }
  for (size_t j = 0; j < num_wanted; ++j) {
    if (w.nodes[j] != kNoNode) m.nodes[w.nodes[j]].pinned = true;
  }
  // The index entry after the wanted blocks, to drop if the store lost it (remembered by
  // generation: the loop below may drop it, and its slot may be reused, while host blocks are had).
  const NodeId after = num_wanted < w.nodes.size() ? w.nodes[num_wanted] : kNoNode;
  const uint32_t after_generation = after == kNoNode ? 0 : m.nodes[after].generation;
  StageResult r;
  r.num_local_blocks = static_cast<int32_t>(k);
  NodeId parent = k == 0 ? m.root : w.local.back();
  size_t j = 0;
  for (; j < num_wanted; ++j) {
    NodeId n = w.nodes[j];
    if (n == kNoNode && m.t3 == PoolKind::kDisk) break;  // the manager's disk index is exact
    const BlockId host = m.acquire_secondary();
    if (host == kNoBlock) break;  // every host block is pinned: the rest stays where it is
    const size_t i = k + j;
    if (n == kNoNode) {
      // Another engine's block (or one this index forgot): keyed here from the prompt.
      const TokenId* t = spec.token_ids.data() + i * m.tpb;
      const ExtraId* e = spec.extra_ids.empty() ? nullptr : spec.extra_ids.data() + i * m.tpb;
      const int32_t priority = m.block_retention(spec.retention, spec.priority, static_cast<int64_t>(i)).priority;
      n = m.store_discovered_node(parent, w.hashes[i], t, e, spec, w.keys[j], host, priority);
      m.emit_tier3_copy(m.t3, kNoBlock, PoolKind::kSecondary, host, w.keys[j]);
      ++m.stats.tier3_traffic.discovered_blocks;
    } else {
      Impl::Node& x = m.nodes[n];
      const BlockId slot = x.block_id;
      m.emit_tier3_copy(m.t3, slot, PoolKind::kSecondary, host, w.keys[j]);
      m.lru_remove(n);
      m.tier3_node[slot] = kNoNode;
      m.tier3_fetched.push_back(slot);  // the fetch reads it: handed out after take_copy_ops
      --m.node_tier3[x.parent].num_tier3_children;
      x.pool = PoolKind::kSecondary;
      x.block_id = host;
      m.secondary_node[host] = n;
      m.lru_push(n);
    }
    m.tier_counters.fetch_tokens += m.tpb;
    m.nodes[n].pinned = true;  // until complete_staging: neither matched nor evicted
    m.node_tier3[n].staging = true;
    m.staging.push_back(Impl::StagedFetch{n, host});
    parent = n;
  }
  for (size_t rest = j; rest < num_wanted; ++rest) {
    if (w.nodes[rest] != kNoNode) m.nodes[w.nodes[rest]].pinned = false;
  }
  for (NodeId n : w.local) {
    if (m.nodes[n].pool == PoolKind::kSecondary) m.nodes[n].pinned = false;
  }
  r.num_staged_blocks = static_cast<int32_t>(m.staging.size());
  // Remote: the index holds the block after the ones the store has, but the store lost it (its
  // own eviction, another engine's write, a restart). Its subtree goes with it.
  if (m.t3 == PoolKind::kRemote && j == num_wanted && after != kNoNode && m.nodes[after].live &&
      m.nodes[after].generation == after_generation) {
    const int64_t evicted_before = m.stats.evicted_blocks;
    m.drop_tree(after, KeyHistory::kDroppedFromTier3);
    r.num_lost_blocks = static_cast<int32_t>(m.stats.evicted_blocks - evicted_before);
    m.stats.tier3_traffic.lost_blocks += r.num_lost_blocks;
  }
  return r;
}

void KVCacheManager::complete_staging(const std::vector<BlockId>& failed_host_blocks) {
  Impl& m = *impl_;
  size_t first_failed = m.staging.size();
  for (BlockId b : failed_host_blocks) {
    auto it = std::find_if(m.staging.begin(), m.staging.end(),
                           [b](const Impl::StagedFetch& f) { return f.host_block == b; });
    if (it == m.staging.end()) {
      throw std::invalid_argument("failed host block " + str(b) + " is not a fetch of the open staging");
    }
    first_failed = std::min(first_failed, static_cast<size_t>(it - m.staging.begin()));
  }
  for (size_t j = 0; j < m.staging.size(); ++j) {
    const NodeId n = m.staging[j].node;
    m.nodes[n].pinned = false;
    m.node_tier3[n].staging = false;
    if (j < first_failed) {
      m.node_tier3[n].from_tier3 = true;
      ++m.stats.tier3_traffic.staged_blocks;
    }
  }
  if (first_failed < m.staging.size()) {
    // The chain after a failed fetch has no parent to hang below: it goes too.
    m.stats.tier3_traffic.fetch_failed_blocks += static_cast<int64_t>(m.staging.size() - first_failed);
    m.drop_tree(m.staging[first_failed].node, KeyHistory::kFetchFailed);
  }
  m.staging.clear();
}

bool KVCacheManager::staging_open() const { return !impl_->staging.empty(); }

std::vector<BlockDigest> KVCacheManager::tier3_keys(const SequenceSpec& spec) const {
  const Impl& m = *impl_;
  m.validate_spec(spec);
  require_tier3(m.has_t3, "tier3_keys");
  std::vector<BlockDigest> keys;
  BlockDigest key = m.root_key;
  const ExtraId* extras = spec.extra_ids.empty() ? nullptr : spec.extra_ids.data();
  for (size_t i = 0; i < spec.token_ids.size() / static_cast<size_t>(m.tpb); ++i) {
    key = block_digest(key, spec.token_ids.data() + i * m.tpb, extras ? extras + i * m.tpb : nullptr, m.tpb,
                       spec.lora_task_id, spec.cache_salt);
    keys.push_back(key);
  }
  return keys;
}

}  // namespace kvtool
