"""The executor of a simulated engine: the same C++ scheduler and KV cache manager as a real run hand
out every batch, and each step advances a simulated clock by the cost model's prediction for its
shape instead of running copies, forward and sampling (kvtool.runtime.assemble builds the engine)."""

from __future__ import annotations

import math

import numpy as np

from kvtool import _core
from kvtool.config import EngineConfig, KvCacheConfig
from kvtool.errors import KvtoolError
from kvtool.runtime.assemble import PoolBudget, RuntimeLimits
from kvtool.runtime.device import available_host_memory_bytes
from kvtool.runtime.disk_store import PAGE_BYTES, round_up
from kvtool.runtime.kv_pool import BlockShape
from kvtool.runtime.pool_sizes import PoolSizes
from kvtool.runtime.request import Request
from kvtool.runtime.tier3 import OpenedTier
from kvtool.runtime.tier3_store import HEADER_BYTES
from kvtool.simulate.cost_model import CostModel, step_shape
from kvtool.simulate.simulated_tier import KeyIndex, SimulatedStore
from kvtool.simulate.tier_costs import TierCosts, tier_costs

_THIRD_TIER = (_core.PoolKind.DISK.value, _core.PoolKind.REMOTE.value)


class SimulatedClock:
    """Seconds since the simulation started; only steps and waits for arrivals move it."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def now(self) -> float:
        return self.seconds

    def sleep(self, seconds: float) -> None:
        """Waiting for the next arrival jumps to it."""
        self.seconds += max(0.0, seconds)

    def advance(self, seconds: float) -> None:
        self.seconds += seconds


class CostModelExecutor:
    """Runs an engine's steps on ``clock``: each advances it by ``cost_model.predict`` of the step's shape.

    Generated tokens are a deterministic function of the request's last token and length
    (kvtool._core.simulated_token), so two requests with the same prompt get the same answer (as greedy
    decoding gives), and a later session turn, which resends the answer, finds its blocks as it would in
    a real run.

    ``run_steps`` runs many steps in one call (kvtool._core.StepSimulator: the same scheduler calls, the
    same costs added in the same order, the same tokens), for an engine whose requests all run to
    their length (kvtool.runtime.engine.Engine.step_until).

    A third tier (--kv_disk_cache_bytes, --kv_remote_cache_bytes) is an index-only store
    (kvtool.simulate.simulated_tier) whose fetches, spills and lookups advance the clock by
    ``tier_costs``; ``remote_index``: the remote store's keys when another replica's engine made it
    (a fleet shares one remote store).
    """

    def __init__(self, cost_model: CostModel, clock: SimulatedClock, *, vocab_size: int,
                 tier_costs: TierCosts | None = None, remote_index: KeyIndex | None = None) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.vocab_size = vocab_size
        self.tier_costs = tier_costs
        self.remote_index = remote_index
        self.tier3_store: SimulatedStore | None = None  # set by open_tier3
        self.bytes_per_token = 0  # set by start
        self.num_steps = 0  # steps that computed something
        self._simulator: _core.StepSimulator | None = None  # set by start

    def pool_budget(self, kv_cache_config: KvCacheConfig) -> PoolBudget:
        """The pools as a real run on the profile's device would size them: a CPU's out of this machine's
        memory, a GPU's out of the device memory left after the weights, which the profile records.
        Nothing is allocated, so any host cache size can be simulated, whatever this machine has."""
        on_cpu = self.cost_model.device.startswith("cpu")
        free_bytes = (available_host_memory_bytes() if on_cpu
                      else int(self.cost_model.details.get("free_memory_bytes", 0)))
        if not free_bytes:
            if kv_cache_config.max_tokens is None:
                raise KvtoolError(f"the cost model of {self.cost_model.device} does not say how much device memory "
                                  "is free for the KV cache: give --max_tokens_in_paged_kv_cache, or recalibrate")
            free_bytes = 1 << 62  # the pool is the size asked for
        host_bytes = max(available_host_memory_bytes(), kv_cache_config.host_cache_size + free_bytes)
        return PoolBudget(free_bytes, host_bytes, on_cpu)

    def start(self, shape: BlockShape, pool_sizes: PoolSizes, config: EngineConfig, limits: RuntimeLimits) -> None:
        # A simulated step costs what the cost model says: CUDA graphs (config.enforce_eager) are in it, as
        # a calibration times steps as the LLM runs them.
        self.bytes_per_token = shape.bytes_per_token
        self._simulator = _core.StepSimulator(self.cost_model.step_costs(shape.bytes_per_token), self.vocab_size)

    def open_tier3(self, kv: KvCacheConfig, block_bytes: int, plan_digest: bytes) -> OpenedTier:
        """The simulated third tier the configuration asks for (kvtool.runtime.assemble.open_third_tier):
        nothing is written or connected to; KvtoolError naming the flag when its size holds no block."""
        costs = self.tier_costs or tier_costs()
        remote = kv.remote_cache_url is not None or kv.remote_cache_size > 0
        if remote and not kv.remote_cache_size:
            raise KvtoolError(f"--kv_remote_cache {kv.remote_cache_url}: a simulated store holds what its size says "
                              "(a real one, what its server's maxmemory allows): give --kv_remote_cache_bytes, "
                              "e.g. 1TiB")
        flag, size = (("--kv_remote_cache_bytes", kv.remote_cache_size) if remote
                      else ("--kv_disk_cache_bytes", kv.disk_cache_size))
        # As a real store keeps them: each block with its header (disk: in page-aligned slots).
        slot_bytes = HEADER_BYTES + block_bytes if remote else round_up(HEADER_BYTES + block_bytes, PAGE_BYTES)
        num_blocks = size // slot_bytes
        if num_blocks == 0:
            raise KvtoolError(f"{flag} {size} holds no KV block: a block takes {slot_bytes} bytes there; give at "
                              "least that (a few GiB to matter)")
        if remote:
            if self.remote_index is None:
                self.remote_index = KeyIndex(num_blocks)
            pool, index, cost, num_index_blocks = (_core.PoolKind.REMOTE, self.remote_index, costs.tiers["remote"],
                                                   kv.remote_cache_index_blocks)
        else:
            pool, index, cost, num_index_blocks = (_core.PoolKind.DISK, KeyIndex(num_blocks), costs.tiers["disk"],
                                                   num_blocks)
        self.tier3_store = SimulatedStore(pool, index, cost, block_bytes, plan_digest, self.clock.advance)
        return OpenedTier(self.tier3_store, num_index_blocks)

    def use_tier3_store(self, store) -> None:
        self.tier3_store = store

    def run_copies(self, ops) -> list[int]:
        """A staging's copies (kvtool.runtime.tier3.Tier3.stage): fetches and spills on the simulated store,
        each charged to the clock; the host blocks whose fetch found nothing."""
        return self._third_tier_copies(ops)[1]

    def _third_tier_copies(self, ops) -> tuple[np.ndarray, list[int]]:
        """Runs the copies into and out of the third tier on the store (their costs on the clock);
        returns the token counts of the other copies (primary <-> host, costed by the cost model) and
        the host blocks whose fetch failed."""
        if not len(ops) or self.tier3_store is None:
            return ops.num_tokens, []
        src, dst = np.asarray(ops.src_pool), np.asarray(ops.dst_pool)
        third = np.isin(src, _THIRD_TIER) | np.isin(dst, _THIRD_TIER)
        failed = []
        for i, key in zip(np.flatnonzero(third), ops.tier3_keys):
            if int(dst[i]) == _core.PoolKind.SECONDARY.value:
                if not self.tier3_store.read([(int(ops.src_block_ids[i]), key, None)])[0]:
                    failed.append(int(ops.dst_block_ids[i]))
            else:
                self.tier3_store.write(int(ops.dst_block_ids[i]), key)
        return np.asarray(ops.num_tokens)[~third], failed

    def make_generator(self, params) -> None:
        return None

    def execute_step(self, batch, requests: list[Request], generators: list) -> list[int] | None:
        copy_tokens, _ = self._third_tier_copies(batch.copy_ops)  # a step's spills: nothing is fetched here
        scheduled = batch.requests
        if not scheduled:
            if len(copy_tokens):  # copies with nothing to compute still take their time
                self.clock.advance(self.cost_model.predict(step_shape((), copy_tokens, self.bytes_per_token)))
            return None
        self.num_steps += 1
        self.clock.advance(self.cost_model.predict(step_shape(scheduled, copy_tokens, self.bytes_per_token)))
        vocab_size = self.vocab_size
        tokens = []
        for request in requests:
            output = request.output_token_ids
            last = output[-1] if output else request.prompt_token_ids[-1]
            tokens.append(_core.simulated_token(last, len(request.prompt_token_ids) + len(output), vocab_size))
        return tokens

    def run_steps(self, scheduler: _core.Scheduler, until: float | None) -> _core.SimulatedSteps:
        """Runs ``scheduler``'s steps on the clock until, after a step, a request has finished or the clock
        has reached ``until`` (None: only a finish stops it); see kvtool._core.StepSimulator.run."""
        steps = self._simulator.run(scheduler, self.clock.seconds, math.inf if until is None else until)
        self.clock.seconds = steps.end_time
        self.num_steps += steps.num_steps
        return steps

    def take_token_times(self, request_id: int) -> np.ndarray:
        """float64: the times of the tokens ``run_steps`` gave the request since the last call for it."""
        return self._simulator.take_token_times(request_id)
