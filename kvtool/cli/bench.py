"""`kvtool bench`: replay a dataset (or run a scenario) and write per-request and summary CSVs."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvtool.bench import runner, sweep
from kvtool.bench.scenario import load_scenario
from kvtool.bench.target import Target
from kvtool.cli import app
from kvtool.cli.user_errors import USER_ERRORS, print_error, user_errors
from kvtool.cli.help import KvtoolCommand
from kvtool.cli.typer_options import flag, flags_of, with_flags
from kvtool.cli.paths import check_writable_dir, check_writable_file
from kvtool.config import ConfigError
from kvtool.errors import KvtoolError
from kvtool.files import FileWriteError
from kvtool.flags import ENGINE_FLAG_NAMES, ENGINE_FLAGS, ROUTER_FLAGS, RUN_FLAGS, FlagValues, configs
from kvtool.reports.csv_report import output_paths, write_summary_csv
from kvtool.reports.metrics import SummaryOptions
from kvtool.reports.outputs import ReportOutputs
from kvtool.reports.summary_table import summary_table
from kvtool.signals import StopRecord, stop_signals
from kvtool.workloads.datasets import load_dataset

EXIT_REQUESTS_FAILED = 3  # the run finished and its reports are written, but requests failed (see --allow_errors)
ENDPOINT = "Endpoint"
# What a single run gives back: its summary rows, whether it was cut short, the files written, the error
# that stopped it (None: none did).
RunOutcome = tuple[list[dict], bool, list[Path], Exception | None]


def _default_label(plan: Path | None, model: str | None) -> str:
    if plan is not None:
        return Path(plan).name or str(plan)
    return str(model).removeprefix("preset:")


@app.command(cls=KvtoolCommand)
@with_flags
def bench(
    engine: FlagValues = flags_of(ENGINE_FLAGS),
    endpoint: Annotated[list[str] | None, flag("endpoint", "Replay against this OpenAI-compatible server instead "
                                               "(http://HOST:PORT: kvtool serve, trtllm-serve, vLLM, SGLang); "
                                               "repeat it for a fleet of servers behind --router.",
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
    run: FlagValues = flags_of(RUN_FLAGS),
    fleet: FlagValues = flags_of(ROUTER_FLAGS),
) -> None:
    """Replay a dataset through the kvtool runtime; print the summary; write per-request and summary CSVs."""
    flags = engine | run
    console = Console(stderr=True)
    with stop_signals() as stop, stopped_early(console, stop):  # SIGTERM stops as Ctrl-C does
        with user_errors():
            reporting = report_outputs(flags)
            check_plan_or_model(flags)
            endpoint_options = _endpoint_options(endpoint, api, served_model, api_key, header, ca_cert)
            router = _router_options(fleet, endpoint_options)
            if endpoint_options is not None:
                rows, interrupted, written, failure = _run_endpoint(endpoint_options, flags, console,
                                                                    summary=reporting.summary, router=router)
            elif flags["config"] is not None:
                if flags["label"] is not None:
                    raise ValueError("--label names a single run; a scenario's variants are labelled in its file")
                rows, interrupted, written, failure = run_scenario(flags, console, summary=reporting.summary)
            else:
                if flags["set"]:
                    raise ValueError("--set overrides a scenario value: it needs --config FILE.yaml")
                rows, interrupted, written, failure = run_single(flags, console, summary=reporting.summary)
    report_run(rows, interrupted, written, failure, console, reporting=reporting, stop=stop)
    _exit_if_requests_failed(rows, written, flags["allow_errors"], console)


def check_plan_or_model(flags: FlagValues) -> None:
    if flags["plan"] is not None and flags["model"] is not None:
        raise ValueError("give --plan DIR or --model preset:NAME, not both")


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
    """The reporting flags of a bench or simulate command (its flags by name), checked before anything
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
    wide.print(summary_table(rows, title=title))
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


