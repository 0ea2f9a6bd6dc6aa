"""A fleet's summary rows: the fleet's own (every request, the replicas' cache counters summed) and one
per replica (its requests, its counters), so that `kvtool compare` reads a fleet like any run: the fleet
row is the configuration's, labelled as a run is; a replica's row is labelled '<label> replica <i>'
and records ``replica`` = i (the fleet's row leaves it empty).

Load imbalance is the busiest replica's work over the mean replica's: max / mean of the tokens each
replica computed (prompt tokens it did not reuse, plus output tokens) for the requests it finished;
1.0 is an even fleet, N means one replica did all the work of N. Tokens computed rather than requests:
a router that sends a replica the requests whose prefixes it holds gives it more requests but less
work; rather than busy time: a server behind an endpoint does not report its busy time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvtool.reports.metrics import RequestMetrics, SummaryOptions, summarize


def computed_tokens(requests: Sequence[RequestMetrics]) -> int:
    """Tokens the requests' engine computed: prompt tokens not reused, plus output tokens (finished ones)."""
    return sum(r.input_tokens - r.reused_tokens + r.output_tokens for r in requests if r.ok)


def load_imbalance(work: Sequence[int]) -> float | None:
    """max / mean of the replicas' work (None when none did any)."""
    mean = sum(work) / len(work) if work else 0
    return max(work) / mean if mean else None


def replica_label(label: str, replica: int) -> str:
    return f"{label} replica {replica}"


def fleet_rows(row: Mapping, requests: Sequence[RequestMetrics], replica_stats: Sequence[Mapping],
               summary: SummaryOptions = SummaryOptions(),
               replica_columns: Sequence[Mapping] | None = None) -> list[dict]:
    """[the fleet's row, then each replica's]. ``row``: the run's summary row (kvtool.bench.runner.run_bench:
    configuration, every request's metrics, the fleet's counters); ``requests``: its requests, each with its
    replica; ``replica_stats``: each replica's cache counters; ``replica_columns``: more columns per replica
    (its server's URL, its busy time)."""
    num_replicas = len(replica_stats)
    by_replica: list[list[RequestMetrics]] = [[] for _ in range(num_replicas)]
    for request in requests:
        if request.replica is not None:
            by_replica[request.replica].append(request)
    work = [computed_tokens(group) for group in by_replica]
    fleet = {**row, "replica": None, "num_replicas": num_replicas, "computed_tokens": sum(work),
             "load_imbalance": load_imbalance(work)}
    rows = [fleet]
    for replica, (group, stats) in enumerate(zip(by_replica, replica_stats)):
        rows.append({**fleet, "label": replica_label(row["label"], replica), "label_source": "fleet",
                     "replica": replica, "num_measured_requests": len(group), "computed_tokens": work[replica],
                     "load_imbalance": None, **summarize(group, summary).as_row(), **stats,
                     **(replica_columns[replica] if replica_columns is not None else {})})
    return rows
