"""`kvtool simulate --replicas N --router NAME`: the simulated fleet a run replays through, and its rows."""

from __future__ import annotations

from pathlib import Path

from kvtool.fleet.fleet_rows import fleet_rows
from kvtool.fleet.routers import RouterOptions, make_router
from kvtool.fleet.simulated_fleet import SimulatedFleet


def fleet_options(flags) -> tuple[int, RouterOptions] | None:
    """(replicas, router) the fleet flags ask for; None when none is given (a single engine). A bad
    value is a ValueError naming its flag."""
    replicas, router, block_size = flags.get("replicas"), flags.get("router"), flags.get("router_block_size")
    if replicas is None and router is None and block_size is None:
        return None
    if replicas is not None and replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    return replicas or 1, RouterOptions(router or "round_robin", block_size)


def create_simulated_fleet(model, engine, replay, dataset, *, num_replicas: int, router: RouterOptions,
                           profile: str | None = None, dtype: str | None = None, cache_dir: Path | None = None,
                           llm=None, served: bool = False) -> SimulatedFleet:
    """``num_replicas`` SimulatedLLMs configured by ``engine`` (an EngineConfig), as `kvtool simulate`
    creates one (kvtool.simulate.profiles.create_simulated_llm), behind the router ``router`` asks for,
    whose record of each replica holds as many tokens as the replica's primary and host pools.
    ``llm``: the first replica when the caller made it already; ``served``: see create_simulated_llm."""
    from kvtool.simulate.profiles import create_simulated_llm
    from kvtool.simulate.simulated_llm import SimulatedLLM

    first = llm or create_simulated_llm(model, engine, replay, dataset, profile=profile, dtype=dtype,
                                        cache_dir=cache_dir, served=served)
    # The others share its plan, cost model and remote store (one store for the fleet); a simulation's host
    # pool never needs the workload's size (its budget is what is asked for).
    replicas = [first] + [SimulatedLLM(first.plan, first.cost_model, engine, tier_costs=first.executor.tier_costs,
                                       remote_index=first.executor.remote_index) for _ in range(num_replicas - 1)]
    pools = first.pool_sizes
    capacity = (pools.num_primary_blocks + pools.num_secondary_blocks) * pools.tokens_per_block
    return SimulatedFleet(replicas, make_router(router, num_replicas, block_size=pools.tokens_per_block,
                                                capacity_tokens=[capacity] * num_replicas))


def simulated_fleet_rows(result, fleet: SimulatedFleet, summary) -> list[dict]:
    """The fleet's summary row and each replica's (kvtool.fleet.fleet_rows), with each replica's busy time."""
    engine = fleet.engine
    columns = [{"busy_s": busy, "num_steps": steps} for busy, steps in zip(engine.busy_seconds, engine.num_steps)]
    stats = [engine.replica_stats(replica) for replica in range(len(fleet.replicas))]
    return fleet_rows(result.row, result.requests, stats, summary, replica_columns=columns)
