"""`kvtool simulate` (a bench run with the forward replaced by a step cost model), `kvtool calibrate`
(measure that cost model for a plan on this machine, or estimate it for a device not at hand) and
`kvtool explain` (why a report's blocks were missed, with simulated what-ifs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvtool.bench.scenario import load_scenario, scenario_from_document, sweep_variants
from kvtool.cli import app
from kvtool.cli import bench as bench_command
from kvtool.cli.build import DType
from kvtool.cli.user_errors import user_errors
from kvtool.cli.help import KvtoolCommand
from kvtool.cli.typer_options import flag, flags_of, toggle, with_flags
from kvtool.flags import FLEET_FLAGS, MODEL, RUN_FLAGS, SIMULATED_ENGINE_FLAGS, FlagValues
from kvtool.signals import stop_signals
from kvtool.simulate.published import DEVICES

SIMULATION = "Simulation"

Profile = Annotated[str | None, flag(
    "profile", f"The step cost model: {' | '.join(DEVICES)} (estimated from published figures), a file from "
    "`kvtool calibrate`, or by default the plan's calibration on this machine.", SIMULATION)]
SimulatedDType = Annotated[DType | None, flag(
    "dtype", "Weight and activation dtype of a --model (a build option, simulated without weights; default: "
    "bfloat16 with a GPU profile, float32 with a CPU one). A --plan keeps its own.", MODEL)]
Sweep = Annotated[list[str] | None, flag(
    "sweep", "Run one variant per value: --sweep kv_host_cache_bytes=0,1GiB,4GiB (repeatable: every combination). "
    "Replaces a --config scenario's own sweep.", SIMULATION)]
SweepCapacity = Annotated[bool, toggle(
    "sweep_capacity", "Sweep the GPU pool (a quarter, half and all of the device's) and the host cache (none, then 4 "
    "times larger each up to every block the replay creates: the infinite cache) over --dataset; writes capacity.csv "
    "and capacity.png (reused-token ratio and TTFT p50 / p90 against cache capacity in tokens). --sweep "
    "max_tokens_in_paged_kv_cache=... or kv_host_cache_bytes=... gives an axis' sizes.", SIMULATION)]


Served = Annotated[bool, toggle(
    "served", "Simulate requests served by `kvtool serve` over HTTP, as `kvtool bench --endpoint` measures them: "
    "each step also costs what serving adds per request and per streamed token on this machine, measured by "
    "`kvtool calibrate --plan DIR --served`. For comparing with real servers.", SIMULATION)]


TierCost = Annotated[list[str] | None, flag(
    "tier_cost", "A third tier's cost per block instead of this machine's (results/tiers.md): --tier_cost "
    "disk=80us,7GB/s (a fetch: latency, bandwidth), disk.spill=0us,10GB/s (the step's share of a spill), "
    "remote.lookup=300us (repeatable).", SIMULATION)]


@app.command(cls=KvtoolCommand)
@with_flags
def simulate(engine: FlagValues = flags_of(SIMULATED_ENGINE_FLAGS), run: FlagValues = flags_of(RUN_FLAGS),
             profile: Profile = None, dtype: SimulatedDType = None, sweep: Sweep = None,
             sweep_capacity: SweepCapacity = False, fleet: FlagValues = flags_of(FLEET_FLAGS),
             tier_cost: TierCost = None, served: Served = False) -> None:
    """Replay a dataset through kvtool's scheduler and KV cache with a step cost model instead of the model:
    the same reports as `kvtool bench`, marked simulated, in seconds. A --model is simulated from its
    shapes with the build options asked for: no weights are written or read. --replicas N simulates a
    fleet behind --router; --search finds the cheapest fleet that meets --slo."""
    from kvtool.fleet.fleet_run import create_simulated_fleet, fleet_options, simulated_fleet_rows
    from kvtool.reports.sweep_table import plot_sweep, print_sweep
    from kvtool.simulate.profiles import create_simulated_llm, profile_dtype, source_plan
    from kvtool.simulate.tier_costs import tier_costs

    flags = engine | run
    console = Console(stderr=True)
    dtype = dtype.value if dtype is not None else None
    with user_errors():
        fleet_asked = fleet_options(fleet)
        costs = tier_costs(tier_cost or ())
        if tier_cost and fleet["search"]:
            raise ValueError("--tier_cost does not go with --search (its fleets use this machine's tier costs): "
                             "drop --tier_cost, or compare fleets with --replicas runs")

    def factory_quiet(model, engine_config, replay, dataset=None, *, cache_dir=None):
        return create_simulated_llm(model, engine_config, replay, dataset, profile=profile, dtype=dtype,
                                    cache_dir=cache_dir, tier_costs=costs, served=bool(served))

    def factory(model, engine_config, replay, dataset=None, *, cache_dir=None):
        llm = factory_quiet(model, engine_config, replay, dataset, cache_dir=cache_dir)
        if fleet_asked is not None:
            num_replicas, router = fleet_asked
            llm = create_simulated_fleet(model, engine_config, replay, dataset, num_replicas=num_replicas,
                                         router=router, llm=llm)
        console.print(llm.describe(), highlight=False, soft_wrap=True)
        return llm

    if fleet["search"]:
        with stop_signals() as stop, bench_command.stopped_early(console, stop), user_errors():
            if sweep:
                raise ValueError("--sweep does not go with --search: search its values instead (--search NAME=...)")
            _search(flags, fleet, console, profile=profile, dtype=dtype, stop=stop, served=bool(served))
        return

    def plan_resolver(variant):
        # A `build:` section without a dtype builds in the profile's device's (bfloat16 on a GPU).
        options = variant.build_options(dtype=profile_dtype(profile))
        return source_plan(variant.plan, variant.model, options, cache_dir=flags["plan_cache_dir"], dtype=dtype)

    with stop_signals() as stop, bench_command.stopped_early(console, stop):  # SIGTERM stops as Ctrl-C does
        with user_errors():
            reporting = bench_command.report_outputs(flags)
            bench_command.check_plan_or_model(flags)
            if sweep_capacity:
                scenario = _sweep_scenario(_capacity_variants(sweep or [], flags, factory_quiet), flags,
                                           "--sweep_capacity")
            else:
                scenario = (_sweep_scenario(sweep_variants(sweep), flags, " ".join(f"--sweep {s}" for s in sweep))
                            if sweep else None)
            if fleet_asked is not None and (scenario is not None or flags["config"] is not None):
                raise ValueError("--replicas and --router run one fleet over --dataset, not a --config or --sweep: "
                                 "run each fleet on its own (`kvtool compare` puts them side by side), or --search")
            if scenario is not None or flags["config"] is not None:
                if flags["label"] is not None:
                    raise ValueError("--label names a single run; a sweep's variants are labelled by their values")
                rows, interrupted, written, failure = bench_command.run_scenario(
                    flags, console, llm_factory=factory, scenario=scenario, plan_resolver=plan_resolver,
                    summary=reporting.summary)
            else:
                if flags["set"]:
                    raise ValueError("--set overrides a scenario value: it needs --config FILE.yaml")
                rows_of = None if fleet_asked is None else (
                    lambda result, target: simulated_fleet_rows(result, target, reporting.summary))
                rows, interrupted, written, failure = bench_command.run_single(flags, console, llm_factory=factory,
                                                                               summary=reporting.summary,
                                                                               rows_of=rows_of)

    def sweep_report(rows, wide):
        if sweep_capacity:
            first = rows[0]
            title = (f"{first.get('model')} on {Path(str(first.get('dataset'))).name} (--mode {first.get('mode')}, "
                     f"--time_scale {first.get('time_scale')})\n"
                     f"{summary_title(rows).removeprefix('kvtool simulate summary: ')}")
            return _capacity_report(rows, Path(written[-1]).parent, wide, title=title)
        if len(rows) < 2 or fleet_asked is not None:
            return []
        print_sweep(rows, wide)
        return [plot_sweep(rows, Path(written[-1]).parent / "sweep.png")]

    bench_command.report_run(rows, interrupted, written, failure, console, more_tables=sweep_report,
                             reporting=reporting, title=summary_title(rows), stop=stop)


def _search(flags: FlagValues, fleet: FlagValues, console: Console, *, profile, dtype, stop, served: bool) -> None:
    """--search: the checks, the search (kvtool.fleet.slo_search) through simulated fleets, its table and files."""
    from kvtool.bench.runner import default_output_dir
    from kvtool.cli.paths import check_writable_dir
    from kvtool.fleet.fleet_search import FleetSearch, print_search, write_search
    from kvtool.fleet.search_space import parse_search
    from kvtool.fleet.slo_search import search
    from kvtool.workloads.datasets import load_dataset

    reporting = bench_command.report_outputs(flags)
    slo = reporting.summary.slo
    if slo is None or not slo.percentiles:
        raise ValueError("--search looks for the cheapest fleet meeting percentile objectives: give them with --slo, "
                         "e.g. --slo ttft_p90=2s,tpot_p90=80ms (bounds on every request, ttft=500ms, only report "
                         "attainment)")
    bench_command.check_plan_or_model(flags)
    if flags["dataset"] is None or (flags["plan"] is None and flags["model"] is None):
        raise ValueError("--search replays --dataset FILE.jsonl through fleets of --plan DIR or --model preset:NAME: "
                         "give both")
    for name in ("config", "label", "set"):
        if flags[name]:
            raise ValueError(f"--{name} does not go with --search: each configuration searched is labelled by its "
                             "values and replays --dataset")
    if fleet["router"] is not None and any(spec.startswith("router=") for spec in fleet["search"]):
        raise ValueError("--router is given and searched: drop --router or its --search")
    space = parse_search(fleet["search"], replicas=fleet["replicas"], given=flags.config_flags())
    output_dir = (Path(flags["output"]) if flags["output"] is not None
                  else default_output_dir(f"{Path(flags['dataset']).stem}-search"))
    check_writable_dir(output_dir, "--output")
    runs = FleetSearch(flags, fleet, load_dataset(flags["dataset"]), output_dir, reporting.summary, profile=profile,
                       dtype=dtype, served=served)
    console.print(f"searching {space.num_configurations} configurations ({len(space.settings)} settings x "
                  f"{len(space.replica_counts)} replica counts) for {slo.describe()}", highlight=False)
    tried = []

    def on_tried(one) -> None:
        tried.append(one)
        console.print(f"  {runs.progress_line(one)}", highlight=False, soft_wrap=True)

    try:
        result = search(space.settings, space.replica_counts, runs.evaluate, on_tried=on_tried)
    except BaseException as error:  # what was run is written before the interruption or the error is reported
        for path in write_search(output_dir, tried, runs.rows, slo):
            console.print(f"wrote {path}", highlight=False)
        if not isinstance(error, KeyboardInterrupt):
            raise
        console.print(f"[bold yellow]interrupted[/] ({stop.name}): the files hold the {len(tried)} configurations "
                      "run", highlight=False)
        raise typer.Exit(stop.exit_code) from None
    print_search(result, slo, Console(width=max(Console().width, 150)))
    for path in write_search(output_dir, result.tried, runs.rows, slo):
        console.print(f"wrote {path}", highlight=False)


def summary_title(rows) -> str:
    """The summary table's title says the figures are simulated, and by which cost model."""
    profiles = ", ".join(sorted({str(row.get("cost_profile")) for row in rows}))
    return f"kvtool simulate summary: simulated, cost profile {profiles}"


