"""SimulatedLLM: what `kvtool simulate` replays a dataset through. It has a real plan (or a model's shapes,
kvtool.simulate.shapes), KV pools sized as a real run on the profile's device would size them, and an
engine assembled as kvtool.LLM's is, whose steps a CostModelExecutor runs; no model is loaded."""

from __future__ import annotations

from kvtool.config import EngineConfig
from kvtool.plan import Plan
from kvtool.runtime.assemble import assemble_engine
from kvtool.simulate.cost_model import CostModel
from kvtool.simulate.executor import CostModelExecutor, SimulatedClock
from kvtool.simulate.shapes import ModelShapes
from kvtool.simulate.simulated_tier import KeyIndex
from kvtool.simulate.tier_costs import TierCosts
from kvtool.simulate.tier_costs import tier_costs as default_tier_costs


class SimulatedLLM:
    """A bench target (kvtool.bench.target.Target) whose engine runs on a simulated clock: ``clock`` is
    the simulation's, and the bench takes it instead of the wall clock."""

    endpoint = None

    def __init__(self, plan: Plan | ModelShapes, cost_model: CostModel, config: EngineConfig | None = None, *,
                 num_workload_blocks: int | None = None, tier_costs: TierCosts | None = None,
                 remote_index: KeyIndex | None = None) -> None:
        """``tier_costs``: a third tier's (None: this machine's); ``remote_index``: the remote store of
        another replica, shared (None: a new one, if the configuration asks for a remote tier)."""
        self.plan = plan
        self.cost_model = cost_model
        self.config = config or EngineConfig()
        self.clock = SimulatedClock()
        self.tokenizer = plan.tokenizer
        self.executor = CostModelExecutor(cost_model, self.clock, vocab_size=plan.model_config.vocab_size,
                                          tier_costs=tier_costs or default_tier_costs(), remote_index=remote_index)
        self.engine, limits, self.pool_sizes = assemble_engine(plan, self.config, self.executor, self.clock,
                                                               num_workload_blocks=num_workload_blocks)
        self.max_batch_size, self.max_num_tokens, self.max_seq_len = limits
        self.device_description = f"{cost_model.device} (simulated: {cost_model.name})"
        self.engine_name = f"kvtool simulate ({cost_model.name})"  # every request row says it was simulated
        self.report_columns = {"simulated": True, "cost_profile": cost_model.name,
                               "cost_profile_estimated": cost_model.estimated, "cost_profile_source": cost_model.source}
        store = self.executor.tier3_store
        if store is not None:
            self.report_columns["tier_costs"] = self.executor.tier_costs.describe(store.tier)

    def describe(self) -> str:
        """One line: what is simulated (a plan, or a model's shapes), in which dtypes, on which cost model."""
        opts = self.plan.build_options
        what = (f"{self.plan.name} from its shapes (no weights written or read)" if isinstance(self.plan, ModelShapes)
                else f"the plan {self.plan.path} (its weights are not read)")
        store = self.executor.tier3_store
        tier = ("" if store is None else f"; a simulated {store.tier} tier of {store.index.num_blocks} blocks (no "
                f"bytes stored), {self.executor.tier_costs.describe(store.tier)}")
        return (f"simulating {what}: {opts.dtype} weights, {opts.resolved_kv_cache_dtype} KV cache in blocks of "
                f"{opts.tokens_per_block} tokens; cost profile {self.cost_model.name}{tier}")

    def shutdown(self) -> None:
        self.engine = None