def run_single(flags: FlagValues, console: Console, llm_factory=None,
               summary: SummaryOptions = SummaryOptions(), rows_of: Callable | None = None) -> RunOutcome:
    """--dataset replayed once through an LLM of --plan or --model (``llm_factory``, as
    kvtool.bench.runner.create_llm; `kvtool simulate` passes its own, and a fleet's ``rows_of``)."""
    plan, model = flags["plan"], flags["model"]
    if flags["dataset"] is None:
        raise ValueError("give --dataset FILE.jsonl (see `kvtool dataset`) or --config bench_configs/NAME.yaml")
    if plan is None and model is None:
        raise ValueError("give --plan DIR (from `kvtool build`) or --model preset:NAME")
    llm_factory = llm_factory or runner.create_llm  # looked up now: tests swap it
    source = str(plan if plan is not None else model)

    def target(dataset, engine, replay) -> Target:
        return llm_factory(source, engine, replay, dataset, cache_dir=flags["plan_cache_dir"])

    outcome, _ = _replay(flags, target, console, summary, default_label=lambda _: _default_label(plan, model),
                         config_columns=lambda _: {"model": source,
                                                   "label_source": "--label" if flags["label"] else "default"},
                         rows_of=rows_of)
    return outcome


def _replay(flags: FlagValues, make_target: Callable, console: Console, summary: SummaryOptions, *,
            default_label: Callable[[Target], str], config_columns: Callable[[Target], dict],
            rows_of: Callable | None = None):
    """The one run of --dataset, in process or against a server: the target ``make_target(dataset, engine,
    replay)`` makes, replayed into --output. ``rows_of(result, target)``: the summary rows of a fleet (its
    own and each replica's; default: the run's row). Returns (RunOutcome, the run's BenchResult)."""
    dataset = flags["dataset"]
    engine, replay = configs(flags.config_flags())
    default_output = runner.default_output_dir(Path(dataset).stem)
    _check_output(flags["output"], default_output, single_run=True)
    data = load_dataset(dataset)
    summary_csv, requests_csv = output_paths(flags["output"] or default_output)
    target = make_target(data, engine, replay)
    try:
        result = runner.run_bench(target, data, replay, label=flags["label"] or default_label(target),
                                  requests_csv=requests_csv, console=console, summary=summary,
                                  config_columns=config_columns(target))
        rows = rows_of(result, target) if rows_of is not None else [result.row]
    finally:
        target.shutdown()
    written, failure = _write_summary(summary_csv, rows, requests_csv, result.failure)
    return (rows, result.interrupted, written, failure), result


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


def _router_options(fleet: FlagValues, endpoints):
    """--router and --router_block_size as RouterOptions (None without them: one --endpoint); they route
    over several --endpoint servers only."""
    from kvtool.fleet.routers import RouterOptions

    given = [name for name in ROUTER_FLAGS if fleet[name] is not None]
    if not given:
        return None
    if endpoints is None or len(endpoints) < 2:
        raise ValueError(f"--{given[0]} routes requests over servers: give two --endpoint URL or more (`kvtool "
                         "simulate --replicas N --router NAME` simulates a fleet)")
    return RouterOptions(fleet["router"] or "round_robin", fleet["router_block_size"])


def _endpoint_options(endpoint, api, served_model, api_key, headers, ca_cert):
    """The --endpoint flags as a list of EndpointOptions, one per server (None without --endpoint); the
    key from $OPENAI_API_KEY when --api_key is not given, as the openai client takes it."""
    from kvtool.bench.endpoint import EndpointOptions
    from kvtool.bench.endpoint_access import API_KEY_ENV, EndpointAccess, parse_header

    if not endpoint:
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
        if len(set(endpoint)) < len(endpoint):
            raise ValueError("--endpoint: a server is given twice: give each server of a fleet once")
        return [EndpointOptions(url=url, api=api, served_model=served_model, access=access) for url in endpoint]
    except ConfigError as error:
        name = source if error.field == "api_key" else f"--{_ENDPOINT_FLAGS.get(error.field, error.field)}"
        raise ValueError(f"{name} {error.problem}") from None


