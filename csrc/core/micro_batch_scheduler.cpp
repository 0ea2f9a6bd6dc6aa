// The micro-batch scheduler: which running requests compute in this step, and how much, within
// max_batch_size and max_num_tokens. Generation requests go first (one token each: cheap and
// latency-sensitive); context chunks fill the rest, each ending on a block boundary unless it ends
// the context (ContextChunkingPolicy decides which context advances first).
#include <algorithm>
#include <vector>

#include "scheduler_impl.h"

namespace kvtool {

namespace {

// The largest chunk from position `begin` of a context ending at `end` that fits in `budget`
// tokens and ends on a block boundary unless it ends the context.
int32_t aligned_chunk(int32_t begin, int32_t end, int32_t budget, int32_t tokens_per_block) {
  if (end - begin <= budget) return end - begin;
  const int32_t chunk_end = (begin + budget) / tokens_per_block * tokens_per_block;
  return std::max(0, chunk_end - begin);
}

}  // namespace

void Scheduler::Impl::form_micro_batch(ScheduledBatch& batch) const {
  int32_t num_free_slots = config.max_batch_size;
  int32_t num_free_tokens = config.max_num_tokens;

  std::vector<ScheduledRequest> generation;
  std::vector<const Request*> contexts;  // in start order
  for (int64_t request_id : running) {
    const Request& r = record(request_id);
    if (r.state == RequestState::kContext) {
      contexts.push_back(&r);
    } else if (r.state == RequestState::kGeneration && num_free_slots > 0 && num_free_tokens > 0) {
      generation.push_back(generation_token(r));
      num_free_slots -= 1;
      num_free_tokens -= 1;
    }
  }

  std::vector<int32_t> chunk_sizes(contexts.size(), 0);
  const size_t num_candidates = std::min(contexts.size(), static_cast<size_t>(num_free_slots));
  if (config.enable_chunked_context && config.context_chunking_policy == ContextChunkingPolicy::kEqualProgress) {
    // Round robin, one block (or the context's final piece) per context per round.
    bool advanced = true;
    while (advanced && num_free_tokens > 0) {
      advanced = false;
      for (size_t i = 0; i < num_candidates; ++i) {
        const Request& r = *contexts[i];
        const int32_t begin = r.num_computed_tokens + chunk_sizes[i];
        if (begin >= r.num_context_tokens) continue;
        const int32_t next_boundary = (begin / tokens_per_block + 1) * tokens_per_block;
        const int32_t step = std::min(next_boundary, r.num_context_tokens) - begin;
        if (step > num_free_tokens) continue;
        chunk_sizes[i] += step;
        num_free_tokens -= step;
        advanced = true;
      }
    }
  } else {
    for (size_t i = 0; i < num_candidates; ++i) {
      const Request& r = *contexts[i];
      const int32_t num_remaining = r.num_context_tokens - r.num_computed_tokens;
      int32_t chunk = 0;
      if (num_remaining <= num_free_tokens) {
        chunk = num_remaining;
      } else if (config.enable_chunked_context) {
        chunk = aligned_chunk(r.num_computed_tokens, r.num_context_tokens, num_free_tokens, tokens_per_block);
      } else if (num_remaining > config.max_num_tokens) {
        // Only a resumed request (prompt + generated tokens) can outgrow max_num_tokens without
        // chunked context: recompute it in chunks, or it could never run again.
        chunk = aligned_chunk(r.num_computed_tokens, r.num_context_tokens, num_free_tokens, tokens_per_block);
        if (chunk == 0 && num_free_tokens == config.max_num_tokens) chunk = num_free_tokens;
      } else {
        break;  // without chunking, a context that does not fit waits, and so do the ones behind it
      }
      chunk_sizes[i] = chunk;
      num_free_tokens -= chunk;
    }
  }

  for (size_t i = 0; i < contexts.size(); ++i) {
    if (chunk_sizes[i] > 0) batch.requests.push_back(context_chunk(*contexts[i], chunk_sizes[i]));
  }
  for (ScheduledRequest& sr : generation) batch.requests.push_back(std::move(sr));
}

ScheduledRequest Scheduler::Impl::context_chunk(const Request& r, int32_t num_new_tokens) const {
  ScheduledRequest sr;
  sr.request_id = r.request_id;
  sr.is_context = true;
  sr.num_cached_tokens = r.num_computed_tokens;
  const int32_t end = r.num_computed_tokens + num_new_tokens;
  // The context covers the prompt, then (for a resumed request) the tokens generated before the pause.
  sr.token_ids.reserve(num_new_tokens);
  for (int32_t pos = r.num_computed_tokens; pos < end; ++pos) sr.token_ids.push_back(r.token_at(pos));
  std::vector<BlockId> block_ids = cache_manager.block_ids(r.request_id);
  block_ids.resize(std::min<size_t>(block_ids.size(), num_blocks_for(end)));
  sr.block_ids = std::move(block_ids);
  sr.samples = end == r.num_context_tokens;
  return sr;
}

ScheduledRequest Scheduler::Impl::generation_token(const Request& r) const {
  ScheduledRequest sr;
  sr.request_id = r.request_id;
  sr.is_context = false;
  sr.num_cached_tokens = r.num_total_tokens() - 1;
  sr.token_ids = {r.generated_token_ids.back()};
  std::vector<BlockId> block_ids = cache_manager.block_ids(r.request_id);
  block_ids.resize(std::min<size_t>(block_ids.size(), num_blocks_for(r.num_total_tokens())));
  sr.block_ids = std::move(block_ids);
  sr.samples = true;
  return sr;
}

}  // namespace kvtool
