"""Which cost model a simulation uses, and the SimulatedLLM a bench run or sweep gets for a plan."""

from __future__ import annotations

from pathlib import Path

from kvtool.errors import KvtoolError
from kvtool.simulate.cost_model import CostModel, load_profile, profile_path
from kvtool.simulate.published import DEVICES, estimate


def this_device() -> str:
    """The description reports give this machine's default device ('cpu: ...' or 'cuda: ...')."""
    from kvtool.runtime.device import default_device, describe_device

    return describe_device(default_device())


def resolve_profile(spec: str | None, plan) -> CostModel:
    """``spec``: None (the plan's calibration for this machine's device), a device of DEVICES
    (estimated from published figures), or a cost model file."""
    if spec is None:
        path = profile_path(plan.path, this_device())
        if not path.is_file():
            raise KvtoolError(
                f"no cost model of {this_device()} for the plan {plan.path}: run `kvtool calibrate --plan {plan.path}` "
                f"first (a minute or two), or give --profile {'|'.join(DEVICES)} for an estimate from published "
                "figures, or --profile FILE.json (a calibration of another plan or device)")
        return load_profile(path)
    if spec.lower() in DEVICES:
        return estimate(plan, spec.lower())
    path = Path(spec)
    if not path.is_file():
        raise KvtoolError(f"--profile {spec}: neither a device ({', '.join(DEVICES)}) nor a cost model file: give "
                          "one of those devices, or a file that `kvtool calibrate` wrote (PLAN/cost_models/*.json)")
    return load_profile(path)


def create_simulated_llm(model: str, config, dataset=None, *, profile: str | None = None,
                         cache_dir: Path | None = None):
    """What kvtool.bench.runner.create_llm is for a real run: the plan (built on the fly for a preset or
    checkpoint), a SimulatedLLM over it with the bench flags and the profile's cost model."""
    from kvtool.bench.runner import bench_plan
    from kvtool.simulate.llm import SimulatedLLM

    plan, num_workload_blocks = bench_plan(model, config, dataset, cache_dir=cache_dir)
    return SimulatedLLM(plan, resolve_profile(profile, plan), num_workload_blocks=num_workload_blocks,
                        **config.llm_kwargs())
