"""One bench run: replay a dataset through a target (kvtool.bench.target), write the per-request CSV,
build the summary row."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvtool.bench.precheck import check_requests
from kvtool.bench.replay import Replayer, check_arrival_times
from kvtool.bench.target import Target, TargetPlan
from kvtool.config import EngineConfig, ReplayOptions
from kvtool.files import FileWriteError
from kvtool.flags import as_row
from kvtool.reports.csv_report import RequestCsvWriter
from kvtool.reports.device_columns import device_columns
from kvtool.reports.metrics import RequestMetrics, SummaryOptions, request_metrics, summarize
from kvtool.runtime.request import Request
from kvtool.signals import signal_name
from kvtool.version import __version__, git_revision
from kvtool.workloads.blocks import workload_blocks
from kvtool.workloads.datasets import Dataset
from kvtool.workloads.requests import dataset_requests


@dataclass
class BenchResult:
    """A run's summary row (configuration + metrics + cache stats + device + version) and its requests."""

    row: dict
    requests: list[RequestMetrics]
    interrupted: bool
    failure: Exception | None = None  # what stopped the run early (the summary covers what finished)


def create_llm(model: str, engine: EngineConfig, replay: ReplayOptions, dataset: Dataset | None = None, *,
               cache_dir: Path | None = None):
    """kvtool.LLM for a run: a plan directory as built, or a checkpoint/preset built on the fly into
    cache_dir (kvtool.plan.load), configured by ``engine``; with the dataset and a host cache, told
    the most KV blocks the replay can create (kvtool.workloads.blocks.workload_blocks)."""
    from kvtool import LLM  # torch and the C++ extension load only when a bench really runs
    from kvtool.plan.load import engine_plan

    plan = engine_plan(model, engine, cache_dir=cache_dir)
    return LLM(model=plan, config=engine, num_workload_blocks=workload_blocks(plan, engine, replay, dataset))


DEFAULT_OUTPUT_ROOT = Path("out")  # scratch output, ignored by git (results/ holds committed results)


def default_output_dir(stem: str, now: datetime.datetime | None = None) -> Path:
    """out/<stem>-<YYYYmmdd-HHMMSS>: a run without --output never lands in a committed directory."""
    now = now or datetime.datetime.now()
    return DEFAULT_OUTPUT_ROOT / f"{stem}-{now:%Y%m%d-%H%M%S}"


def plan_columns(plan: TargetPlan) -> dict:
    """plan path, model architecture/shape fields and build options (tokens_per_block, dtype, ...)."""
    columns: dict = {"plan_path": str(plan.path)}
    for prefix, obj in (("model_", plan.model_config), ("plan_", plan.build_options)):
        for key, value in dataclasses.asdict(obj).items():
            if value is None or isinstance(value, (bool, int, float, str)):
                columns[f"{prefix}{key}"] = value
    return columns