def _sweep_scenario(variants: list[dict], flags: FlagValues, source: str):
    """The scenario of a sweep's ``variants`` (``source``: the flags that made them, for errors): the --config
    file's with its variants replaced, or one over --dataset."""
    given = flags.config_flags()
    swept = {key for variant in variants for key in variant if key != "label"}
    clash = sorted(swept & set(given))
    if clash:
        raise ValueError(f"--{clash[0]} is given and swept: drop --{clash[0]} or its --sweep")
    plan, model, dataset = flags["plan"], flags["model"], flags["dataset"]
    if flags["config"] is not None:
        return load_scenario(flags["config"], sets=flags["set"] or [], model=model, plan=plan, dataset=dataset,
                             bench_overrides=given, sweep=variants)
    if dataset is None:
        raise ValueError("give --dataset FILE.jsonl (or --config) to sweep over")
    if plan is None and model is None:
        raise ValueError("give --plan DIR (from `kvtool build`) or --model preset:NAME")
    document = {"name": Path(dataset).stem, "dataset": {"path": str(dataset)}, "sweep": variants}
    return scenario_from_document(document, Path(source), model=model, plan=plan, bench_overrides=given)


def _capacity_variants(sweep: list[str], flags: FlagValues, make_llm) -> list[dict]:
    """--sweep_capacity's variants (kvtool.simulate.capacity), sized from the pools a simulation of --dataset
    with the flags given has and the blocks its replay can create."""
    from kvtool.flags import configs
    from kvtool.simulate.capacity import GPU_FLAG, HOST_FLAG, capacity_variants, probe_pools
    from kvtool.workloads.datasets import load_dataset

    if flags["config"] is not None:
        raise ValueError("--sweep_capacity sweeps the cache sizes over --dataset: drop --config")
    if flags["dataset"] is None:
        raise ValueError("give --dataset FILE.jsonl to --sweep_capacity (a trace: `kvtool dataset import`)")
    tier = next((f"--{name}" for name in ("kv_disk_cache_bytes", "kv_remote_cache_bytes", "kv_remote_cache")
                 if flags[name]), None)
    if tier is not None:
        raise ValueError(f"{tier}: --sweep_capacity sweeps the GPU pool and the host tier, which a third tier needs "
                         "(its host-less points cannot have one): sweep the third tier's size with --sweep "
                         "kv_disk_cache_bytes=0,1TiB,... at a fixed --kv_host_cache_bytes instead")
    if flags[HOST_FLAG] is not None:
        raise ValueError(f"--{HOST_FLAG} is given and --sweep_capacity sweeps it: drop --{HOST_FLAG}, or give its "
                         f"sizes with --sweep {HOST_FLAG}=0,64GiB,...")
    explicit = {}
    for assignment in sweep:
        name = assignment.partition("=")[0].strip()
        if name not in (GPU_FLAG, HOST_FLAG):
            raise ValueError(f"--sweep {assignment}: --sweep_capacity sweeps only {GPU_FLAG} and {HOST_FLAG}; drop "
                             "it, or run a plain --sweep without --sweep_capacity")
        explicit[name] = sweep_variants([assignment])
    gpu_fixed = flags[GPU_FLAG] is not None
    if gpu_fixed and GPU_FLAG in explicit:
        raise ValueError(f"--{GPU_FLAG} is given and swept: drop --{GPU_FLAG} or its --sweep")
    engine, replay = configs(flags.config_flags())
    dataset = load_dataset(flags["dataset"])
    llm = make_llm(str(flags["plan"] or flags["model"]), engine, replay, dataset, cache_dir=flags["plan_cache_dir"])
    try:
        probe = probe_pools(llm, engine, replay, dataset)
    finally:
        llm.shutdown()
    return capacity_variants(probe, gpu_fixed=gpu_fixed, explicit=explicit)


