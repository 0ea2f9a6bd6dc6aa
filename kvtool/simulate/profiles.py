"""Which cost model a simulation uses, what it simulates (a built plan, or a model's shapes with the
build options asked for), and the SimulatedLLM a bench run or sweep replays through. Nothing here builds a plan
or reads weights: a simulation of a 16 GB model writes and reads none of them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvtool.errors import KvtoolError, PlanError
from kvtool.simulate.cost_model import CostModel, load_profile, profile_path
from kvtool.simulate.published import DEVICES, estimate


def this_device() -> str:
    """The description reports give this machine's default device ('cpu: ...' or 'cuda: ...')."""
    from kvtool.runtime.device import default_device, describe_device

    return describe_device(default_device())


def _profile_file(spec: str) -> Path:
    path = Path(spec)
    if not path.is_file():
        raise KvtoolError(f"--profile {spec}: neither a device ({', '.join(DEVICES)}) nor a cost model file: give "
                          "one of those devices, or a file that `kvtool calibrate` wrote (PLAN/cost_models/*.json)")
    return path


def profile_dtype(spec: str | None) -> str:
    """The dtype a model is simulated in when --dtype is not given: the one a run on the profile's device
    builds it in (kvtool.runtime.device.default_dtype): bfloat16 on a GPU (h100, h200, l40s, a100, or
    a calibration made on a GPU), float32 on a CPU; without a profile, this machine's."""
    if spec is None:
        from kvtool.runtime.device import default_dtype

        return default_dtype()
    device = "cuda" if spec.lower() in DEVICES else load_profile(_profile_file(spec)).device
    return "float32" if device.startswith("cpu") else "bfloat16"


def resolve_profile(spec: str | None, plan) -> CostModel:
    """``spec``: None (the plan's calibration for this machine's device), a device of DEVICES
    (estimated from published figures), or a cost model file."""
    if spec is None:
        from kvtool.simulate.shapes import ModelShapes

        if isinstance(plan, ModelShapes):
            options = plan.build_options
            raise KvtoolError(
                f"{plan.name} is simulated from its shapes (it is not built here with these options, so it has no "
                f"calibration): give --profile {'|'.join(DEVICES)} for an estimate from published figures, or "
                f"--profile FILE.json; or measure one: `kvtool build --model {plan.name} --dtype {options.dtype} "
                f"--tokens_per_block {options.tokens_per_block} --output PLAN`, `kvtool calibrate --plan PLAN`, "
                "then `kvtool simulate --plan PLAN`")
        path = profile_path(plan.path, this_device())
        if not path.is_file():
            raise KvtoolError(
                f"no cost model of {this_device()} for the plan {plan.path}: run `kvtool calibrate --plan {plan.path}` "
                f"first (a minute or two), or give --profile {'|'.join(DEVICES)} for an estimate from published "
                "figures, or --profile FILE.json (a calibration of another plan or device)")
        return load_profile(path)
    if spec.lower() in DEVICES:
        return estimate(plan, spec.lower())
    return load_profile(_profile_file(spec))


def built_plan(model, dtype: str | None = None):
    """A plan directory (or Plan) as built: plan.json and the weights file's header are read and checked,
    the weights are not (nor hashed). A --dtype other than the plan's is refused."""
    from kvtool.plan import Plan, load_plan

    plan = model if isinstance(model, Plan) else load_plan(model, verify_checksum=False)
    built = plan.build_options.dtype
    if dtype is not None and dtype != built:
        raise KvtoolError(
            f"--dtype {dtype}: the plan {plan.path} was built with --dtype {built}, and a plan is simulated as built: "
            f"drop --dtype, rebuild it with `kvtool build --dtype {dtype}`, or simulate its model with --model "
            f"and --dtype {dtype} (from its shapes: no weights written)")
    return plan


def simulated_model(model: str, options, cache_dir: Path | None = None):
    """A preset, checkpoint or GGUF file as a simulation with these build options sees it, never building
    it: the plan built with them in the plan cache if there is one (its calibrations lie beside it; see
    built_plan), else its shapes (kvtool.simulate.shapes.ModelShapes)."""
    from kvtool.models.gguf import is_gguf_source
    from kvtool.plan.format import PLAN_FILE
    from kvtool.plan.load import cached_plan_dir
    from kvtool.simulate.shapes import ModelShapes

    plan_dir = cached_plan_dir(model, options, cache_dir)
    if (plan_dir / PLAN_FILE).is_file():
        try:
            return built_plan(plan_dir)
        except PlanError:
            pass  # a broken cached plan: the shapes serve as well (a real run rebuilds it)
    if is_gguf_source(model):
        raise KvtoolError(
            f"{model} is not built with these options, and a GGUF file's shapes come from its plan: build it once "
            f"(`kvtool build --model {model} --dtype {options.dtype} --tokens_per_block {options.tokens_per_block} "
            "--output PLAN`), then `kvtool simulate --plan PLAN`")
    return ModelShapes.of(model, options)


def source_plan(plan_dir: Path | None, model: str | None, options, *, cache_dir: Path | None = None,
                dtype: str | None = None):
    """A scenario variant's plan for a simulation: its `plan:` directory as built (built_plan), or its `model:`
    with ``options`` (its `build:` options; simulated_model) in ``dtype`` where given (--dtype)."""
    if plan_dir is not None:
        return built_plan(plan_dir, dtype)
    return simulated_model(model, options if dtype is None else dataclasses.replace(options, dtype=dtype), cache_dir)


def create_simulated_llm(model, engine, replay=None, dataset=None, *, profile: str | None = None,
                         dtype: str | None = None, cache_dir: Path | None = None, tier_costs=None,
                         served: bool = False):
    """What kvtool.bench.runner.create_llm is for a real run, without building: a SimulatedLLM configured by
    ``engine`` (an EngineConfig), with the profile's cost model, over a plan directory as built (built_plan),
    or a preset, checkpoint or GGUF file with the build options ``engine`` asks for (simulated_model), in
    ``dtype``, else the one the profile's device implies (profile_dtype). With ``dataset`` (replayed as
    ``replay``) and a host cache, told the most KV blocks the replay can create, as a real run is. A third
    tier costs ``tier_costs`` (kvtool.simulate.tier_costs; None: this machine's). ``served``: each step costs
    what `kvtool serve` adds around it too (CostModel.as_served: the profile's `kvtool calibrate --served`)."""
    from kvtool.plan.load import is_built_plan
    from kvtool.plan.load import on_the_fly_build_options
    from kvtool.simulate.shapes import ModelShapes
    from kvtool.simulate.simulated_llm import SimulatedLLM
    from kvtool.workloads.blocks import workload_blocks

    if replay is not None and replay.sampled:
        raise ValueError(f"--temperature {replay.temperature:g}: kvtool simulate's cost model times greedy steps, and "
                         "sampling is not in it (on a CPU it adds 2-6% to a decode step: results/sampled_decode.md); "
                         "drop --temperature, --top_p and --top_k, or measure sampled runs with kvtool bench")
    if isinstance(model, ModelShapes):
        plan = model
    elif is_built_plan(model):
        plan = built_plan(model, dtype)
    else:
        plan = simulated_model(str(model), on_the_fly_build_options(engine, dtype=dtype or profile_dtype(profile)),
                               cache_dir)
    cost_model = resolve_profile(profile, plan)
    return SimulatedLLM(plan, cost_model.as_served() if served else cost_model, engine, tier_costs=tier_costs,
                        num_workload_blocks=workload_blocks(plan, engine, replay, dataset))
