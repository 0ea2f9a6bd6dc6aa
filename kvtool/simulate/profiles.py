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
        from kvtool.simulate.shapes import PresetShapes

        if isinstance(plan, PresetShapes):
            raise KvtoolError(
                f"{plan.name} is simulated from its shapes (it is not built here, so it has no calibration): give "
                f"--profile {'|'.join(DEVICES)} for an estimate from published figures, or --profile FILE.json "
                f"(`kvtool calibrate --model {plan.name}` builds it and writes one)")
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


def _unbuilt_preset(model: str, options, cache_dir: Path | None):
    """The preset's shapes when its plan with these options is not built (None otherwise)."""
    from kvtool.plan.format import PLAN_FILE
    from kvtool.plan.load import preset_plan_dir
    from kvtool.simulate.shapes import PresetShapes, is_preset

    if is_preset(model) and not (preset_plan_dir(model, options, cache_dir) / PLAN_FILE).is_file():
        return PresetShapes.of(model, options)
    return None


def simulation_plan(model, config, dataset=None, *, cache_dir: Path | None = None):
    """(plan, num_workload_blocks) as kvtool.bench.runner.bench_plan gives them, except that a preset
    not built yet is simulated from its shapes (PresetShapes) instead of being built."""
    from kvtool.bench.runner import bench_plan, build_options, workload_blocks
    from kvtool.simulate.shapes import PresetShapes

    if not isinstance(model, PresetShapes):
        model = _unbuilt_preset(str(model), build_options(config), cache_dir) or model
    if isinstance(model, PresetShapes):
        return model, workload_blocks(model, config, dataset)
    return bench_plan(model, config, dataset, cache_dir=cache_dir)


def simulation_variant_plan(variant, cache_dir: Path | None = None):
    """A scenario variant's plan for a simulation: as kvtool.bench.sweep.resolve_variant_plan, but a
    preset not built with the variant's build options is simulated from its shapes, not built."""
    from kvtool.bench.sweep import resolve_variant_plan, variant_build_options

    if variant.plan is None:
        shapes = _unbuilt_preset(variant.model, variant_build_options(variant), cache_dir)
        if shapes is not None:
            return shapes
    return resolve_variant_plan(variant, cache_dir)


def create_simulated_llm(model: str, config, dataset=None, *, profile: str | None = None,
                         cache_dir: Path | None = None):
    """What kvtool.bench.runner.create_llm is for a real run: the plan (see simulation_plan) and a
    SimulatedLLM over it with the bench flags and the profile's cost model."""
    from kvtool.simulate.llm import SimulatedLLM

    plan, num_workload_blocks = simulation_plan(model, config, dataset, cache_dir=cache_dir)
    return SimulatedLLM(plan, resolve_profile(profile, plan), num_workload_blocks=num_workload_blocks,
                        **config.llm_kwargs())
