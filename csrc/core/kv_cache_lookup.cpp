// Prefix lookups of KVCacheManager: block keys of a prompt, the longest cached chain, the
// partial-reuse candidate and the blocks a new sequence would take.
#include <algorithm>

#include "kv_cache_manager_impl.h"

namespace kvtool {

#if KVTOOL_HASH_AVX2
// extend_hashes with the AVX2 form of the block hash (the same keys).
__attribute__((target("avx2"))) void KVCacheManager::Impl::extend_hashes_avx2(std::vector<uint64_t>& hashes,
                                                                              const TokenId* token_ids,
                                                                              const ExtraId* extra_ids,
                                                                              uint64_t identity, size_t end,
                                                                              bool prefetch) const {
  const size_t first = hashes.size();
  uint64_t parent_hash = first == 0 ? 0 : hashes.back();
  hashes.resize(end);
  for (size_t i = first; i < end; ++i) {
    const TokenId* t = token_ids + i * tpb;
    const ExtraId* e = extra_ids ? extra_ids + i * tpb : nullptr;
    const uint64_t h = block_key(parent_hash, block_content_hash_avx2(t, e, tpb), identity, key_hash_bits);
    if (prefetch) key_index.prefetch(h);
    hashes[i] = h;
    parent_hash = h;
  }
}
#endif

void KVCacheManager::Impl::extend_hashes(std::vector<uint64_t>& hashes, const TokenId* token_ids,
                                         const ExtraId* extra_ids, uint64_t identity, size_t end,
                                         bool prefetch) const {
#if KVTOOL_HASH_AVX2
  if (use_avx2) {
    extend_hashes_avx2(hashes, token_ids, extra_ids, identity, end, prefetch);
    return;
  }
#endif
  const size_t first = hashes.size();
  uint64_t parent_hash = first == 0 ? 0 : hashes.back();
  hashes.resize(end);
  for (size_t i = first; i < end; ++i) {
    const TokenId* t = token_ids + i * tpb;
    const ExtraId* e = extra_ids ? extra_ids + i * tpb : nullptr;
    const uint64_t h = block_key(parent_hash, block_content_hash(t, e, tpb), identity, key_hash_bits);
    if (prefetch) key_index.prefetch(h);
    hashes[i] = h;
    parent_hash = h;
  }
}

KVCacheManager::Impl::MatchPlan KVCacheManager::Impl::plan_match(const SequenceSpec& spec) const {
  MatchPlan plan;
  if (!config.enable_block_reuse) return plan;
  plan.identity = key_identity(spec.lora_task_id, spec.cache_salt);
  const TokenId* tokens = spec.token_ids.data();
  const ExtraId* extras = spec.extra_ids.empty() ? nullptr : spec.extra_ids.data();
  // The last prompt token is always computed, so a fully cached prompt still yields logits.
  const int64_t max_tokens = static_cast<int64_t>(spec.token_ids.size()) - 1;
  const size_t num_matchable = static_cast<size_t>(max_tokens / tpb);
  constexpr size_t kChunk = 8;  // blocks hashed (and prefetched) ahead of the lookups
  NodeId parent = root;
  size_t i = 0;
  for (; i < num_matchable; ++i) {
    if (i == plan.hashes.size()) {
      if (i == 0) plan.hashes.reserve(num_matchable);
      extend_hashes(plan.hashes, tokens, extras, plan.identity, std::min(num_matchable, i + kChunk),
                    /*prefetch=*/true);
    }
    const TokenId* t = tokens + i * tpb;
    const ExtraId* e = extras ? extras + i * tpb : nullptr;
    const uint64_t h = plan.hashes[i];
    if (nodes[parent].num_children == 0) break;  // nothing below it to match
    const NodeId n = find_child(parent, h, t, e, spec.lora_task_id, spec.cache_salt);
    if (n == kNoNode) break;
    if (plan.nodes.empty()) plan.nodes.reserve(num_matchable - i);  // one allocation for the chain
    plan.nodes.push_back(n);
    plan.last_hash = h;
    parent = n;
    const Node& x = nodes[n];
    if (x.pool == PoolKind::kSecondary) {
      ++plan.num_secondary;
    } else {
      if (is_held(n)) ++plan.num_held_primary;
      if (x.owner_running) ++plan.num_early;
    }
  }
  if (!config.enable_partial_reuse) return plan;
  const int64_t limit = std::min<int64_t>(tpb, max_tokens - i * tpb);
  if (limit <= 0) return plan;
  // Copy-on-write candidates: cached children of the last matched node that start like the
  // next block. The longest common prefix wins; on a tie the primary copy (no host read), then
  // a held one (pinning it costs nothing), then the most recently used.
  const TokenId* t = tokens + i * tpb;
  const ExtraId* e = extras ? extras + i * tpb : nullptr;
  const uint64_t key = partial_key(plan.last_hash, t[0], plan.identity);
  auto consider = [&](NodeId n) {
    const Node& x = nodes[n];
    if (x.parent != parent || x.partial_key != key || node_info[n].lora_task_id != spec.lora_task_id ||
        node_info[n].cache_salt != spec.cache_salt) {
      return false;
    }
    const TokenId* nt = node_tokens(n);
    const ExtraId* ne = node_extras(n);
    int32_t k = 0;
    while (k < limit && nt[k] == t[k] && (ne ? ne[k] : 0) == (e ? e[k] : 0)) ++k;
    if (k == 0 || k < plan.num_partial_tokens) return false;
    bool better = k > plan.num_partial_tokens;
    if (!better) {
      const Node& best = nodes[plan.partial_source];
      const bool primary = x.pool == PoolKind::kPrimary, best_primary = best.pool == PoolKind::kPrimary;
      const bool held = is_held(n), best_held = is_held(plan.partial_source);
      better = primary != best_primary ? primary
               : held != best_held     ? held
                                       : node_info[n].lru_stamp > node_info[plan.partial_source].lru_stamp;
    }
    if (better) {
      plan.num_partial_tokens = k;
      plan.partial_source = n;
    }
    return false;  // every candidate is compared
  };
  if (parent != root && nodes[parent].num_children == 1) {
    consider(nodes[parent].first_child);  // an only child need not be in partial_index
  } else if (nodes[parent].num_children > 0) {
    partial_index.find(key, consider);
  }
  if (plan.partial_source != kNoNode) {
    plan.partial_source_evictable =
        nodes[plan.partial_source].pool == PoolKind::kPrimary && !is_held(plan.partial_source);
  }
  return plan;
}

int32_t KVCacheManager::Impl::settle_blocks_to_add(MatchPlan& plan, int32_t num_tokens) const {
  const auto num_shared = static_cast<int32_t>(plan.nodes.size());
  // Held matched blocks are already out of num_available(); every other block comes out of it.
  auto needed = [&](bool with_partial) {
    return std::max(blocks_for(num_tokens), num_shared + (with_partial ? 1 : 0)) - plan.num_held_primary;
  };
  // A partial-copy source that is itself evictable is pinned while the blocks are taken, so it
  // cannot be one of them: the copy needs one spare block. Without it the tokens are computed
  // instead, so a request that fits the pool is never refused for the sake of a copy.
  if (plan.partial_source != kNoNode && plan.partial_source_evictable && needed(true) + 1 > num_available()) {
    plan.partial_source = kNoNode;
    plan.num_partial_tokens = 0;
    plan.partial_source_evictable = false;
  }
  return needed(plan.partial_source != kNoNode);
}

}  // namespace kvtool
