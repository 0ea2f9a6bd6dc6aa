"""SimulatedLLM: what `kvtool simulate` replays a dataset through. It has a real plan (or a model's shapes,
kvtool.simulate.shapes), KV pools sized as a real run on the profile's device would size them, and a
SimulatedEngine; no model is loaded."""

from __future__ import annotations

from kvtool.config import KvCacheConfig, SchedulerConfig
from kvtool.errors import KvtoolError
from kvtool.llm import check_against_plan, runtime_limit
from kvtool.models.llama import effective_window
from kvtool.plan import Plan
from kvtool.runtime.device import available_host_memory_bytes
from kvtool.runtime.kv_pool import BlockShape
from kvtool.runtime.pool_sizes import size_pools
from kvtool.simulate.cost_model import CostModel
from kvtool.simulate.engine import SimulatedClock, SimulatedEngine
from kvtool.simulate.shapes import ModelShapes


class SimulatedLLM:
    """A BenchLLM (kvtool.bench.interface) whose engine runs on a simulated clock: ``clock`` and
    ``sleep`` are the simulation's, and the bench takes them instead of the wall clock's."""

    def __init__(self, plan: Plan | ModelShapes, cost_model: CostModel, *, max_batch_size: int | None = None,
                 max_seq_len: int | None = None, max_num_tokens: int | None = None,
                 kv_cache_config: KvCacheConfig | None = None, scheduler_config: SchedulerConfig | None = None,
                 num_workload_blocks: int | None = None, cuda_graphs: bool = True) -> None:
        # cuda_graphs is taken for the bench flags' sake: a simulated step costs what the cost model says,
        # and a calibration times steps as the LLM runs them (with CUDA graphs on a GPU).
        del cuda_graphs
        kv_cache_config = kv_cache_config or KvCacheConfig()
        scheduler_config = scheduler_config or SchedulerConfig()
        self.plan = plan
        self.cost_model = cost_model
        opts = plan.build_options
        self.max_batch_size = runtime_limit("max_batch_size", max_batch_size, opts.max_batch_size)
        self.max_seq_len = runtime_limit("max_seq_len", max_seq_len, opts.max_seq_len)
        self.max_num_tokens = runtime_limit("max_num_tokens", max_num_tokens, opts.max_num_tokens)
        check_against_plan(plan, kv_cache_config, scheduler_config)
        config = plan.model_config
        tokens_per_block = opts.tokens_per_block
        shape = BlockShape(config.num_layers, tokens_per_block, config.num_kv_heads, config.head_dim,
                           plan.kv_cache_dtype)
        on_cpu = cost_model.device.startswith("cpu")
        # A CPU's pools come out of this machine's memory, as in a real run; a GPU's out of the device
        # memory left after the weights, which the profile records.
        free_bytes = available_host_memory_bytes() if on_cpu else int(cost_model.details.get("free_memory_bytes", 0))
        if not free_bytes:
            if kv_cache_config.max_tokens is None:
                raise KvtoolError(f"the cost model of {cost_model.device} does not say how much device memory is "
                                  "free for the KV cache: give --max_tokens_in_paged_kv_cache, or recalibrate")
            free_bytes = 1 << 62  # the pool is the size asked for
        # Nothing is allocated here: any host cache size can be simulated, whatever this machine has.
        host_bytes = max(available_host_memory_bytes(), kv_cache_config.host_cache_size + free_bytes)
        self.pool_sizes = size_pools(
            shape.num_bytes, tokens_per_block, max_tokens=kv_cache_config.max_tokens,
            free_memory_fraction=kv_cache_config.free_gpu_memory_fraction, free_memory_bytes=free_bytes,
            host_cache_size=kv_cache_config.host_cache_size, on_cpu=on_cpu, available_host_bytes=host_bytes,
            num_workload_blocks=num_workload_blocks)
        window = effective_window(config.sliding_window, kv_cache_config.max_attention_window)
        window = window if window is not None and window < self.max_seq_len else None
        sizes = self.pool_sizes
        self.clock = SimulatedClock()
        self.tokenizer = plan.tokenizer
        self.engine = SimulatedEngine(
            cost_model,
            kv_cache_config.to_core(tokens_per_block=tokens_per_block, num_primary_blocks=sizes.num_primary_blocks,
                                    num_secondary_blocks=sizes.num_secondary_blocks, max_attention_window=window),
            scheduler_config.to_core(max_batch_size=self.max_batch_size, max_num_tokens=self.max_num_tokens,
                                     max_seq_len=self.max_seq_len),
            vocab_size=config.vocab_size, bytes_per_token=shape.bytes_per_token, clock=self.clock,
            tokenizer=self.tokenizer)
        self.device_description = f"{cost_model.device} (simulated: {cost_model.name})"
        self.engine_name = f"kvtool simulate ({cost_model.name})"  # every request row says it was simulated
        self.report_columns = {"simulated": True, "cost_profile": cost_model.name,
                               "cost_profile_estimated": cost_model.estimated, "cost_profile_source": cost_model.source}

    def describe(self) -> str:
        """One line: what is simulated (a plan, or a model's shapes), in which dtypes, on which cost model."""
        opts = self.plan.build_options
        what = (f"{self.plan.name} from its shapes (no weights written or read)" if isinstance(self.plan, ModelShapes)
                else f"the plan {self.plan.path} (its weights are not read)")
        return (f"simulating {what}: {opts.dtype} weights, {opts.resolved_kv_cache_dtype} KV cache in blocks of "
                f"{opts.tokens_per_block} tokens; cost profile {self.cost_model.name}")

    def shutdown(self) -> None:
        self.engine = None
