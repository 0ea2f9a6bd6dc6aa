"""One engine, assembled one way for a plan and an EngineConfig, whatever executes its steps.

``assemble_engine`` settles the runtime limits against the plan, refuses what the plan cannot do,
sizes the KV pools from the memory the executor says they may take, starts the executor (which
creates what it needs from those sizes) and builds the Engine with the C++ cache and scheduler
configuration. kvtool.LLM passes a ModelRunner (the model's forward and sampling, real pools on a
real device); `kvtool simulate` a kvtool.simulate.executor.CostModelExecutor (a step costs what the
cost model predicts on the profile's device, no pool is allocated).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from kvtool.config import EngineConfig, KvCacheConfig, SamplingParams
from kvtool.errors import KvtoolError
from kvtool.models.llama import effective_window
from kvtool.runtime.clock import WALL_CLOCK, Clock
from kvtool.runtime.engine import Engine
from kvtool.runtime.kv_pool import BlockShape
from kvtool.runtime.pool_sizes import PoolSizes, size_pools
from kvtool.runtime.request import Request
from kvtool.runtime.tier3 import OpenedTier, open_tier, plan_identity


class PoolBudget(NamedTuple):
    """The memory an executor's KV pools may take: ``free_memory_bytes`` for the primary pool (the memory
    fraction's base), ``available_host_bytes`` for the host pool, and whether the primary pool is in host
    memory (``on_cpu``: a CPU's pool is capped by default, and shares that memory with the host pool)."""

    free_memory_bytes: int
    available_host_bytes: int
    on_cpu: bool


class RuntimeLimits(NamedTuple):
    """The per-step and per-sequence limits an engine runs with (the plan's, or lower ones asked for)."""

    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int


class Executor(Protocol):
    """What runs an engine's steps (kvtool.runtime.model_runner.ModelRunner, or a simulation's
    kvtool.simulate.executor.CostModelExecutor)."""

    def pool_budget(self, kv_cache_config: KvCacheConfig) -> PoolBudget:
        """How much memory the KV pools may take."""

    def start(self, shape: BlockShape, pool_sizes: PoolSizes, config: EngineConfig, limits: RuntimeLimits) -> None:
        """Creates what it needs to run steps (pools of these sizes, ...), before the first step."""

    def execute_step(self, batch, requests: list[Request], generators: list) -> list[int] | None:
        """Runs a kvtool._core.ScheduledBatch (its copies, then its requests): a token for each of
        ``requests`` (those of the batch that sample, in batch order; ``generators``: theirs), or None
        when the batch has no request."""

    def make_generator(self, params: SamplingParams):
        """The random generator a request samples with (None: greedy, or no sampling)."""


class AssembledEngine(NamedTuple):
    engine: Engine
    limits: RuntimeLimits
    pool_sizes: PoolSizes


def assemble_engine(plan, config: EngineConfig, executor: Executor, clock: Clock = WALL_CLOCK, *,
                    num_workload_blocks: int | None = None) -> AssembledEngine:
    """The Engine serving ``plan`` (a kvtool.plan.Plan, or a simulation's kvtool.simulate.shapes.ModelShapes)
    as ``config`` asks, its steps run by ``executor`` and timed on ``clock``. ``num_workload_blocks``: the
    most KV blocks the work ahead can create (a bench's dataset); a host cache larger than the available
    memory is then accepted when those blocks fit."""
    limits = runtime_limits(plan, config)
    check_against_plan(plan, config)
    model_config = plan.model_config
    tokens_per_block = plan.build_options.tokens_per_block
    shape = BlockShape(model_config.num_layers, tokens_per_block, model_config.num_kv_heads, model_config.head_dim,
                       plan.kv_cache_dtype)
    kv = config.kv_cache_config
    budget = executor.pool_budget(kv)
    pool_sizes = size_pools(shape.num_bytes, tokens_per_block, max_tokens=kv.max_tokens,
                            free_memory_fraction=kv.free_gpu_memory_fraction,
                            free_memory_bytes=budget.free_memory_bytes, host_cache_size=kv.host_cache_size,
                            on_cpu=budget.on_cpu, available_host_bytes=budget.available_host_bytes,
                            num_workload_blocks=num_workload_blocks)
    # The model's window is the smaller of its own and max_attention_window; one reaching past
    # max_seq_len never applies, and the cache manager keeps every block then.
    window = effective_window(model_config.sliding_window, kv.max_attention_window)
    window = window if window is not None and window < limits.max_seq_len else None
    tier = open_third_tier(plan, kv, shape, executor)
    try:
        executor.start(shape, pool_sizes, config, limits)
    except BaseException:
        if tier is not None:
            tier.store.close()
        raise
    if tier is not None:
        executor.use_tier3_store(tier.store)
    engine = Engine(
        executor, kv.to_core(tokens_per_block=tokens_per_block, num_primary_blocks=pool_sizes.num_primary_blocks,
                             num_secondary_blocks=pool_sizes.num_secondary_blocks, max_attention_window=window,
                             num_tier3_blocks=0 if tier is None else tier.num_blocks,
                             plan_digest=b"" if tier is None else tier.store.plan_digest),
        config.scheduler_config.to_core(max_batch_size=limits.max_batch_size, max_num_tokens=limits.max_num_tokens,
                                        max_seq_len=limits.max_seq_len),
        vocab_size=model_config.vocab_size, eos_token_ids=model_config.eos_token_ids,
        bytes_per_token=shape.bytes_per_token, tokenizer=plan.tokenizer, clock=clock.now,
        tier3_store=None if tier is None else tier.store)
    return AssembledEngine(engine, limits, pool_sizes)


def open_third_tier(plan, kv: KvCacheConfig, shape: BlockShape, executor) -> OpenedTier | None:
    """The third tier's store when the configuration asks for one: the executor's own where it has one
    (``open_tier3``: a simulation's index-only store), else the disk files or remote store
    (kvtool.runtime.tier3.open_tier)."""
    if not kv.has_third_tier:
        return None
    if not kv.enable_block_reuse:
        flag = ("--kv_disk_cache_bytes" if kv.disk_cache_size else
                "--kv_remote_cache" if kv.remote_cache_url is not None else "--kv_remote_cache_bytes")
        raise KvtoolError(f"{flag}: the third tier keeps blocks for reuse, which --disable_kv_cache_reuse turns "
                          "off: drop one of them")
    digest = plan_identity(plan, shape.dtype, shape.tokens_per_block)
    opener = getattr(executor, "open_tier3", open_tier)
    return opener(kv, shape.num_bytes, digest)


def runtime_limits(plan, config: EngineConfig) -> RuntimeLimits:
    """The limits asked for (None: the plan's), refused above what the plan was built for."""
    built = plan.build_options
    return RuntimeLimits(*(_limit(name, getattr(config, name), getattr(built, name))
                           for name in RuntimeLimits._fields))


def _limit(name: str, value: int | None, plan_value: int) -> int:
    if value is None:
        return plan_value
    if value < 1 or value > plan_value:
        raise ValueError(f"--{name} {value} is outside what the plan was built for (1..{plan_value}): "
                         f"rebuild with `kvtool build --{name} {value}` or choose at most {plan_value}")
    return value


def check_against_plan(plan, config: EngineConfig) -> None:
    """Refuses a block size other than the plan's, and reuse or chunking a plan without paged context
    attention cannot do."""
    opts = plan.build_options
    asked = config.tokens_per_block
    if asked is not None and asked != opts.tokens_per_block:
        # Only a plan the user built: a plan built on the fly gets the block size asked for.
        raise KvtoolError(
            f"--tokens_per_block {asked} does not match the plan {plan.path}, built with --tokens_per_block "
            f"{opts.tokens_per_block}: rebuild it with `kvtool build --tokens_per_block {asked}`, or leave "
            "--tokens_per_block out")
    if not plan.supports_kv_reuse:
        if config.kv_cache_config.enable_block_reuse:
            raise KvtoolError(
                f"the plan {plan.path} was built with --use_paged_context_fmha disable, which cannot reuse "
                "KV: rebuild with --use_paged_context_fmha enable or disable reuse (--disable_kv_cache_reuse)")
        if config.scheduler_config.enable_chunked_context:
            raise KvtoolError(
                f"the plan {plan.path} was built with --use_paged_context_fmha disable, which cannot chunk "
                "contexts: rebuild with --use_paged_context_fmha enable or drop --enable_chunked_context")

