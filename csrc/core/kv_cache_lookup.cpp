// Prefix lookups of KVCacheManager: block keys of a prompt, the longest cached chain, the
// partial-reuse candidate and the blocks a new sequence would take.
#include <algorithm>

#include "kv_cache_manager_impl.h"

namespace kvtool {

void KVCacheManager::Impl::extend_hashes(std::vector<uint64_t>& hashes, const TokenId* token_ids,
                                         const ExtraId* extra_ids, uint64_t identity, size_t end) const {
  const size_t first = hashes.size();
  uint64_t parent_hash = first == 0 ? 0 : hashes.back();
  hashes.resize(end);
  for (size_t i = first; i < end; ++i) {
    const TokenId* t = token_ids + i * tpb;
    const ExtraId* e = extra_ids ? extra_ids + i * tpb : nullptr;
    parent_hash = hashes[i] = block_key(parent_hash, block_content_hash(t, e, tpb), identity, key_hash_bits);
  }
}

KVCacheManager::Impl::PrefixMatch KVCacheManager::Impl::find_prefix(const SequenceSpec& spec) const {
  PrefixMatch match;
  if (!config.enable_block_reuse) return match;
  match.identity = key_identity(spec.lora_task_id, spec.cache_salt);
  const TokenId* tokens = spec.token_ids.data();
  const ExtraId* extras = spec.extra_ids.empty() ? nullptr : spec.extra_ids.data();
  // The last prompt token is always computed, so a fully cached prompt still yields logits.
  const int64_t max_tokens = static_cast<int64_t>(spec.token_ids.size()) - 1;
  const size_t num_matchable = static_cast<size_t>(max_tokens / tpb);
  match.hashes.reserve(num_matchable);
  NodeId parent = root;
  size_t i = 0;
  for (; i < num_matchable; ++i) {
    if (nodes[parent].num_children == 0) break;  // nothing below it to match
    extend_hashes(match.hashes, tokens, extras, match.identity, i + 1);
    const TokenId* t = tokens + i * tpb;
    const ExtraId* e = extras ? extras + i * tpb : nullptr;
    const uint64_t h = match.hashes[i];
    const NodeId n = find_child(parent, h, t, e, spec.lora_task_id, spec.cache_salt);
    // A third-tier block is shared only once staged into the host tier (kv_cache_tier3.cpp).
    if (n == kNoNode || (has_t3 && !is_local(n))) break;
    if (match.nodes.empty()) match.nodes.reserve(num_matchable - i);  // one allocation for the chain
    match.nodes.push_back(n);
    match.last_hash = h;
    parent = n;
    const Node& x = nodes[n];
    if (x.pool == PoolKind::kSecondary) {
      ++match.num_secondary;
    } else {
      if (is_held(n)) ++match.num_held_primary;
      if (x.owner_running) ++match.num_early;
    }
  }
  if (!config.enable_partial_reuse) return match;
  const int64_t limit = std::min<int64_t>(tpb, max_tokens - i * tpb);
  if (limit <= 0) return match;
  // Copy-on-write candidates: cached children of the last matched node that start like the
  // next block. The longest common prefix wins; on a tie the primary copy (no host read), then
  // a held one (pinning it costs nothing), then the most recently used.
  const TokenId* t = tokens + i * tpb;
  const ExtraId* e = extras ? extras + i * tpb : nullptr;
  const uint64_t key = partial_key(match.last_hash, t[0], match.identity);
  auto consider = [&](NodeId n) {
    const Node& x = nodes[n];
    if (x.parent != parent || x.partial_key != key || x.lora_task_id != spec.lora_task_id ||
        x.cache_salt != spec.cache_salt || (has_t3 && !is_local(n))) {
      return false;
    }
    const TokenId* nt = node_tokens(n);
    const ExtraId* ne = node_extras(n);
    int32_t k = 0;
    while (k < limit && nt[k] == t[k] && (ne ? ne[k] : 0) == (e ? e[k] : 0)) ++k;
    if (k == 0 || k < match.num_partial_tokens) return false;
    bool better = k > match.num_partial_tokens;
    if (!better) {
      const Node& best = nodes[match.partial_source];
      const bool primary = x.pool == PoolKind::kPrimary, best_primary = best.pool == PoolKind::kPrimary;
      const bool held = is_held(n), best_held = is_held(match.partial_source);
      better = primary != best_primary ? primary
               : held != best_held     ? held
                                       : x.lru_stamp > best.lru_stamp;
    }
    if (better) {
      match.num_partial_tokens = k;
      match.partial_source = n;
    }
    return false;  // every candidate is compared
  };
  if (parent != root && nodes[parent].num_children == 1) {
    consider(nodes[parent].first_child);  // an only child need not be in partial_index
  } else if (nodes[parent].num_children > 0) {
    partial_index.find(key, consider);
  }
  if (match.partial_source != kNoNode) {
    match.partial_source_evictable =
        nodes[match.partial_source].pool == PoolKind::kPrimary && !is_held(match.partial_source);
  }
  return match;
}

MissReasons KVCacheManager::Impl::classify_misses(const SequenceSpec& spec, PrefixMatch& match) const {
  MissReasons missed;
  const size_t num_prompt_blocks = spec.token_ids.size() / tpb;
  size_t i = match.nodes.size();
  if (i >= num_prompt_blocks) return missed;
  if (!config.enable_block_reuse) {
    missed.reuse_off = static_cast<int64_t>(num_prompt_blocks - i);
    return missed;
  }
  const TokenId* tokens = spec.token_ids.data();
  const ExtraId* extras = spec.extra_ids.empty() ? nullptr : spec.extra_ids.data();
  const bool plain_differs = plain_keys_differ(match.identity, any_extra(extras, spec.extra_ids.size()));
  auto hash_up_to = [&](size_t end) {
    if (match.hashes.size() < end) extend_hashes(match.hashes, tokens, extras, match.identity, end);
    if (plain_differs && match.plain_hashes.size() < end) {
      extend_hashes(match.plain_hashes, tokens, nullptr, kPlainIdentity, end);
    }
  };
  // The block right after the shared chain. find_prefix shares every cached block but one that
  // holds the last prompt token: the last block of a prompt of whole blocks. Cached, that one
  // counts as last_token even when a partial copy took its first tokens.
  hash_up_to(i + 1);
  const NodeId parent = match.nodes.empty() ? root : match.nodes.back();
  const bool holds_last_token = i + 1 == num_prompt_blocks && spec.token_ids.size() % tpb == 0;
  if (holds_last_token && nodes[parent].num_children > 0 &&
      find_child(parent, match.hashes[i], tokens + i * tpb, extras ? extras + i * tpb : nullptr, spec.lora_task_id,
                 spec.cache_salt) != kNoNode) {
    ++missed.last_token;
    ++i;
  } else if (match.partial_source != kNoNode) {
    ++missed.partial;
    ++i;
  }
  // The other blocks are not cached (find_prefix would have shared the first, and the parent of
  // each later one is not cached): what became of their keys. Keys chain, so once a block was
  // never seen, neither were the ones after it.
  for (; i < num_prompt_blocks; ++i) {
    hash_up_to(i + 1);
    const uint64_t key = match.hashes[i];
    // Cached in the third tier, but not staged into the host tier before the request came.
    if (has_t3 && key_index.find(key, [&](NodeId n) { return nodes[n].hash == key && !is_local(n); }) != kNoNode) {
      ++missed.not_staged;
      continue;
    }
    const uint8_t flags = key_history.flags(key);
    if ((flags & KeyHistory::kDroppedFromPrimary) != 0) {
      ++missed.evicted_primary;
      continue;
    }
    if ((flags & KeyHistory::kDroppedFromHost) != 0) {
      ++missed.evicted_host;
      continue;
    }
    if ((flags & KeyHistory::kDroppedFromTier3) != 0) {
      ++(t3 == PoolKind::kDisk ? missed.evicted_disk : missed.evicted_remote);
      continue;
    }
    if ((flags & KeyHistory::kFetchFailed) != 0) {
      ++missed.fetch_failed;
      continue;
    }
    // The plain key was stored: by a node of another identity (kStoredPlain), or by a plain node
    // that is cached or was dropped. A plain prompt's own key is its plain key.
    const uint64_t plain = plain_differs ? match.plain_hashes[i] : key;
    bool seen = (flags & KeyHistory::kStoredPlain) != 0;
    if (!seen && plain != key) {
      seen = key_history.flags(plain) != 0 ||
             key_index.find(plain, [&](NodeId n) { return nodes[n].hash == plain; }) != kNoNode;
    }
    if (!seen) {
      missed.never_seen += static_cast<int64_t>(num_prompt_blocks - i);
      break;
    }
    ++missed.identity;
  }
  return missed;
}

int32_t KVCacheManager::Impl::settle_blocks_to_add(PrefixMatch& match, int32_t num_tokens) const {
  const auto num_shared = static_cast<int32_t>(match.nodes.size());
  // Held matched blocks are already out of num_available(); every other block comes out of it.
  auto needed = [&](bool with_partial) {
    return std::max(blocks_for(num_tokens), num_shared + (with_partial ? 1 : 0)) - match.num_held_primary;
  };
  // A partial-copy source that is itself evictable is pinned while the blocks are taken, so it
  // cannot be one of them: the copy needs one spare block. Without it the tokens are computed
  // instead, so a request that fits the pool is never refused for the sake of a copy.
  if (match.partial_source != kNoNode && match.partial_source_evictable && needed(true) + 1 > num_available()) {
    match.partial_source = kNoNode;
    match.num_partial_tokens = 0;
    match.partial_source_evictable = false;
  }
  return needed(match.partial_source != kNoNode);
}

}  // namespace kvtool
