"""Runs a scenario's variants one after the other into one summary CSV (a row per variant)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from kvtool.bench.runner import create_llm, run_bench
from kvtool.bench.scenario import Scenario, Variant
from kvtool.bench.target import Target
from kvtool.config import EngineConfig, ReplayOptions
from kvtool.reports.csv_report import SUMMARY_FILE, requests_file_name, write_summary_csv
from kvtool.reports.metrics import SummaryOptions
from kvtool.workloads.datasets import Dataset, load_dataset


@dataclass
class SweepResult:
    """The summary rows of the variants that ran, and whether a Ctrl-C cut the sweep short."""

    rows: list[dict]
    interrupted: bool
    summary_csv: Path
    failure: Exception | None = None  # the error that stopped the sweep, raised by the caller


def resolve_variant_plan(variant: Variant, plan_cache_dir: Path | None = None) -> str:
    """The plan directory of a variant: its `plan:` as is, else its `model:` built with its build options
    (kvtool.plan.resolve_model: built once per source and options, then reused from the cache)."""
    if variant.plan is not None:
        return str(variant.plan)
    from kvtool.plan import resolve_model

    return str(resolve_model(variant.model, options=variant.build_options(), cache_dir=plan_cache_dir).path)


def run_scenario(scenario: Scenario, output_dir: Path, *, console: Console | None = None,
                 llm_factory: Callable[[str, EngineConfig, ReplayOptions, Dataset], Target] = create_llm,
                 plan_resolver: Callable[[Variant], str] = resolve_variant_plan,
                 summary: SummaryOptions = SummaryOptions()) -> SweepResult:
    """Runs every variant (``scenario.repeat`` times, alternating, after ``scenario.warmup_rounds``
    unrecorded rounds); the summary CSV is rewritten
    (atomically) after each run (a row per run, ``repeat`` numbering the runs), so an
    interrupted sweep keeps the rows of the variants that finished plus the interrupted one's
    (an error that stops a variant stops the sweep: it is returned as ``failure``). ``summary``: the
    percentiles and objectives every summary row reports (--percentiles, --slo)."""
    console = console or Console(stderr=True)
    output_dir.mkdir(parents=True, exist_ok=True)
    summary_csv = output_dir / SUMMARY_FILE
    dataset_files: dict[str, Path] = {}
    rows: list[dict] = []
    plan_dirs: dict[str, str] = {}
    # Warm-up rounds (repeat 0) first, then the measured ones; alternating, so that a change in the
    # machine's load hits every variant.
    runs = [(0, variant) for _ in range(scenario.warmup_rounds) for variant in scenario.variants]
    runs += [(repeat, variant) for repeat in range(1, scenario.repeat + 1) for variant in scenario.variants]
    for repeat, variant in runs:
        key = variant.dataset.describe()
        if key not in dataset_files:
            stem = "dataset" if not dataset_files else f"dataset-{variant.label}"
            dataset_files[key] = variant.dataset.materialize(output_dir, stem)
        dataset = load_dataset(dataset_files[key])
        run = f" (run {repeat} of {scenario.repeat})" if scenario.repeat > 1 else ""
        if not repeat:
            run = " (warm-up round, not recorded)"
        console.print(f"[bold]{scenario.name}[/] variant [bold]{variant.label}[/]{run}: {variant.plan_source} "
                      f"{dict(variant.build) or ''} on {dataset.path}", highlight=False)
        try:
            if variant.label not in plan_dirs:
                plan_dirs[variant.label] = plan_resolver(variant)
            llm = llm_factory(plan_dirs[variant.label], variant.engine, variant.replay, dataset)
        except KeyboardInterrupt:
            return SweepResult(rows, True, summary_csv)
        try:
            config_columns = {"scenario": scenario.name, "scenario_file": str(scenario.path),
                              "model": variant.plan_source, "dataset_spec": key,
                              **{f"build_{k}": v for k, v in variant.build.items()}}
            if scenario.repeat > 1:
                config_columns["repeat"] = repeat
            name = variant.label if scenario.repeat == 1 else f"{variant.label}-{repeat}"
            requests_csv = output_dir / (requests_file_name(name) if repeat else f".warmup-{variant.label}.csv")
            result = run_bench(llm, dataset, variant.replay, label=variant.label, requests_csv=requests_csv,
                               config_columns=config_columns, console=console, summary=summary)
        finally:
            llm.shutdown()
        if not repeat:
            requests_csv.unlink(missing_ok=True)
            if result.interrupted:
                return SweepResult(rows, True, summary_csv, result.failure)
            continue
        rows.append(result.row)
        write_summary_csv(summary_csv, rows)
        if result.interrupted:
            return SweepResult(rows, True, summary_csv, result.failure)
    return SweepResult(rows, False, summary_csv)
