"""`kvtool bench`: replay a dataset (or run a scenario) and write per-request and summary CSVs."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvtool.bench import runner, sweep
from kvtool.workloads.datasets import load_dataset
from kvtool.bench.config import ENGINE_FLAG_NAMES, BenchConfig
from kvtool.reports.metrics import SummaryOptions
from kvtool.reports.csv_report import output_paths, write_summary_csv
from kvtool.reports.outputs import ReportOutputs
from kvtool.bench.scenario import load_scenario
from kvtool.cli import app
from kvtool.cli.errors import USER_ERRORS, print_error, user_errors
from kvtool.cli.help import KvtoolCommand
from kvtool.cli import engine_flags
from kvtool.cli.options import flag, toggle
from kvtool.cli.paths import check_writable_dir, check_writable_file
from kvtool.config import ConfigError
from kvtool.errors import KvtoolError
from kvtool.files import FileWriteError
from kvtool.signals import StopRecord, stop_signals

EXIT_REQUESTS_FAILED = 3  # the run finished and its reports are written, but requests failed (see --allow_errors)


def _default_label(plan: Path | None, model: str | None) -> str:
    if plan is not None:
        return Path(plan).name or str(plan)
    return str(model).removeprefix("preset:")


ENDPOINT, WORKLOAD, OUTPUT, REPORT = "Endpoint", "Workload", "Output", "Report"


@app.command(cls=KvtoolCommand)
def bench(
    ctx: typer.Context,
    plan: engine_flags.Plan = None,
    model: engine_flags.Model = None,
    tokens_per_block: engine_flags.TokensPerBlock = None,
    plan_cache_dir: engine_flags.PlanCacheDir = None,
    enable_kv_cache_reuse: engine_flags.EnableKvCacheReuse = None,
    disable_kv_cache_reuse: engine_flags.DisableKvCacheReuse = None,
    max_tokens_in_paged_kv_cache: engine_flags.MaxTokensInPagedKvCache = None,
    kv_cache_free_gpu_mem_fraction: engine_flags.KvCacheFreeGpuMemFraction = None,
    kv_host_cache_bytes: engine_flags.KvHostCacheBytes = None,
    max_attention_window_size: engine_flags.MaxAttentionWindowSize = None,
    scheduler_policy: engine_flags.SchedulerPolicy = None,
    enable_chunked_context: engine_flags.EnableChunkedContext = None,
    disable_chunked_context: engine_flags.DisableChunkedContext = None,
    context_chunking_policy: engine_flags.ContextChunkingPolicy = None,
    max_batch_size: engine_flags.MaxBatchSize = None,
    max_num_tokens: engine_flags.MaxNumTokens = None,
    max_seq_len: engine_flags.MaxSeqLen = None,
    enforce_eager: engine_flags.EnforceEager = None,
    endpoint: Annotated[str | None, flag("endpoint", "Replay against this OpenAI-compatible server instead "
                                         "(http://HOST:PORT: kvtool serve, trtllm-serve, vLLM, SGLang).",
                                         ENDPOINT)] = None,
    api: Annotated[str, flag("api", "completions | chat: the route an --endpoint bench sends to.",
                             ENDPOINT)] = "completions",
    served_model: Annotated[str | None, flag("served_model", "The model name sent to --endpoint (default: the "
                                             "first the server lists).", ENDPOINT)] = None,
    api_key: Annotated[str | None, flag("api_key", "Sent to --endpoint as 'Authorization: Bearer KEY' (default: "
                                        "$OPENAI_API_KEY); never printed.", ENDPOINT)] = None,
    header: Annotated[list[str] | None, flag("header", "NAME:VALUE, a header sent with every request to --endpoint "
                                             "(repeatable).", ENDPOINT)] = None,
    ca_cert: Annotated[Path | None, flag("ca_cert", "A PEM file of the certificate authority that signed an https "
                                         "--endpoint's certificate (default: the system's).", ENDPOINT)] = None,
    dataset: Annotated[Path | None, flag("dataset", "A JSON Lines dataset (see `kvtool dataset`).", WORKLOAD)] = None,
    config: Annotated[Path | None, flag("config", "A scenario file (bench_configs/NAME.yaml), sweeps included.",
                                        WORKLOAD)] = None,
    set_: Annotated[list[str] | None, flag("set", "Override a scenario value: --set bench.max_batch_size=4 "
                                            "(repeatable; needs --config).", WORKLOAD)] = None,
    mode: Annotated[str | None, flag("mode", "offline (default: all queued at the start) | sequential (one at a "
                                     "time) | trace (each at its arrival_time_s).", WORKLOAD)] = None,
    concurrency: Annotated[int | None, flag("concurrency", "Keep N requests in flight.", WORKLOAD)] = None,
    request_rate: Annotated[float | None, flag("request_rate", "Poisson arrivals at R requests/s (seeded).",
                                               WORKLOAD)] = None,
    time_scale: Annotated[float | None, flag("time_scale", "Multiply the dataset's arrival times (0.5: twice as fast).",
                                             WORKLOAD)] = None,
    seed: Annotated[int | None, flag("seed", "Seed of the Poisson arrivals (default 0).", WORKLOAD)] = None,
    warmup: Annotated[int | None, flag("warmup", "Run the first N dataset requests first, uncounted.",
                                       WORKLOAD)] = None,
    warmup_counts_in_stats: Annotated[bool | None, toggle(
        "warmup_counts_in_stats", "Keep the warm-up's cache counters (default: reset after warm-up).",
        WORKLOAD)] = None,
    num_requests: Annotated[int | None, flag("num_requests", "Measure at most N requests.", WORKLOAD)] = None,
    output: Annotated[Path | None, flag("output", "Output directory or summary .csv path (default "
                                        "out/<dataset or scenario>-<time>).", OUTPUT)] = None,
    label: Annotated[str | None, flag("label", "Variant name in the reports (default: the plan/preset name).",
                                      OUTPUT)] = None,
    percentiles: Annotated[str | None, flag("percentiles", "More latency percentiles: --percentiles 95,99.9 (p50, "
                                            "p90 and p99 are always reported).", REPORT)] = None,
    slo: Annotated[str | None, flag("slo", "Service-level objectives, e.g. --slo ttft=500ms,tpot=50ms (also e2e; "
                                    "ms or s): report the share of requests meeting all of them, and goodput.",
                                    REPORT)] = None,
    report_json: Annotated[Path | None, flag("report_json", "Also write the summary as JSON to this file.",
                                             REPORT)] = None,
    html: Annotated[bool | None, toggle("html", "Also write report.html beside the CSVs: tables, plots and miss "
                                        "reasons in one self-contained page.", REPORT)] = None,
    allow_errors: Annotated[bool | None, toggle("allow_errors", "Exit 0 when requests failed (default: exit 3 once "
                                                "the reports are written).", OUTPUT)] = None,
) -> None:
    """Replay a dataset through the kvtool runtime; print the summary; write per-request and summary CSVs."""
    # The parameters named as bench flags are the flags (kvtool.bench.config.FLAGS maps them).
    console = Console(stderr=True)
    with stop_signals() as stop, stopped_early(console, stop):  # SIGTERM stops as Ctrl-C does
        with user_errors():
            flags = engine_flags.engine_flag_values(ctx.params)
            reporting = report_outputs(ctx.params)
            if plan is not None and model is not None:
                raise ValueError("give --plan DIR or --model preset:NAME, not both")
            endpoint_options = _endpoint_options(endpoint, api, served_model, api_key, header, ca_cert)
            if endpoint_options is not None:
                rows, interrupted, written, failure = _run_endpoint(
                    endpoint_options, plan, model, config, dataset, output, label, flags, console,
                    summary=reporting.summary)
            elif config is not None:
                if label is not None:
                    raise ValueError("--label names a single run; a scenario's variants are labelled in its file")
                rows, interrupted, written, failure = _run_scenario(config, set_ or [], plan, model, dataset,
                                                                    output, flags, plan_cache_dir, console,
                                                                    summary=reporting.summary)
            else:
                if set_:
                    raise ValueError("--set overrides a scenario value: it needs --config FILE.yaml")
                rows, interrupted, written, failure = _run_single(plan, model, dataset, output, label, flags,
                                                                  plan_cache_dir, console, summary=reporting.summary)
    report_run(rows, interrupted, written, failure, console, reporting=reporting, stop=stop)
    _exit_if_requests_failed(rows, written, allow_errors, console)


@contextlib.contextmanager
def stopped_early(console: Console, stop: StopRecord) -> Iterator[None]:
    """Ctrl-C or SIGTERM that ends the block (before any request finished: a run that started returns
    its summary instead): says so, and exits 130 or 143 (128 + the signal's number)."""
    try:
        yield
    except KeyboardInterrupt:
        console.print(f"[bold yellow]interrupted[/] ({stop.name}) before any request finished: nothing written; "
                      f"exit code {stop.exit_code}", highlight=False)
        raise typer.Exit(stop.exit_code) from None


def report_outputs(params) -> ReportOutputs:
    """The reporting flags of a bench or simulate command (its parameters by name), checked before anything
    runs: a bad --percentiles or --slo, or a --report_json that cannot be written, is a user error."""
    reporting = ReportOutputs.from_flags(percentiles=params.get("percentiles"), slo=params.get("slo"),
                                         report_json=params.get("report_json"), html=params.get("html"))
    if reporting.report_json is not None:
        check_writable_file(reporting.report_json, "--report_json", "report.json")
    return reporting


def report_run(rows, interrupted, written, failure, console: Console, *, more_tables=None,
               reporting: ReportOutputs | None = None, title: str = "kvtool bench summary",
               stop: StopRecord | None = None) -> None:
    """After a run: the summary table (``title``; and ``more_tables(rows, console)``'s), the files written (with
    ``reporting``: the JSON and HTML reports too), and how it ended (an error that stopped it is
    raised; Ctrl-C exits 130, SIGTERM 143)."""
    stop = stop or StopRecord()
    if not rows:
        console.print(f"[bold yellow]interrupted[/] ({stop.name}) before any variant finished: nothing written; "
                      f"exit code {stop.exit_code}", highlight=False)
        raise typer.Exit(stop.exit_code)
    # Wide enough for every variant's numbers (a sweep has many columns): at least the terminal's width.
    width = 36 + sum(max(len(str(row.get("label", ""))) + 14, 16) for row in rows)
    wide = Console(width=max(Console().width, width))
    wide.print(runner.summary_table(rows, title=title))
    if more_tables is not None:
        written = written + more_tables(rows, wide)
    report_error = None
    if reporting is not None:
        written, report_error = _write_reports(reporting, rows, written)
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    if report_error is not None:
        print_error(report_error)
    if failure is not None:
        console.print("[bold red]stopped by an error[/]: the table above and the files written hold the requests "
                      "that finished (a summary written says interrupted=True, run_error says why)")
        with user_errors():
            raise failure
    if interrupted:
        console.print(f"[bold yellow]interrupted[/] ({stop.name}): the reports hold the requests that finished "
                      f"(summary marked interrupted=True); exit code {stop.exit_code}", highlight=False)
        raise typer.Exit(stop.exit_code)
    if report_error is not None:
        raise typer.Exit(2)


def _write_reports(reporting: ReportOutputs, rows, written):
    """(the files written, with the JSON / HTML reports, and the error that stopped writing them, if one
    did: it is printed after the files already safe, and the command exits 2 after saying how the run ended)."""
    try:
        return written + reporting.write(rows, written), None
    except USER_ERRORS as error:
        return written, error


def _run_single(plan, model, dataset, output, label, flags, plan_cache_dir, console, llm_factory=None,
                summary: SummaryOptions = SummaryOptions()):
    if dataset is None:
        raise ValueError("give --dataset FILE.jsonl (see `kvtool dataset`) or --config bench_configs/NAME.yaml")
    if plan is None and model is None:
        raise ValueError("give --plan DIR (from `kvtool build`) or --model preset:NAME")
    config = BenchConfig.from_flags(flags)
    _check_output(output, runner.default_output_dir(Path(dataset).stem), single_run=True)
    data = load_dataset(dataset)
    summary_csv, requests_csv = output_paths(output or runner.default_output_dir(Path(dataset).stem))
    llm_factory = llm_factory or runner.create_llm  # looked up now: tests swap it
    llm = llm_factory(str(plan if plan is not None else model), config, data, cache_dir=plan_cache_dir)
    try:
        result = runner.run_bench(llm, data, config, label=label or _default_label(plan, model),
                                  requests_csv=requests_csv, console=console, summary=summary,
                                  config_columns={"model": str(plan if plan is not None else model),
                                                  "label_source": "--label" if label else "default"})
    finally:
        llm.shutdown()
    written, failure = _write_summary(summary_csv, [result.row], requests_csv, result.failure)
    return [result.row], result.interrupted, written, failure


def _write_summary(summary_csv: Path, rows, requests_csv: Path, failure):
    """(files written, the error to report): a summary that cannot be written (a full disk) is an error
    beside the run's own, and its figures stay on the screen."""
    try:
        write_summary_csv(summary_csv, rows)
    except FileWriteError as error:
        if failure is None:
            return [requests_csv], error
        return [requests_csv], (failure.joined(error) if isinstance(failure, FileWriteError)
                                else KvtoolError(f"{failure}; {error}"))
    return [requests_csv, summary_csv], failure


# EndpointOptions' and EndpointAccess' fields -> their flags (the key's: where it came from).
_ENDPOINT_FLAGS = {"url": "endpoint", "api": "api", "headers": "header", "ca_cert": "ca_cert"}


def _endpoint_options(endpoint, api, served_model, api_key, headers, ca_cert):
    """The --endpoint flags as EndpointOptions (None without --endpoint); the key from $OPENAI_API_KEY
    when --api_key is not given, as the openai client takes it."""
    from kvtool.bench.endpoint import EndpointOptions
    from kvtool.bench.endpoint_access import API_KEY_ENV, EndpointAccess, parse_header

    if endpoint is None:
        given = [name for name, value in (("served_model", served_model), ("api_key", api_key), ("header", headers),
                                          ("ca_cert", ca_cert)) if value]
        if given:
            raise ValueError(f"--{given[0]} goes with --endpoint URL (a server to replay against): add --endpoint, "
                             f"or leave out --{given[0]}")
        return None
    source = "--api_key"
    if api_key is None and os.environ.get(API_KEY_ENV):
        api_key, source = os.environ[API_KEY_ENV], f"${API_KEY_ENV}"
    try:
        access = EndpointAccess(api_key=api_key, api_key_source=source,
                                headers=tuple(parse_header(text) for text in headers or ()), ca_cert=ca_cert)
        return EndpointOptions(url=endpoint, api=api, served_model=served_model, access=access)
    except ConfigError as error:
        name = source if error.field == "api_key" else f"--{_ENDPOINT_FLAGS.get(error.field, error.field)}"
        raise ValueError(f"{name} {error.problem}") from None


def _run_endpoint(options, plan, model, config, dataset, output, label, flags, console,
                  summary: SummaryOptions = SummaryOptions()):
    from kvtool.bench.endpoint import EndpointLLM

    if plan is not None or model is not None or config is not None:
        raise ValueError("--endpoint replays against a running server: leave out --plan, --model and --config "
                         "(the server serves its own model)")
    engine_flags_given = [name for name in flags if name in ENGINE_FLAG_NAMES]
    if engine_flags_given:
        raise ValueError(f"--{engine_flags_given[0]} configures kvtool's engine, but with --endpoint the server's own "
                         "configuration applies: give it to the server (e.g. kvtool serve) instead")
    if dataset is None:
        raise ValueError("give --dataset FILE.jsonl (see `kvtool dataset`) to replay against --endpoint")
    bench_config = BenchConfig.from_flags(flags)
    _check_output(output, runner.default_output_dir(Path(dataset).stem), single_run=True)
    data = load_dataset(dataset)
    summary_csv, requests_csv = output_paths(output or runner.default_output_dir(Path(dataset).stem))
    # Timed arrivals need the replay to wake while requests run; otherwise it waits for the server.
    timed = bench_config.replay.request_rate is not None or any(r.arrival_time_s is not None for r in data.records)
    llm = EndpointLLM(options, timed=timed)
    try:
        result = runner.run_bench(llm, data, bench_config, label=label or f"{llm.served_model}@endpoint",
                                  requests_csv=requests_csv, console=console, engine_name=llm.engine_name,
                                  endpoint=options.base_url, summary=summary,
                                  config_columns={"model": llm.served_model, "api": options.api})
    finally:
        llm.shutdown()
    if result.row.get("num_requests") and result.row.get("token_hit_rate") is None:
        console.print(f"note: the server at {options.url} reported no cached tokens (usage.prompt_tokens_details): "
                      "the token hit rate is unknown (vLLM reports them with --enable-prompt-tokens-details, SGLang with "
                      "--enable-cache-report)", highlight=False, soft_wrap=True)
    write_summary_csv(summary_csv, [result.row])
    return [result.row], result.interrupted, [requests_csv, summary_csv], result.failure


def _exit_if_requests_failed(rows, written, allow_errors, console: Console) -> None:
    """After a run that finished: how many requests failed and their distinct errors, then exit 3 unless
    --allow_errors (the reports are written by then)."""
    from rich.markup import escape

    from kvtool.reports.request_errors import failed_requests

    request_files = {str(row.get("requests_csv")) for row in rows}
    failed = failed_requests(rows, [path for path in written if Path(path).name in request_files])
    if failed is None:
        return
    first, *rest = failed.lines()
    colour = "yellow" if allow_errors else "red"
    console.print(f"[bold {colour}]{'Note' if allow_errors else 'Error'}:[/] {escape(first)}", highlight=False,
                  soft_wrap=True)
    for line in rest:
        console.print(escape(line), highlight=False, soft_wrap=True)
    if not allow_errors:
        console.print(f"exit status {EXIT_REQUESTS_FAILED}: the reports hold every request (each failed one's "
                      "error column says why); --allow_errors exits 0 when requests fail", highlight=False)
        raise typer.Exit(EXIT_REQUESTS_FAILED)


def _check_output(output: Path | None, default: Path, *, single_run: bool) -> None:
    """Before anything runs: the reports can be written where they will go."""
    flag = "--output" if output is not None else "the default --output"
    path = Path(output) if output is not None else default
    if single_run and path.suffix.lower() == ".csv":
        check_writable_file(path, flag)
    else:
        check_writable_dir(path, flag)


def _run_scenario(config, sets, plan, model, dataset, output, flags, plan_cache_dir, console,
                  llm_factory=None, scenario=None, plan_resolver=None, summary: SummaryOptions = SummaryOptions()):
    """A scenario file's variants (or ``scenario``, made from the command line) into one output directory."""
    if scenario is None:
        scenario = load_scenario(config, sets=sets, model=model, plan=plan, dataset=dataset, bench_overrides=flags)
    output_dir = Path(output) if output is not None else runner.default_output_dir(scenario.name)
    if output_dir.suffix.lower() == ".csv":
        raise ValueError(f"--output {output_dir}: a scenario writes several files; give a directory")
    _check_output(output, output_dir, single_run=False)
    result = sweep.run_scenario(scenario, output_dir, console=console, llm_factory=llm_factory or runner.create_llm,
                                plan_resolver=plan_resolver or (lambda v: sweep.resolve_variant_plan(v, plan_cache_dir)),
                                summary=summary)
    written = [output_dir / row["requests_csv"] for row in result.rows] + [result.summary_csv]
    return result.rows, result.interrupted, written, result.failure