def _capacity_report(rows, directory: Path, console: Console, *, title: str) -> list[Path]:
    """--sweep_capacity's table, capacity.csv and capacity.png."""
    from kvtool.simulate.capacity import CAPACITY_CSV, CAPACITY_PNG, capacity_points, plot_capacity, print_capacity
    from kvtool.simulate.capacity import write_capacity_csv

    points = capacity_points(rows)
    print_capacity(points, console, title=title)
    return [write_capacity_csv(points, directory / CAPACITY_CSV),
            plot_capacity(points, directory / CAPACITY_PNG, title=title)]


@app.command(cls=KvtoolCommand)
@with_flags
def calibrate(
    source: FlagValues = flags_of(("plan", "model")),
    device: Annotated[str | None, flag("device", f"Estimate for {' | '.join(DEVICES)} from published figures "
                                       "instead of measuring here (labelled estimated).")] = None,
    quick: Annotated[bool, flag("quick", "A small grid (seconds, rougher): for tests and a first look.")] = False,
    served: Annotated[bool, flag("served", "Also measure what `kvtool serve` adds to each request and each streamed "
                                 "token here: starts a kvtool serve of the plan, probes it with `kvtool bench "
                                 "--endpoint` (half a minute) and fits the costs `kvtool simulate --served` adds.")
                      ] = False,
    output: Annotated[Path | None, flag("output", "Where to write the cost model (default: beside the plan, "
                                        "PLAN/cost_models/<device>.json).")] = None,
) -> None:
    """Measure what an engine step of the plan costs on this machine over a grid of step shapes, fit the
    step cost model `kvtool simulate` uses, and save it beside the plan (or estimate it with --device)."""
    from kvtool.plan import BuildOptions, resolve_model
    from kvtool.runtime.device import default_dtype
    from kvtool.simulate.cost_model import save_profile

    console = Console(stderr=True)
    plan, model = source["plan"], source["model"]
    with user_errors():
        if (plan is None) == (model is None):
            raise ValueError("give --plan DIR (from `kvtool build`) or --model preset:NAME")
        if device is not None and served:
            raise ValueError("--served measures a real kvtool serve on this machine; --device estimates another "
                             "device from published figures: drop one of them")
        if device is not None and device.lower() not in DEVICES:
            raise ValueError(f"--device {device}: published figures are known for {', '.join(DEVICES)}")
        # A --model is built as bench and simulate build it on this machine, so that they find its calibration.
        built = resolve_model(str(plan if plan is not None else model), options=BuildOptions(dtype=default_dtype()))
        if device is not None:
            from kvtool.simulate.published import estimate

            cost_model = estimate(built, device.lower())
        else:
            cost_model, limits = _measure(built, quick, console)
            if served:
                cost_model = _measure_served(built, cost_model, limits, quick, console)
        if output is not None:
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(cost_model.to_json(), encoding="utf-8")
            path = output
        else:
            path = save_profile(cost_model, built.path)
    table = Table(title=f"step cost model: {cost_model.name}")
    table.add_column("term")
    table.add_column("cost", justify="right")
    for term, value in cost_model.describe_terms():
        table.add_row(term, value)
    Console().print(table)
    print(cost_model.source)
    if cost_model.fit is not None:
        print(cost_model.fit.describe())
    if cost_model.served is not None:
        print(cost_model.served.describe())
    console.print(f"wrote {path}", highlight=False)


