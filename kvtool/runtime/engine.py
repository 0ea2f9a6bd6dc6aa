"""The executor loop: schedule (C++) -> copies, forward and sampling (the executor) -> report back to C++.

One Engine serves one plan on one device. It owns the scheduler (which owns the KV cache
manager) and the executor that runs its steps (kvtool.runtime.assemble builds the two), and fills
in each Request as it runs.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import time
from collections.abc import Callable

import numpy as np
import torch

from kvtool import _core
from kvtool.errors import KvtoolError
from kvtool.runtime.detokenizer import IncrementalDetokenizer
from kvtool.runtime.request import Request
from kvtool.runtime.tier3 import TIERS, Tier3


def cache_salt_id(cache_salt: str | None) -> int:
    """Stable 64-bit id of a cache salt string (0 = no salt)."""
    if not cache_salt:
        return 0
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8).digest(), "little") or 1


class Engine:
    """Runs requests through the C++ scheduler and an executor (kvtool.runtime.assemble.Executor: the
    model, or a simulation's cost model), step by step."""

    def __init__(self, executor, cache_config: _core.CacheConfig, scheduler_config: _core.SchedulerConfig, *,
                 vocab_size: int, eos_token_ids: list[int], bytes_per_token: int, tokenizer=None,
                 clock: Callable[[], float] = time.perf_counter, tier3_store=None) -> None:
        """``tier3_store``: the third tier's store (kvtool.runtime.tier3.open_tier), whose blocks the
        engine stages before scheduling a request; the executor runs the copies into and out of it."""
        self.executor = executor
        self.clock = clock  # token and finish times; kvtool.simulate passes its simulated clock
        # Prompt token ids are checked against the vocabulary where C++ converts them: a 2k-token
        # list is not copied to numpy first (40 µs, a simulated request's whole budget).
        scheduler_config.vocab_size = vocab_size
        self.scheduler = _core.Scheduler(cache_config, scheduler_config)
        self._request_ids = itertools.count()
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.bytes_per_token = bytes_per_token
        self.tokenizer = tokenizer
        self.max_seq_len = scheduler_config.max_seq_len
        self.tokens_per_block = cache_config.tokens_per_block
        # Unfinished requests only: a finished one is dropped here and in the scheduler, so a long-lived
        # engine (kvtool serve) keeps no state of what it served; the caller holds its Request.
        self._running: dict[int, Request] = {}
        self._generators: dict[int, torch.Generator | None] = {}
        # Unfinished requests that may end before their length or decode text as they go: step_until steps
        # them one at a time (_on_token), like step.
        self._may_stop: set[int] = set()
        self._lagging = False  # step_until left tokens of running requests in C++ (_catch_up)
        self.tier3 = None if tier3_store is None else Tier3(self.scheduler.cache_manager, tier3_store,
                                                             executor.run_copies, clock=clock)
        self._unadmitted: dict[int, None] = {}  # with a third tier: requests it may stage for, in arrival order
        self._max_batch_size = scheduler_config.max_batch_size
        # What one step's stagings may bring into the host tier: half of it, so that the blocks staged for
        # one request are not evicted by the next one's staging before the scheduler admits them.
        self._max_staged_blocks = max(1, cache_config.num_secondary_blocks // 2)

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request under a new ``request_id``. Raises ValueError naming the request when it
        cannot be served."""
        request.request_id = request_id = next(self._request_ids)
        token_ids = self._checked_prompt(request, f"request {request_id}")
        params = request.sampling_params
        self.scheduler.add_request(request_id, token_ids, params.max_tokens, **self._cache_args(request))
        if request.arrival_time is None:
            request.arrival_time = self.clock()
        if request.detokenizer is None and params.stop and not params.ignore_eos and self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)  # to find them
        self._running[request_id] = request
        self._generators[request_id] = self.executor.make_generator(params)
        if not params.ignore_eos or request.detokenizer is not None:
            self._may_stop.add(request_id)
        if self.tier3 is not None:
            self._unadmitted[request_id] = None

    def request_problem(self, request: Request) -> str | None:
        """Why add_request would refuse this request (None: it would be queued), without queuing it:
        the scheduler runs add_request's checks and changes nothing."""
        try:
            token_ids = self._checked_prompt(request, "the request")
        except ValueError as error:
            return str(error).removeprefix("the request: ")
        problem = self.scheduler.request_problem(token_ids, request.sampling_params.max_tokens,
                                                 extra_ids=self._extra_ids(request),
                                                 priority=request.sampling_params.priority)
        if problem is None:
            return None
        # The scheduler calls it "request": "request: token id ..." -> "token id ...",
        # "request has an empty prompt" -> "the request has an empty prompt".
        return re.sub(r"^request(: )?", lambda m: "" if m.group(1) else "the request", problem)

    @staticmethod
    def _checked_prompt(request: Request, name: str):
        """The prompt for the scheduler, which checks its token ids against the vocabulary (in C++, as it
        converts them); ValueError for an empty one. A prompt that makes its ids when read (a trace's,
        kvtool.workloads.hash_prompt) is made here, as an int32 array, and not kept."""
        prompt = request.prompt_token_ids
        if len(prompt) == 0:
            raise ValueError(f"{name}: the prompt is empty; give at least one token")
        return prompt if isinstance(prompt, (list, tuple, np.ndarray)) else np.asarray(prompt, dtype=np.int32)

    def _cache_args(self, request: Request) -> dict:
        """What the cache manager keys and keeps a request's blocks by, besides its tokens (the scheduler's
        add_request and a third-tier staging take the same): extra ids, LoRA task, cache salt, priorities."""
        params = request.sampling_params
        retention = params.kv_cache_retention_config
        return dict(extra_ids=self._extra_ids(request), lora_task_id=params.lora_task_id,
                    cache_salt=cache_salt_id(params.cache_salt), priority=params.priority,
                    retention=[] if retention is None else retention.to_core(len(request.prompt_token_ids)))

    @staticmethod
    def _extra_ids(request: Request) -> np.ndarray | None:
        return None if request.extra_ids is None else np.asarray(request.extra_ids, dtype=np.uint64)

    def abort_request(self, request_id: int) -> None:
        """Finishes an unfinished request with finish_reason "abort" (its blocks are freed); nothing
        for one that already finished."""
        if request_id in self._running:
            self._catch_up(self._running[request_id])
            self._finish(self._running[request_id], "abort", self.clock())

    @property
    def num_requests(self) -> int:
        """Requests the engine holds: the unfinished ones (a finished request is forgotten)."""
        return len(self._running)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Runs one step; returns the requests that produced a token in it (the token is the last
        of their output_token_ids; those that finished have a finish_reason)."""
        if self._lagging:
            for request in self._running.values():
                self._catch_up(request)
            self._lagging = False
        # Retention durations run on the engine's clock (a simulated one in kvtool.simulate).
        self.scheduler.cache_manager.set_time(int(self.clock() * 1000))
        if self._unadmitted:
            self._stage_next()
        batch = self.scheduler.schedule()
        sampling = [self._running[r.request_id] for r in batch.requests if r.samples]
        token_ids = self._execute(batch, sampling)
        if token_ids is None:
            if self.scheduler.has_unfinished_requests():
                raise self._stalled()
            return []
        now = self.clock()
        for request_id in batch.paused_request_ids:
            self._running[request_id].num_pauses += 1
        request_ids = np.asarray([r.request_id for r in sampling], dtype=np.int64)
        finished_ids = set(self.scheduler.complete_step(request_ids, np.asarray(token_ids, dtype=np.int32)))
        for request, token_id in zip(sampling, token_ids):
            self._on_token(request, token_id, now, request.request_id in finished_ids)
        return sampling

    def step_until(self, until: float | None = None) -> list[Request]:
        """Runs steps, at least one while requests are unfinished, until after one of them a request has
        finished or the clock has reached ``until`` (None: until a request finishes). Returns the requests
        that finished, in the order step() returns them: the same as calling step() until then.

        A simulation's executor runs the steps in C++ when every unfinished request runs to its length
        without decoding text (bench requests: ignore_eos), kvtool.simulate.executor.CostModelExecutor.run_steps;
        the tokens and times of a request still running then reach its Request when it finishes, or at
        the next step() or abort_request.
        """
        # A third tier stages before each step (_stage_next), which only step() does.
        if self._may_stop or self.tier3 is not None or not hasattr(self.executor, "run_steps"):
            finished: list[Request] = []
            while not finished and self.scheduler.has_unfinished_requests():
                finished = [request for request in self.step() if request.finished]
                if until is not None and self.clock() >= until:
                    break
            return finished
        if not self.scheduler.has_unfinished_requests():
            return []
        steps = self.executor.run_steps(self.scheduler, until)
        self._lagging = True
        for request_id in steps.paused_request_ids:
            self._running[request_id].num_pauses += 1
        if steps.stalled:
            raise self._stalled()
        finished = [self._running[request_id] for request_id in steps.finished_request_ids]
        for request in finished:
            self._catch_up(request)
            self._finish(request, "length", request.token_times[-1])
        return finished

    def _catch_up(self, request: Request) -> None:
        """Gives a request the tokens and token times step_until left in C++ for it."""
        if not self._lagging:
            return
        generated = self.scheduler.generated_token_ids(request.request_id)
        if len(generated) == len(request.output_token_ids):
            return
        request.output_token_ids.extend(generated[len(request.output_token_ids):].tolist())
        request.token_times.extend(self.executor.take_token_times(request.request_id).tolist())
        if request.first_token_time is None:
            self._first_token(request, request.token_times[0])

    def _stalled(self) -> KvtoolError:
        return KvtoolError(
            f"no queued request fits in the KV cache ({self.scheduler.num_queued_requests()} waiting, "
            f"{self.scheduler.cache_manager.num_available_blocks()} blocks available): raise "
            "--max_tokens_in_paged_kv_cache or --kv_cache_free_gpu_mem_fraction")

    def _stage_next(self) -> None:
        """Stages the third tier's blocks of the requests the scheduler may admit in this step: the oldest
        waiting ones, as many as the batch has free slots, while the host tier has room for what they
        fetch (half of it per step). A request is staged again at each step it keeps waiting: what an
        earlier staging brought may have been pushed out since (staging blocks already in the primary or
        host tier does nothing)."""
        num_free_slots = self._max_batch_size - self.scheduler.num_running_requests()
        admitted, waiting = [], []
        for request_id in self._unadmitted:
            if len(waiting) >= num_free_slots:
                break
            state = self.scheduler.request_stats(request_id).state
            if state in (_core.RequestState.QUEUED, _core.RequestState.PAUSED):
                waiting.append(request_id)
            else:  # admitted: a request paused later is not staged again
                admitted.append(request_id)
        for request_id in admitted:
            del self._unadmitted[request_id]
        num_staged = 0
        for request_id in waiting:
            request = self._running[request_id]
            cost = self.tier3.stage(self._checked_prompt(request, f"request {request_id}"), **self._cache_args(request))
            request.num_staged_blocks += cost.num_staged_blocks
            num_staged += cost.num_staged_blocks
            if num_staged >= self._max_staged_blocks:
                break

    def _execute(self, batch, sampling: list[Request]) -> list[int] | None:
        """Runs the batch's copies and forward and samples: a token per request of ``sampling`` (in
        batch order), or None when the batch has no request."""
        return self.executor.execute_step(batch, sampling, [self._generators[r.request_id] for r in sampling])

    def _first_token(self, request: Request, now: float) -> None:
        """The first token's time, and the reuse figures of the request's first admission."""
        request.first_token_time = now
        stats = self.scheduler.request_stats(request.request_id)
        request.num_reused_tokens = stats.num_reused_tokens
        request.num_reused_blocks = stats.num_reused_blocks
        request.num_onboarded_blocks = stats.num_onboarded_blocks
        request.num_early_reused_blocks = stats.num_early_reused_blocks
        request.miss_reasons = stats.missed.to_dict(tier3=self.tier3 is not None)

    def _on_token(self, request: Request, token_id: int, now: float, reached_length: bool) -> None:
        if request.first_token_time is None:
            self._first_token(request, now)
        request.output_token_ids.append(token_id)
        request.token_times.append(now)
        completes_stop_string = request.detokenizer is not None and request.detokenizer.append(token_id)
        reason = "length" if reached_length else self._stop_reason(request, token_id, completes_stop_string)
        if reason is not None:
            self._finish(request, reason, now)

    def _stop_reason(self, request: Request, token_id: int, completes_stop_string: bool) -> str | None:
        params = request.sampling_params
        if params.ignore_eos:
            return None
        if token_id in self.eos_token_ids or token_id in params.stop_token_ids or completes_stop_string:
            return "stop"
        return None

    def _finish(self, request: Request, reason: str, now: float) -> None:
        """Ends the request (the scheduler frees its blocks if it still holds them) and forgets it."""
        self.scheduler.remove_request(request.request_id)
        del self._running[request.request_id], self._generators[request.request_id]
        self._may_stop.discard(request.request_id)
        self._unadmitted.pop(request.request_id, None)
        request.finish_time = now
        request.finish_reason = reason

    # -- stats ------------------------------------------------------------------------------
    def get_stats(self) -> dict[str, int | float]:
        """Cache statistics (docs/architecture.md#how-bench-measures), bytes moved each way included."""
        s = self.scheduler.cache_manager.stats()
        return {
            "reused_blocks": s.reused_blocks,
            "missed_blocks": s.missed_blocks,
            **{f"missed_{reason}_blocks": count for reason, count in s.missed.to_dict().items()},
            "cache_hit_rate": s.cache_hit_rate,
            "early_reused_blocks": s.early_reused_blocks,
            "partial_reused_blocks": s.partial_reused_blocks,
            "alloc_total_blocks": s.alloc_total_blocks,
            "alloc_new_blocks": s.alloc_new_blocks,
            "offloaded_blocks": s.offloaded_blocks,
            "onboarded_blocks": s.onboarded_blocks,
            "evicted_blocks": s.evicted_blocks,
            "offloaded_bytes": s.num_offloaded_tokens * self.bytes_per_token,
            "onboarded_bytes": s.num_onboarded_tokens * self.bytes_per_token,
            "primary_blocks": s.primary.num_blocks,
            "primary_free_blocks": s.primary.num_free_blocks,
            "primary_cached_blocks": s.primary.num_cached_blocks,
            "primary_used_blocks": s.primary.num_used_blocks,
            "secondary_blocks": s.secondary.num_blocks,
            "secondary_free_blocks": s.secondary.num_free_blocks,
            "secondary_cached_blocks": s.secondary.num_cached_blocks,
            "secondary_used_blocks": s.secondary.num_used_blocks,
            **self._tier_stats(s),
        }

    def _tier_stats(self, s) -> dict[str, int | float]:
        """Per tier (primary, host, disk, remote): reused blocks it served, blocks dropped from it and the
        bytes copied into and out of it; with a third tier, its miss reasons, traffic and store failures."""
        out: dict[str, int | float] = {}
        for name, pool in TIERS:
            tier = s.tier(pool)
            out[f"{name}_hit_blocks"] = tier.hit_blocks
            out[f"{name}_evicted_blocks"] = tier.evicted_blocks
            if pool in (_core.PoolKind.DISK, _core.PoolKind.REMOTE):
                out[f"{name}_in_bytes"] = tier.num_tokens_in * self.bytes_per_token
                out[f"{name}_out_bytes"] = tier.num_tokens_out * self.bytes_per_token
        if self.tier3 is not None:
            out.update({f"missed_{reason}_blocks": count for reason, count in s.missed.to_dict(tier3=True).items()})
            out.update(self.tier3.stats(s))
        return out

    def close(self) -> None:
        """Waits for the third tier's queued spills and closes its store (nothing without one)."""
        if self.tier3 is not None:
            self.tier3.close()

    def reset_stats(self) -> None:
        """Zeroes the cache counters, keeping the cache (after warm-up requests)."""
        self.scheduler.cache_manager.reset_stats()
        if self.tier3 is not None:
            self.tier3.reset_stats()
