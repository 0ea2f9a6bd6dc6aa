"""The runs of `kvtool simulate --slo ttft_p90=2s,tpot_p90=80ms --search replicas=1..16 --search
max_batch_size=8,16,32`: each configuration the search (kvtool.fleet.slo_search) asks for is a simulated
fleet replaying --dataset; every configuration tried is a row of search.csv and of summary.csv (the
fleet's rows, which `kvtool compare` reads), and the cheapest is printed."""

from __future__ import annotations

import io
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvtool.fleet.fleet_run import create_simulated_fleet, simulated_fleet_rows
from kvtool.fleet.routers import RouterOptions
from kvtool.fleet.search_space import describe_setting
from kvtool.fleet.slo_early_stop import SloEarlyStop, SloMissed
from kvtool.fleet.slo_search import Evaluation, SearchResult, Tried
from kvtool.reports.csv_report import (
    SUMMARY_FILE,
    format_hit_rate,
    requests_file_name,
    write_summary_csv,
)
from kvtool.reports.slo import Slo

SEARCH_FILE = "search.csv"


def _ms(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def search_row(tried: Tried, slo: Slo) -> dict:
    """search.csv's row of one configuration tried: what it was, whether it met the SLO, its percentiles."""
    evaluation, row = tried.evaluation, tried.evaluation.row
    result = "met" if evaluation.met else "missed (stopped early)" if evaluation.stopped_early else "missed"
    columns = {"label": row.get("label"), "replicas": tried.replicas, **tried.setting,
               "router": row.get("router"), "result": result, "headroom": evaluation.headroom}
    for objective in slo.percentiles:
        columns[objective.column] = row.get(objective.column)
        columns[f"slo_{objective.column}"] = objective.bound_ms
    for name in ("num_requests", "slo_attainment", "goodput_requests_per_s", "token_hit_rate", "cache_hit_rate",
                 "load_imbalance", "search_wall_s"):
        columns[name] = row.get(name)
    return columns


def print_search(result: SearchResult, slo: Slo, console: Console) -> None:
    """Every configuration tried (the cheapest marked), then the answer in one sentence."""
    table = Table(title=f"SLO search: {slo.describe()} (cheapest = fewest replicas, then most headroom)")
    for name in ("configuration", "replicas", "result", *(o.name for o in slo.percentiles), "goodput (req/s)",
                 "hit rate", "imbalance", "wall (s)"):
        table.add_column(name, justify="left" if name in ("configuration", "result") else "right", no_wrap=True)
    for tried in sorted(result.tried, key=lambda t: (t.setting_index, t.replicas)):
        row = search_row(tried, slo)
        mark = " ← cheapest" if tried is result.best else ""
        table.add_row(describe_setting(tried.setting) or "-", str(tried.replicas), f"{row['result']}{mark}",
                      *(_ms(row[o.column]) for o in slo.percentiles), _ms(row["goodput_requests_per_s"]),
                      format_hit_rate(row["cache_hit_rate"]), _ms(row["load_imbalance"]), _ms(row["search_wall_s"]))
    console.print(table)
    if any(tried.evaluation.stopped_early for tried in result.tried):
        console.print("stopped early: an objective could no longer be met; its figures are those of the requests "
                      "finished by then", highlight=False)
    console.print(f"{len(result.tried)} of {result.num_configurations} configurations run; the other "
                  f"{result.num_not_run} follow from those (more replicas never hurt) or could not be cheaper",
                  highlight=False)
    best = result.best
    if best is None:
        console.print(f"[bold red]no configuration searched meets {slo.describe()}[/]: search more replicas, other "
                      "settings, or a looser --slo", highlight=False)
        return
    values = ", ".join(f"{o.name} {_ms(best.evaluation.row.get(o.column))} ms" for o in slo.percentiles)
    setting = describe_setting(best.setting)
    router = "" if "router" in best.setting else f", router {best.evaluation.row.get('router')}"
    console.print(f"[bold green]cheapest meeting {slo.describe()}[/]: {best.replicas} replica"
                  f"{'s' if best.replicas > 1 else ''}{f', {setting}' if setting else ''}{router} ({values})",
                  highlight=False)


class FleetSearch:
    """The runs of one search: a simulated fleet per configuration, replaying ``dataset`` as the flags ask,
    its per-request rows written into ``output_dir`` (requests-<configuration>.csv)."""

    def __init__(self, flags: Mapping, fleet_flags: Mapping, dataset, output_dir: Path, summary, *,
                 profile: str | None, dtype: str | None, served: bool = False) -> None:
        from kvtool.flags import configs

        self.flags, self.dataset, self.output_dir, self.summary = flags, dataset, output_dir, summary
        self.profile, self.dtype, self.served = profile, dtype, served
        self.source = str(flags["plan"] if flags["plan"] is not None else flags["model"])
        self.router = fleet_flags.get("router") or "round_robin"
        self.router_block_size = fleet_flags.get("router_block_size")
        self.configs = configs
        _, replay = configs(dict(flags.config_flags()))
        # The measured requests' output lengths: how many TPOTs the percentiles will be taken over.
        _, measured = replay.split(dataset.records)
        self.output_lengths = [record.output_tokens for record in measured]
        self.early_stop_ok = not (replay.warmup and replay.warmup_counts_in_stats)
        self.rows: list[dict] = []

    def evaluate(self, setting: Mapping, replicas: int) -> Evaluation:
        from kvtool.bench.runner import run_bench

        engine, replay = self.configs({**self.flags.config_flags(), **{k: v for k, v in setting.items()
                                                                       if k != "router"}})
        router = RouterOptions(setting.get("router", self.router), self.router_block_size)
        label = describe_setting({"replicas": replicas, **setting})
        slo = self.summary.slo
        started = time.perf_counter()
        fleet = create_simulated_fleet(self.source, engine, replay, self.dataset, num_replicas=replicas,
                                       router=router, profile=self.profile, dtype=self.dtype,
                                       cache_dir=self.flags["plan_cache_dir"], served=self.served)
        if self.early_stop_ok:
            fleet.engine.early_stop = SloEarlyStop(slo, self.output_lengths)
        try:
            result = run_bench(fleet, self.dataset, replay, label=label, summary=self.summary,
                               requests_csv=self.output_dir / requests_file_name(label),
                               console=Console(file=io.StringIO()),  # one line per configuration instead
                               config_columns={"model": self.source, "label_source": "search"})
            rows = simulated_fleet_rows(result, fleet, self.summary)
        finally:
            fleet.shutdown()
        stopped = isinstance(result.failure, SloMissed)
        if result.failure is not None and not stopped:
            raise result.failure
        if result.interrupted and not stopped:
            raise KeyboardInterrupt
        row = rows[0]
        row["search_wall_s"] = time.perf_counter() - started
        headroom = None if stopped else max(
            (row[o.column] / o.bound_ms if row.get(o.column) is not None else float("inf")) for o in slo.percentiles)
        evaluation = Evaluation(met=not stopped and row.get("slo_met") is True, headroom=headroom, row=row,
                                stopped_early=stopped)
        row["search_result"] = "met" if evaluation.met else "missed"
        self.rows.append(row)
        return evaluation

    def progress_line(self, tried: Tried) -> str:
        """'replicas=4,max_batch_size=16: met (ttft_p90 812.0 ms, tpot_p90 41.2 ms; 3.1 s)'."""
        row = search_row(tried, self.summary.slo)
        values = ", ".join(f"{o.name} {_ms(row[o.column])} ms" for o in self.summary.slo.percentiles)
        return f"{row['label']}: {row['result']} ({values}; {row['search_wall_s']:.1f} s)"


def write_search(output_dir: Path, tried: Sequence[Tried], rows: Sequence[dict], slo: Slo) -> list[Path]:
    """search.csv (a row per configuration tried) and summary.csv (their fleet rows) in ``output_dir``."""
    if not tried:
        return []
    search_csv = write_summary_csv(output_dir / SEARCH_FILE, [search_row(t, slo) for t in tried])
    return [search_csv, write_summary_csv(output_dir / SUMMARY_FILE, rows)]