def _run_endpoint(endpoints, flags: FlagValues, console: Console, summary: SummaryOptions = SummaryOptions(),
                  router=None) -> RunOutcome:
    from kvtool.bench.endpoint import EndpointLLM
    from kvtool.fleet.endpoint_fleet import EndpointFleet, endpoint_fleet_rows
    from kvtool.fleet.routers import RouterOptions

    if flags["plan"] is not None or flags["model"] is not None or flags["config"] is not None:
        raise ValueError("--endpoint replays against a running server: leave out --plan, --model and --config "
                         "(the server serves its own model)")
    engine_flags_given = [name for name in flags.config_flags() if name in ENGINE_FLAG_NAMES]
    if engine_flags_given:
        raise ValueError(f"--{engine_flags_given[0]} configures kvtool's engine, but with --endpoint the server's own "
                         "configuration applies: give it to the server (e.g. kvtool serve) instead")
    if flags["dataset"] is None:
        raise ValueError("give --dataset FILE.jsonl (see `kvtool dataset`) to replay against --endpoint")

    def target(dataset, engine, replay) -> Target:
        # Timed arrivals need the replay to wake while requests run; otherwise it waits for the server.
        timed = replay.request_rate is not None or any(r.arrival_time_s is not None for r in dataset.records)
        if len(endpoints) == 1:
            return EndpointLLM(options, timed=timed)
        fleet = EndpointFleet(endpoints, router or RouterOptions(), timed=timed)
        console.print(fleet.describe(), highlight=False, soft_wrap=True)
        return fleet

    def label(llm) -> str:
        return f"{llm.served_model}@endpoint" if len(endpoints) == 1 else f"{llm.served_model}@{len(endpoints)} endpoints"

    options = endpoints[0]
    outcome, result = _replay(flags, target, console, summary, default_label=label,
                              config_columns=lambda llm: {"model": llm.served_model, "api": options.api},
                              rows_of=None if len(endpoints) == 1 else (
                                  lambda result, fleet: endpoint_fleet_rows(result, fleet, summary)))
    if result.row.get("num_requests") and result.row.get("token_hit_rate") is None:
        console.print(f"note: the server at {', '.join(e.url for e in endpoints)} reported no cached tokens (usage.prompt_tokens_details): "
                      "the token hit rate is unknown (vLLM reports them with --enable-prompt-tokens-details, SGLang with "
                      "--enable-cache-report)", highlight=False, soft_wrap=True)
    return outcome


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


def run_scenario(flags: FlagValues, console: Console, llm_factory=None, scenario=None, plan_resolver=None,
                 summary: SummaryOptions = SummaryOptions()) -> RunOutcome:
    """A scenario file's variants (or ``scenario``, made from the command line) into one output directory."""
    output = flags["output"]
    if scenario is None:
        scenario = load_scenario(flags["config"], sets=flags["set"] or [], model=flags["model"], plan=flags["plan"],
                                 dataset=flags["dataset"], bench_overrides=flags.config_flags())
    output_dir = Path(output) if output is not None else runner.default_output_dir(scenario.name)
    if output_dir.suffix.lower() == ".csv":
        raise ValueError(f"--output {output_dir}: a scenario writes several files; give a directory")
    _check_output(output, output_dir, single_run=False)
    cache_dir = flags["plan_cache_dir"]
    result = sweep.run_scenario(scenario, output_dir, console=console, llm_factory=llm_factory or runner.create_llm,
                                plan_resolver=plan_resolver or (lambda v: sweep.resolve_variant_plan(v, cache_dir)),
                                summary=summary)
    written = [output_dir / row["requests_csv"] for row in result.rows] + [result.summary_csv]
    return result.rows, result.interrupted, written, result.failure