def _measure(plan, quick: bool, console: Console):
    from kvtool import LLM
    from kvtool.config import KvCacheConfig
    from kvtool.runtime.device import free_device_memory_bytes
    from kvtool.simulate.calibrate import QUICK_GRID, CalibrationGrid, fit, measure

    grid = QUICK_GRID if quick else CalibrationGrid()
    # A host pool for the copies; block reuse on for the cached-prefix points.
    llm = LLM(model=plan, kv_cache_config=KvCacheConfig(host_cache_size=64 * 2**20))
    try:
        # What a simulated run on this device sizes its pools from: the memory free after the weights.
        free_bytes = free_device_memory_bytes(llm.device) + llm.pool_sizes.num_primary_blocks * llm.pool_sizes.block_bytes
        with console.status("calibrating") as status:
            calibration = measure(llm, grid, on_point=lambda what: status.update(f"calibrating: {what}"))
    finally:
        llm.shutdown()
    source = (f"calibrated on {llm.device_description}: {len(calibration.steps)} engine steps and "
              f"{len(calibration.copies)} copy batches ({'quick' if quick else 'full'} grid)")
    model = fit(calibration, device=llm.device_description, plan_digest=plan.manifest.get("plan_digest"),
                source=source, details={"grid": "quick" if quick else "full", "free_memory_bytes": free_bytes})
    return model, (llm.max_batch_size, llm.max_seq_len)


def _measure_served(plan, cost_model, limits: tuple[int, int], quick: bool, console: Console):
    from dataclasses import replace

    from kvtool.bench.served_probe import QUICK_PROBE, ServedProbe, measure_served

    max_batch_size, max_seq_len = limits
    with console.status("probing kvtool serve") as status:
        served = measure_served(plan, cost_model, QUICK_PROBE if quick else ServedProbe(),
                                max_batch_size=max_batch_size, max_seq_len=max_seq_len, on_status=status.update)
    return replace(cost_model, served=served)


@app.command(cls=KvtoolCommand)
def explain(
    report: Annotated[Path, typer.Argument(help="A report directory (or its summary.csv) from kvtool bench or "
                                                "simulate.", show_default=False)],
    label: Annotated[str | None, flag("label", "Only this variant.")] = None,
    profile: Profile = None,
) -> None:
    """Say in a few sentences why a report's requests missed the cache, and what a bigger host cache or
    primary pool would change, each what-if simulated on the report's own dataset and configuration."""
    from kvtool.bench.explain import explain as explain_report

    with user_errors():
        paragraphs = explain_report(report, profile=profile, label=label)
    console = Console()
    for sentences in paragraphs:
        console.print(" ".join(sentences), highlight=False)
        console.print()
