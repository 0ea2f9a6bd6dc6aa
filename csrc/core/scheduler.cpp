// The scheduler's request bookkeeping: validation on entry, step scheduling (delegated to the
// capacity and micro-batch schedulers) and applying a completed step.
#include "scheduler.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

#include "scheduler_impl.h"

namespace kvtool {

namespace {

std::string request_name(int64_t request_id) { return "request " + std::to_string(request_id); }

bool is_running(RequestState state) {
  return state == RequestState::kContext || state == RequestState::kGeneration;
}

}  // namespace

void SchedulerConfig::validate() const {
  auto policy = static_cast<int>(capacity_scheduler_policy);
  if (policy < 0 || policy > static_cast<int>(CapacitySchedulerPolicy::kStaticBatch)) {
    throw std::invalid_argument("SchedulerConfig.capacity_scheduler_policy " + std::to_string(policy) +
                                " is unknown: use GUARANTEED_NO_EVICT, MAX_UTILIZATION or STATIC_BATCH");
  }
  auto chunking = static_cast<int>(context_chunking_policy);
  if (chunking < 0 || chunking > static_cast<int>(ContextChunkingPolicy::kEqualProgress)) {
    throw std::invalid_argument("SchedulerConfig.context_chunking_policy " + std::to_string(chunking) +
                                " is unknown: use FIRST_COME_FIRST_SERVED or EQUAL_PROGRESS");
  }
  if (max_batch_size < 1) {
    throw std::invalid_argument("SchedulerConfig.max_batch_size must be >= 1 request per step, got " +
                                std::to_string(max_batch_size));
  }
  if (max_num_tokens < 1) {
    throw std::invalid_argument("SchedulerConfig.max_num_tokens must be >= 1 token per step, got " +
                                std::to_string(max_num_tokens));
  }
  if (max_seq_len < 1) {
    throw std::invalid_argument("SchedulerConfig.max_seq_len must be >= 1 token, got " +
                                std::to_string(max_seq_len));
  }
  if (vocab_size < 0) {
    throw std::invalid_argument("SchedulerConfig.vocab_size must be >= 0 (0: token ids not checked), got " +
                                std::to_string(vocab_size));
  }
}

Scheduler::Impl::Impl(CacheConfig cache_config, SchedulerConfig scheduler_config)
    : config(scheduler_config), cache_manager(std::move(cache_config)) {
  config.validate();
  tokens_per_block = cache_manager.config().tokens_per_block;
  if (config.enable_chunked_context && config.max_num_tokens < tokens_per_block) {
    // Every chunk but the last ends on a block boundary, so a step must hold at least one block.
    throw std::invalid_argument("--max_num_tokens (" + std::to_string(config.max_num_tokens) +
                                ") must be >= --tokens_per_block (" + std::to_string(tokens_per_block) +
                                ") with --enable_chunked_context: context chunks are whole blocks; "
                                "raise --max_num_tokens");
  }
}

Request& Scheduler::Impl::record(int64_t request_id) {
  auto it = requests.find(request_id);
  if (it == requests.end()) throw UnknownRequestError(request_name(request_id) + " is unknown to the scheduler");
  return it->second;
}

Request* Scheduler::Impl::find(int64_t request_id) {
  auto it = requests.find(request_id);
  return it == requests.end() ? nullptr : &it->second;
}

const Request& Scheduler::Impl::record(int64_t request_id) const {
  auto it = requests.find(request_id);
  if (it == requests.end()) throw UnknownRequestError(request_name(request_id) + " is unknown to the scheduler");
  return it->second;
}

int32_t Scheduler::Impl::num_remaining_blocks(const Request& r) const {
  return std::max(0, num_blocks_for(r.num_lifetime_tokens()) - num_blocks_for(r.num_allocated_tokens));
}

SequenceSpec Scheduler::Impl::admission_spec(const Request& r) const {
  SequenceSpec spec = r.spec;
  if (!r.generated_token_ids.empty()) {
    spec.token_ids.insert(spec.token_ids.end(), r.generated_token_ids.begin(), r.generated_token_ids.end());
    // Generated tokens are normal tokens: extra id 0.
    if (!spec.extra_ids.empty()) spec.extra_ids.resize(spec.token_ids.size(), 0);
  }
  return spec;
}

void Scheduler::Impl::remove_running(int64_t request_id) {
  running.erase(std::remove(running.begin(), running.end(), request_id), running.end());
}

void Scheduler::Impl::finish(Request& r) {
  if (is_running(r.state)) {
    cache_manager.release(r.request_id);
    remove_running(r.request_id);
  } else if (r.state == RequestState::kQueued || r.state == RequestState::kPaused) {
    waiting.erase(std::remove(waiting.begin(), waiting.end(), r.request_id), waiting.end());
  }
  r.state = RequestState::kFinished;
  r.num_allocated_tokens = 0;
  // The prompt is no longer needed: keep memory flat over long benchmark runs.
  r.spec.token_ids = {};
  r.spec.extra_ids = {};
}

Scheduler::Scheduler(CacheConfig cache_config, SchedulerConfig scheduler_config)
    : impl_(std::make_unique<Impl>(std::move(cache_config), scheduler_config)) {}

Scheduler::~Scheduler() = default;

PromptSummary summarize_prompt(const SequenceSpec& prompt, int32_t vocab_size) {
  PromptSummary summary;
  summary.num_tokens = static_cast<int64_t>(prompt.token_ids.size());
  summary.num_extra_ids = static_cast<int64_t>(prompt.extra_ids.size());
  summary.priority = prompt.priority;
  if (vocab_size > 0) {
    for (const TokenId t : prompt.token_ids) {
      if (t < 0 || t >= vocab_size) {
        summary.first_outside_vocab = t;
        break;
      }
    }
  }
  return summary;
}

std::optional<std::string> Scheduler::Impl::prompt_problem(const std::string& name, const PromptSummary& prompt,
                                                          int32_t max_new_tokens) const {
  const Impl& s = *this;
  const int64_t num_prompt_tokens = prompt.num_tokens;
  if (num_prompt_tokens == 0) {
    return name + " has an empty prompt: give at least one token";
  }
  if (prompt.first_outside_vocab.has_value()) {
    const std::string vocab = std::to_string(s.config.vocab_size);
    return name + ": token id " + std::to_string(*prompt.first_outside_vocab) +
           " is outside the model's vocabulary [0, " + vocab + "): use token ids below " + vocab;
  }
  if (max_new_tokens < 1) {
    return name + ": max_new_tokens must be >= 1, got " + std::to_string(max_new_tokens);
  }
  if (prompt.num_extra_ids != 0 && prompt.num_extra_ids != num_prompt_tokens) {
    return name + " has " + std::to_string(prompt.num_extra_ids) + " extra_ids for " +
           std::to_string(num_prompt_tokens) +
           " prompt tokens: give one extra id per prompt token (0 for a normal token), or none";
  }
  if (prompt.priority < 0 || prompt.priority > 100) {
    return name + ": priority must be in 0..100, got " + std::to_string(prompt.priority);
  }
  const int64_t num_lifetime_tokens = num_prompt_tokens + max_new_tokens;
  if (num_lifetime_tokens > s.config.max_seq_len) {
    return name + ": prompt of " + std::to_string(num_prompt_tokens) + " tokens + " +
           std::to_string(max_new_tokens) + " output tokens = " + std::to_string(num_lifetime_tokens) +
           " tokens exceeds --max_seq_len " + std::to_string(s.config.max_seq_len) +
           ": shorten the prompt, generate fewer tokens or raise --max_seq_len";
  }
  if (!s.config.enable_chunked_context && num_prompt_tokens > s.config.max_num_tokens) {
    return name + ": prompt of " + std::to_string(num_prompt_tokens) + " tokens exceeds --max_num_tokens " +
           std::to_string(s.config.max_num_tokens) +
           " tokens per step: enable chunked context (--enable_chunked_context) or raise --max_num_tokens";
  }
  const int32_t num_primary_blocks = s.cache_manager.config().num_primary_blocks;
  if (s.num_blocks_for(static_cast<int32_t>(num_lifetime_tokens)) > num_primary_blocks) {
    return name + ": the primary pool of " + std::to_string(num_primary_blocks) + " blocks (" +
           std::to_string(static_cast<int64_t>(num_primary_blocks) * s.tokens_per_block) +
           " tokens) cannot hold one request of " + std::to_string(num_lifetime_tokens) +
           " tokens: raise --max_tokens_in_paged_kv_cache or --kv_cache_free_gpu_mem_fraction";
  }
  return std::nullopt;
}

std::optional<std::string> Scheduler::request_problem(const PromptSummary& prompt, int32_t max_new_tokens) const {
  return impl_->prompt_problem("request", prompt, max_new_tokens);
}

void Scheduler::add_request(int64_t request_id, SequenceSpec prompt, int32_t max_new_tokens) {
  Impl& s = *impl_;
  const std::string name = request_name(request_id);
  if (s.requests.count(request_id) != 0) {
    throw std::invalid_argument(name + " is already known to the scheduler: give every request a new id");
  }
  if (auto problem = s.prompt_problem(name, summarize_prompt(prompt, s.config.vocab_size), max_new_tokens)) {
    throw std::invalid_argument(*problem);
  }
  try {
    validate_retention(prompt.retention);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(name + ": " + e.what());
  }
  const auto num_prompt_tokens = static_cast<int64_t>(prompt.token_ids.size());
  Request r;
  r.request_id = request_id;
  r.spec = std::move(prompt);
  r.max_new_tokens = max_new_tokens;
  r.stats.request_id = request_id;
  r.stats.num_prompt_tokens = static_cast<int32_t>(num_prompt_tokens);
  s.requests.emplace(request_id, std::move(r));
  s.waiting.push_back(request_id);
}

void Scheduler::finish_request(int64_t request_id) {
  Request& r = impl_->record(request_id);
  if (r.state == RequestState::kFinished) return;
  impl_->finish(r);
}

void Scheduler::remove_request(int64_t request_id) {
  Request& r = impl_->record(request_id);
  if (r.state != RequestState::kFinished) impl_->finish(r);
  impl_->requests.erase(request_id);
}

ScheduledBatch Scheduler::schedule() {
  Impl& s = *impl_;
  if (s.has_outstanding_batch) {
    throw std::logic_error("schedule() was called again before complete_step() reported step " +
                           std::to_string(s.outstanding_step_id) + ": report every step before scheduling the next");
  }
  ScheduledBatch batch;
  batch.step_id = s.next_step_id++;
  s.schedule_capacity(batch);
  s.form_micro_batch(batch);
  batch.copy_ops = s.cache_manager.take_copy_ops(&batch.copy_op_keys);

  s.outstanding_work.clear();
  for (const ScheduledRequest& sr : batch.requests) {
    batch.num_tokens += static_cast<int32_t>(sr.token_ids.size());
    s.outstanding_work.push_back(
        {sr.request_id, sr.num_cached_tokens + static_cast<int32_t>(sr.token_ids.size()), sr.samples});
  }
  s.has_outstanding_batch = !batch.requests.empty();
  s.outstanding_step_id = batch.step_id;
  return batch;
}

std::vector<int64_t> Scheduler::complete_step(const std::vector<int64_t>& request_ids,
                                              const std::vector<TokenId>& token_ids) {
  Impl& s = *impl_;
  if (request_ids.size() != token_ids.size()) {
    throw std::invalid_argument("complete_step got " + std::to_string(request_ids.size()) + " request ids but " +
                                std::to_string(token_ids.size()) + " token ids: give one sampled token per request");
  }
  if (!s.has_outstanding_batch) {
    if (request_ids.empty()) return {};
    throw std::logic_error("complete_step() got sampled tokens but no step is outstanding: call schedule() first");
  }
  const std::string step_name = "step " + std::to_string(s.outstanding_step_id);

  // Check the whole report before changing anything, so a bad call leaves the scheduler as it was.
  std::unordered_map<int64_t, bool> samples_in_batch;  // request id -> samples
  for (const ScheduledWork& w : s.outstanding_work) samples_in_batch[w.request_id] = w.samples;
  std::unordered_map<int64_t, TokenId> sampled;
  for (size_t i = 0; i < request_ids.size(); ++i) {
    auto it = samples_in_batch.find(request_ids[i]);
    if (it == samples_in_batch.end() || !it->second) {
      throw std::invalid_argument("complete_step: " + request_name(request_ids[i]) + " did not sample in " +
                                  step_name + ": report exactly the requests whose ScheduledRequest.samples is true");
    }
    if (!sampled.emplace(request_ids[i], token_ids[i]).second) {
      throw std::invalid_argument("complete_step: " + request_name(request_ids[i]) + " is reported twice");
    }
  }
  for (const ScheduledWork& w : s.outstanding_work) {
    const Request* r = s.find(w.request_id);  // nullptr: removed after schedule()
    if (w.samples && sampled.count(w.request_id) == 0 && r != nullptr && is_running(r->state)) {
      throw std::invalid_argument("complete_step: " + request_name(w.request_id) + " sampled in " + step_name +
                                  " but no token was reported for it");
    }
  }

  std::vector<int64_t> finished_request_ids;
  for (const ScheduledWork& w : s.outstanding_work) {
    Request* found = s.find(w.request_id);
    if (found == nullptr || !is_running(found->state)) continue;  // finished or removed after schedule()
    Request& r = *found;
    s.cache_manager.mark_computed(r.request_id, w.num_computed_tokens_after);
    r.num_computed_tokens = w.num_computed_tokens_after;
    if (!w.samples) continue;  // a context chunk that is not the last one
    const TokenId token_id = sampled.at(r.request_id);
    r.generated_token_ids.push_back(token_id);
    r.stats.num_generated_tokens = static_cast<int32_t>(r.generated_token_ids.size());
    if (r.stats.num_generated_tokens >= r.max_new_tokens) {
      // Its KV is never computed, so the last token is not appended to the cache.
      s.finish(r);
      finished_request_ids.push_back(r.request_id);
    } else {
      s.cache_manager.append_tokens(r.request_id, {token_id});
      r.state = RequestState::kGeneration;
    }
  }
  s.has_outstanding_batch = false;
  s.outstanding_work.clear();
  return finished_request_ids;
}

bool Scheduler::has_unfinished_requests() const { return !impl_->waiting.empty() || !impl_->running.empty(); }

int32_t Scheduler::num_queued_requests() const { return static_cast<int32_t>(impl_->waiting.size()); }

int32_t Scheduler::num_running_requests() const { return static_cast<int32_t>(impl_->running.size()); }

int32_t Scheduler::num_requests() const { return static_cast<int32_t>(impl_->requests.size()); }

RequestState Scheduler::request_state(int64_t request_id) const { return impl_->record(request_id).state; }

RequestStats Scheduler::request_stats(int64_t request_id) const {
  const Request& r = impl_->record(request_id);
  RequestStats stats = r.stats;
  stats.state = r.state;
  return stats;
}

std::vector<TokenId> Scheduler::generated_token_ids(int64_t request_id) const {
  return impl_->record(request_id).generated_token_ids;
}

const SchedulerConfig& Scheduler::config() const { return impl_->config; }

KVCacheManager& Scheduler::cache_manager() { return impl_->cache_manager; }

const KVCacheManager& Scheduler::cache_manager() const { return impl_->cache_manager; }

}  // namespace kvtool
