// The scheduler: request states, capacity policies, micro-batch limits and chunked context.
// Each step it returns one ScheduledBatch; the runtime executes it and reports back with complete_step.
#pragma once

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kv_cache_manager.h"

namespace kvtool {

enum class CapacitySchedulerPolicy : uint8_t { kGuaranteedNoEvict = 0, kMaxUtilization = 1, kStaticBatch = 2 };
enum class ContextChunkingPolicy : uint8_t { kFirstComeFirstServed = 0, kEqualProgress = 1 };
enum class RequestState : uint8_t { kQueued = 0, kContext = 1, kGeneration = 2, kPaused = 3, kFinished = 4 };

// Thrown for a request id the scheduler does not know (Python: KeyError).
class UnknownRequestError : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

struct SchedulerConfig {
  CapacitySchedulerPolicy capacity_scheduler_policy = CapacitySchedulerPolicy::kGuaranteedNoEvict;
  ContextChunkingPolicy context_chunking_policy = ContextChunkingPolicy::kFirstComeFirstServed;
  bool enable_chunked_context = false;
  int32_t max_batch_size = 8;      // requests per step
  int32_t max_num_tokens = 8192;   // context-chunk tokens + one per generating request, per step
  int32_t max_seq_len = 4096;      // prompt + generated tokens of one request
  // Hold a queued request back while a running context is still computing prompt blocks it
  // could reuse, so requests sharing a prefix that arrive together compute it once (as
  // SGLang's in-batch prefix caching). Not under STATIC_BATCH, which admits a batch at once.
  bool enable_in_batch_prefix_reuse = true;
  // > 0: every prompt token id must be in [0, vocab_size) (checked where the prompt is converted
  // anyway, so a caller need not copy a long prompt to check it); 0: not checked.
  int32_t vocab_size = 0;

  void validate() const;  // throws std::invalid_argument naming the field
};

// One request's share of a step.
struct ScheduledRequest {
  int64_t request_id = 0;
  bool is_context = true;              // context chunk (true) or one generation token (false)
  int32_t num_cached_tokens = 0;       // tokens whose KV is in the cache before this step = position of the first new token
  std::vector<TokenId> token_ids;      // the tokens to compute in this step
  std::vector<BlockId> block_ids;      // primary block table covering num_cached_tokens + token_ids.size()
  bool samples = false;                // produces a token this step (last context chunk, or generation)
};

struct ScheduledBatch {
  int64_t step_id = 0;
  std::vector<ScheduledRequest> requests;   // context chunks first, then generation requests
  std::vector<CopyOp> copy_ops;             // run these, in order, before the forward
  std::vector<BlockDigest> copy_op_keys;    // the key of each copy into or out of the third tier
  std::vector<int64_t> paused_request_ids;  // paused this step (MAX_UTILIZATION)
  int32_t num_tokens = 0;                   // sum of token_ids sizes
};

// Per-request outcome for reports.
struct RequestStats {
  int64_t request_id = 0;
  RequestState state = RequestState::kQueued;
  int32_t num_prompt_tokens = 0;
  int32_t num_generated_tokens = 0;
  int32_t num_reused_tokens = 0;       // at first admission
  int32_t num_reused_blocks = 0;
  int32_t num_onboarded_blocks = 0;
  int32_t num_early_reused_blocks = 0;
  MissReasons missed;                  // full prompt blocks not reused, by reason
  int32_t num_pauses = 0;
};

// What add_request's checks read of a prompt: its length, its first token id outside the
// vocabulary (when SchedulerConfig.vocab_size checks them), how many extra ids it has, its priority.
struct PromptSummary {
  int64_t num_tokens = 0;
  std::optional<TokenId> first_outside_vocab;
  int64_t num_extra_ids = 0;
  int32_t priority = kDefaultPriority;
};

// The summary of a prompt under a vocabulary of `vocab_size` ids (0: ids are not checked).
PromptSummary summarize_prompt(const SequenceSpec& prompt, int32_t vocab_size);

class Scheduler {
 public:
  Scheduler(CacheConfig cache_config, SchedulerConfig scheduler_config);  // validates both
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request. Throws std::invalid_argument (naming the request) when the prompt is empty,
  // prompt + max_new_tokens exceeds max_seq_len, extra_ids has the wrong length, or the id is known.
  void add_request(int64_t request_id, SequenceSpec prompt, int32_t max_new_tokens);
  // Why add_request would refuse this prompt under another id (the message names the request
  // "request"), or nothing when it would queue it. Changes nothing: a pre-check for many requests.
  std::optional<std::string> request_problem(const PromptSummary& prompt, int32_t max_new_tokens) const;
  // Finishes a request early (EOS / stop string / cancellation): its blocks are released.
  // A request that is already finished is left as it is. Unknown id: UnknownRequestError.
  void finish_request(int64_t request_id);
  // Forgets a request: finishes it first when it is not (as finish_request), then drops all the
  // scheduler kept of it (stats, generated tokens); its id becomes unknown. A long-lived caller
  // removes each request once it has read what it needs, or memory grows with every request.
  // Unknown id: UnknownRequestError.
  void remove_request(int64_t request_id);

  // Schedules the next step. An empty batch with has_unfinished_requests() means nothing fits.
  // Run batch.copy_ops even when batch.requests is empty. Throws std::logic_error when the previous
  // non-empty batch has not been reported with complete_step yet.
  ScheduledBatch schedule();
  // Reports the step just executed: the sampled token of each request that sampled, in batch order.
  // Marks KV computed, appends tokens, finishes requests that reached max_new_tokens.
  // Returns the ids of the requests finished by this call. Requests finished with finish_request
  // (or removed) after schedule() may be left out (their tokens are ignored). Throws std::invalid_argument when
  // request_ids is not the set of sampling requests of the last batch.
  std::vector<int64_t> complete_step(const std::vector<int64_t>& request_ids,
                                     const std::vector<TokenId>& token_ids);

  bool has_unfinished_requests() const;
  int32_t num_queued_requests() const;
  int32_t num_running_requests() const;
  // Requests the scheduler keeps a record of: unfinished ones, and finished ones not removed yet.
  int32_t num_requests() const;
  RequestState request_state(int64_t request_id) const;  // unknown id: UnknownRequestError
  RequestStats request_stats(int64_t request_id) const;  // unknown id: UnknownRequestError
  const SchedulerConfig& config() const;
  // Token ids generated so far by a request (kept after it finishes).
  std::vector<TokenId> generated_token_ids(int64_t request_id) const;

  KVCacheManager& cache_manager();
  const KVCacheManager& cache_manager() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtool
