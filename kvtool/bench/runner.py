"""One bench run: replay a dataset through an LLM, write the per-request CSV, build the summary row."""

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
from rich.table import Table

from kvtool.workloads.datasets import Dataset
from kvtool.reports.device import device_columns
from kvtool.bench.interface import BenchLLM, BenchPlan
from kvtool.reports.metrics import (ENGINE, LATENCY_METRICS, RequestMetrics, SummaryOptions, percentile_columns,
                                  request_metrics, summarize)
from kvtool.bench.config import BenchConfig
from kvtool.bench.precheck import check_requests
from kvtool.reports.repeats import as_number, group_by_label, median_row
from kvtool.bench.replay import Replayer, bench_requests
from kvtool.reports.csv_report import RequestCsvWriter, format_hit_rate
from kvtool.reports.slo import describe_bounds
from kvtool.workloads.blocks import max_num_blocks
from kvtool.files import FileWriteError
from kvtool.runtime.request import Request
from kvtool.signals import signal_name
from kvtool.units import format_bytes
from kvtool.version import __version__, git_revision


@dataclass
class BenchResult:
    """A run's summary row (configuration + metrics + cache stats + device + version) and its requests."""

    row: dict
    requests: list[RequestMetrics]
    interrupted: bool
    failure: Exception | None = None  # what stopped the run early (the summary covers what finished)


def bench_plan(model: str, config: BenchConfig, dataset: Dataset | None = None, *, cache_dir: Path | None = None):
    """(plan, num_workload_blocks) of a run: a plan directory as built, or a checkpoint/preset built on
    the fly into cache_dir with the block size and limits the flags ask for; with the dataset and a
    host cache, the most KV blocks the dataset can create (kvtool.workloads.blocks), so that a host cache
    larger than the available memory is accepted when the dataset cannot fill more than that."""
    from kvtool.plan import is_built_plan, resolve_model

    build = None if is_built_plan(model) else build_options(config)
    plan = resolve_model(model, options=build, cache_dir=cache_dir)
    return plan, workload_blocks(plan, config, dataset)


def build_options(config: BenchConfig):
    """What a checkpoint or preset is built with on the fly for this run: the block size and limits
    the flags ask for (kvtool.llm.on_the_fly_build_options)."""
    from kvtool.llm import on_the_fly_build_options

    return on_the_fly_build_options(None, config.kv_cache_config, max_batch_size=config.max_batch_size,
                                    max_seq_len=config.max_seq_len, max_num_tokens=config.max_num_tokens)


def workload_blocks(plan, config: BenchConfig, dataset: Dataset | None) -> int | None:
    """The most KV blocks the dataset's run can create, when a host cache makes it matter (else None)."""
    if dataset is None or not config.kv_cache_config.host_cache_size:
        return None
    warmup, measured = config.replay.split(bench_requests(dataset, tokenizer=plan.tokenizer))
    return max_num_blocks(warmup + measured, plan.build_options.tokens_per_block)


def create_llm(model: str, config: BenchConfig, dataset: Dataset | None = None, *,
               cache_dir: Path | None = None):
    """kvtool.LLM for a plan (see bench_plan), configured from the bench flags."""
    from kvtool import LLM  # torch and the C++ extension load only when a bench really runs

    plan, num_workload_blocks = bench_plan(model, config, dataset, cache_dir=cache_dir)
    return LLM(model=plan, num_workload_blocks=num_workload_blocks, **config.llm_kwargs())


DEFAULT_OUTPUT_ROOT = Path("out")  # scratch output, ignored by git (results/ holds committed results)


def default_output_dir(stem: str, now: datetime.datetime | None = None) -> Path:
    """out/<stem>-<YYYYmmdd-HHMMSS>: a run without --output never lands in a committed directory."""
    now = now or datetime.datetime.now()
    return DEFAULT_OUTPUT_ROOT / f"{stem}-{now:%Y%m%d-%H%M%S}"


def plan_columns(plan: BenchPlan) -> dict:
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


def run_bench(llm: BenchLLM, dataset: Dataset, config: BenchConfig, *, label: str, requests_csv: Path,
              config_columns: Mapping[str, object] | None = None, console: Console | None = None,
              clock: Callable[[], float] = time.perf_counter,
              sleep: Callable[[float], None] = time.sleep, engine_name: str = ENGINE,
              endpoint: str | None = None, summary: SummaryOptions = SummaryOptions()) -> BenchResult:
    """Replays the dataset (warm-up first), appending a row to requests_csv as each request finishes.

    Every request is checked first (kvtool.bench.precheck: a DatasetError lists those that cannot
    run). A request the engine still refuses becomes an error row and the run goes on. A
    KeyboardInterrupt (Ctrl-C, or SIGTERM under kvtool.signals.stop_signals: ``interrupted_by``
    names it), or an error that stops the engine or the per-request file (a full disk), ends the
    replay early: the result holds what finished, interrupted=True and the error (``failure``, for
    the caller to raise once the summary is written).

    ``engine_name`` and ``endpoint`` name what served the requests in every row (an endpoint's LLM,
    kvtool.bench.endpoint, has no plan or pools of its own to report). ``summary`` adds percentiles
    and service-level objectives to the summary row (--percentiles, --slo).
    """
    console = console or Console(stderr=True)
    simulation = getattr(llm, "clock", None)  # kvtool.simulate.SimulatedLLM: the run is timed on its clock
    if simulation is not None:
        clock, sleep, engine_name = simulation.now, simulation.sleep, llm.engine_name
    engine = llm.engine
    replay = config.replay
    warmup, measured = replay.split(bench_requests(dataset, tokenizer=llm.tokenizer))
    if not measured:
        raise ValueError(f"nothing to measure: the dataset {dataset.path} has {len(dataset)} requests and --warmup "
                         f"is {replay.warmup}; lower --warmup or use a bigger dataset")
    check_requests(warmup + measured, engine, source=str(dataset.path))
    pool_sizes = llm.pool_sizes
    if pool_sizes is not None:
        for line in (pool_sizes.describe(llm.device_description.split(":")[0]), *pool_sizes.notes):
            console.print(line, highlight=False, soft_wrap=True)

    replayer = Replayer(engine, replay, clock=clock, sleep=sleep)
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
           **(plan_columns(llm.plan) if llm.plan is not None else {}), **(config_columns or {}),
           **config.as_row(engine=llm.plan is not None),
           "replay": replay.describe(), **(llm.report_columns if simulation is not None else {}),
           **(summary.slo.as_row() if summary.slo is not None else {})}
    # The block size in effect: the flag, else the plan's (the LLM refuses a flag that contradicts the plan).
    if llm.plan is not None:
        row["tokens_per_block"] = config.kv_cache_config.tokens_per_block or row.get("plan_tokens_per_block")
    if pool_sizes is not None:
        row.update(pool_sizes.as_row())
    row.update(summarize(finished, summary).as_row())
    row.update(engine.get_stats())
    row.update(device_columns(llm.device_description))
    row.update({"kvtool_version": __version__, "git_revision": git_revision(), "requests_csv": requests_csv.name})
    return BenchResult(row=row, requests=finished, interrupted=interrupted, failure=failure)


def _ms(value) -> str:
    return "-" if value is None else f"{value:,.2f}"


def _count(value) -> str:
    number = as_number(value)
    return "-" if number is None else f"{round(number):,}"


def summary_table(rows: list[Mapping], *, title: str = "kvtool bench summary") -> Table:
    """The end-of-run table: one column per variant (label); repeated runs show their medians."""
    rows = [group[0] if len(group) == 1 else median_row(group) for group in group_by_label(rows)]
    table = Table(title=title, show_lines=False)
    table.add_column("metric")
    for row in rows:
        title = str(row.get("label", ""))
        if row.get("num_runs"):
            title += f" (median of {row['num_runs']} runs)"
        if row.get("interrupted"):
            title += " (interrupted)"
        table.add_column(title, justify="right")
    lines: list[tuple[str, Callable[[Mapping], str]]] = [
        ("requests (errors)", lambda r: f"{_count(r.get('num_requests'))} ({_count(r.get('num_errors'))})"),
    ]
    for metric, name in zip(LATENCY_METRICS, ("TTFT", "TPOT", "ITL", "E2E latency")):
        for stat, column in percentile_columns(rows, metric):  # p95, p99.9 too where --percentiles asked
            lines.append((f"{name} {stat} (ms)", lambda r, k=column: _ms(r.get(k))))
    lines += [
        ("output tokens/s", lambda r: _ms(r.get("output_tokens_per_s"))),
        ("input tokens/s", lambda r: _ms(r.get("input_tokens_per_s"))),
        ("total tokens/s", lambda r: _ms(r.get("total_tokens_per_s"))),
        ("requests/s", lambda r: _ms(r.get("requests_per_s"))),
        *_goodput_lines(rows),
        ("reused / missed blocks", lambda r: f"{_count(r.get('reused_blocks'))} / {_count(r.get('missed_blocks'))}"),
        ("missed blocks by reason", _miss_reasons),
        ("cache hit rate", lambda r: format_hit_rate(r.get("cache_hit_rate"))),
        ("token hit rate (reused / prompt)", lambda r: format_hit_rate(r.get("token_hit_rate"))),
        ("offloaded / onboarded blocks",
         lambda r: f"{_count(r.get('offloaded_blocks'))} / {_count(r.get('onboarded_blocks'))}"),
        ("bytes offloaded / onboarded", lambda r: f"{format_bytes(as_number(r.get('offloaded_bytes')))} / {format_bytes(as_number(r.get('onboarded_bytes')))}"),
    ]
    for name, cell in lines:
        table.add_row(name, *(cell(row) for row in rows))
    return table


def _goodput_lines(rows: list[Mapping]) -> list[tuple[str, Callable[[Mapping], str]]]:
    """With --slo: the share of requests that met the objectives, and goodput (requests/s)."""
    if not any(as_number(row.get("slo_attainment")) is not None for row in rows):
        return []
    objectives = describe_bounds(rows[0])
    return [(f"met the SLO ({objectives})", lambda r: format_hit_rate(as_number(r.get("slo_attainment")))),
            ("goodput (requests/s)", lambda r: _ms(r.get("goodput_requests_per_s")))]


_MISS_NAMES = {"never_seen": "new", "evicted_primary": "evicted from primary", "evicted_host": "evicted from host",
               "identity": "other identity", "partial": "partial", "last_token": "last token",
               "reuse_off": "reuse off"}


def _miss_reasons(row: Mapping) -> str:
    """'12 new, 3 evicted from host': the reasons that missed blocks ('-' when the engine gave none)."""
    counts = {name: as_number(row.get(f"missed_{reason}_blocks")) for reason, name in _MISS_NAMES.items()}
    if all(count is None for count in counts.values()):
        return "-"
    return ", ".join(f"{_count(count)} {name}" for name, count in counts.items() if count) or "none"