class _ProgressBar:
    """Requests done per task. Redrawn when a request finishes, at most 10 times a second: an
    auto-refresh thread would compete with the model for the CPU (and the GIL) and show up in the
    latencies being measured, and a simulation finishes thousands of requests a second (a redraw
    costs about 0.2 ms)."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("requests"), TimeElapsedColumn(), console=console, transient=False,
                                 auto_refresh=False)
        self._last_refresh = 0.0
        self._pending: dict = {}  # task -> requests done since the last redraw (rich's advance takes a lock)

    def __enter__(self) -> _ProgressBar:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._flush()
        self.progress.refresh()
        self.progress.__exit__(*exc)

    def _flush(self) -> None:
        for task, count in self._pending.items():
            self.progress.advance(task, count)
        self._pending.clear()

    def add_task(self, description: str, total: int):
        self._flush()  # the previous task (warm-up) shows done before the next starts
        return self.progress.add_task(description, total=total)

    def advance(self, task) -> None:
        self._pending[task] = self._pending.get(task, 0) + 1
        now = time.monotonic()
        if now - self._last_refresh >= 0.1:
            self._last_refresh = now
            self._flush()
            self.progress.refresh()


@contextlib.contextmanager
def _old_objects_frozen():
    """Leaves what exists before the replay (the dataset's token ids: millions of ints, the requests)
    out of the garbage collector's passes while it runs. A full pass over them is a pause inside the
    measured latencies, and most of what `kvtool simulate` spent beside the scheduler."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_bench(target: Target, dataset: Dataset, replay: ReplayOptions, *, label: str, requests_csv: Path,
              config_columns: Mapping[str, object] | None = None, console: Console | None = None,
              summary: SummaryOptions = SummaryOptions(),
              on_request_done: Callable[[RequestMetrics], None] | None = None) -> BenchResult:
    """Replays the dataset through ``target`` (warm-up first, timed on the target's clock), appending a
    row to requests_csv as each request finishes.

    Every request is checked first (kvtool.bench.precheck: a DatasetError lists those that cannot
    run). A request the engine still refuses becomes an error row and the run goes on. A
    KeyboardInterrupt (Ctrl-C, or SIGTERM under kvtool.signals.stop_signals: ``interrupted_by``
    names it), or an error that stops the engine or the per-request file (a full disk), ends the
    replay early: the result holds what finished, interrupted=True and the error (``failure``, for
    the caller to raise once the summary is written).

    Every row says what the target reports about itself (its engine's name and endpoint, its plan,
    configuration and pools where it has them, its device). ``summary`` adds percentiles and
    service-level objectives to the summary row (--percentiles, --slo). ``on_request_done`` is called
    with each measured request's metrics once its row is written, before the replay hands over the
    next request (so a sequential replay's timings never include it).
    """
    console = console or Console(stderr=True)
    engine, engine_name, endpoint = target.engine, target.engine_name, target.endpoint
    warmup, measured = replay.split(dataset_requests(dataset, tokenizer=target.tokenizer, replay=replay))
    check_arrival_times(replay, measured)
    if not measured:
        raise ValueError(f"nothing to measure: the dataset {dataset.path} has {len(dataset)} requests and --warmup "
                         f"is {replay.warmup}; lower --warmup or use a bigger dataset")
    check_requests(warmup + measured, engine, source=str(dataset.path))
    pool_sizes = target.pool_sizes
    if pool_sizes is not None:
        for line in (pool_sizes.describe(target.device_description.split(":")[0]), *pool_sizes.notes):
            console.print(line, highlight=False, soft_wrap=True)

    replayer = Replayer(engine, replay, clock=target.clock)
    finished: list[RequestMetrics] = []
    interrupted, failure, stopped_by = False, None, None
    started_at = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    writer = RequestCsvWriter(requests_csv)
    with _old_objects_frozen(), _ProgressBar(console) as progress:
        try:
            if warmup:
                task = progress.add_task(f"{label} warm-up", len(warmup))
                replayer.run(warmup, lambda request, start: progress.advance(task), timed=False)
                if not replay.warmup_counts_in_stats:
                    engine.reset_stats()
            task = progress.add_task(label, len(measured))

            def on_finish(request: Request, bench_start: float) -> None:
                metrics = request_metrics(request, label=label, bench_start=bench_start, engine=engine_name,
                                          endpoint=endpoint)
                writer.write(metrics)
                finished.append(metrics)
                progress.advance(task)
                if on_request_done is not None:
                    on_request_done(metrics)

            replayer.run(measured, on_finish)
        except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM under kvtool.signals.stop_signals
            interrupted, stopped_by = True, signal_name(stop)
        except Exception as error:  # noqa: BLE001 - the summary of what finished is written, then it is raised
            interrupted, failure = True, error
        finally:
            try:
                writer.close()
            except FileWriteError as error:  # the rows flushed last: the file ends at its last complete row
                failure = failure or error

    row = {"label": label, "engine": engine_name, "endpoint": endpoint, "interrupted": interrupted,
           "interrupted_by": stopped_by, "run_error": None if failure is None else str(failure),
           "started_at": started_at, "dataset": str(dataset.path), "dataset_sha256": dataset.sha256,
           "num_dataset_requests": len(dataset), "num_measured_requests": len(measured),
           **(plan_columns(target.plan) if target.plan is not None else {}), **(config_columns or {}),
           **as_row(target.config, replay), "replay": replay.describe(), **target.report_columns,
           **(summary.slo.as_row() if summary.slo is not None else {})}
    # The block size in effect: the flag, else the plan's (the engine refuses a flag that contradicts the plan).
    if target.config is not None:
        row["tokens_per_block"] = target.config.tokens_per_block or row.get("plan_tokens_per_block")
    if pool_sizes is not None:
        row.update(pool_sizes.as_row())
    row.update(summarize(finished, summary).as_row())
    row.update(engine.get_stats())
    row.update(device_columns(target.device_description))
    row.update({"kvtool_version": __version__, "git_revision": git_revision(), "requests_csv": requests_csv.name})
    return BenchResult(row=row, requests=finished, interrupted=interrupted, failure=failure)
