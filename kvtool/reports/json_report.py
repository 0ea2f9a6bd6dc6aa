"""`kvtool bench --report_json PATH`: a run's summary as one JSON document (trtllm-bench has --report_json).

kvtool's summary columns are the keys (the same names as summary.csv: ``ttft_ms_p99``,
``cache_hit_rate``, ...), with numbers as numbers, booleans as booleans and empty cells as null. Each
variant also carries its figures under the keys ``vllm bench serve --save-result`` writes
(``request_throughput``, ``median_ttft_ms``, ``p99_ttft_ms``, ``request_goodput``, ...), so a script
written for vLLM's results reads kvtool's; where the two differ, the kvtool columns are what counts.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvtool.reports.metrics import LATENCY_METRICS, percentile_columns
from kvtool.reports.repeats import group_by_label, median_row
from kvtool.files import atomic_write

FORMAT_VERSION = 1
# vLLM's key for a kvtool column, where vLLM reports the same figure.
_VLLM_KEYS = {"num_requests": "completed", "num_errors": "failed", "total_input_tokens": "total_input_tokens",
              "total_output_tokens": "total_output_tokens", "duration_s": "duration",
              "requests_per_s": "request_throughput", "goodput_requests_per_s": "request_goodput",
              "output_tokens_per_s": "output_throughput", "total_tokens_per_s": "total_token_throughput"}
_VLLM_METRICS = {"ttft_ms": "ttft_ms", "tpot_ms": "tpot_ms", "itl_ms": "itl_ms", "e2e_ms": "e2el_ms"}


def json_value(value):
    """A summary cell as JSON: numbers, booleans, strings and null (NaN and infinities are null)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return str(value)


def vllm_figures(row: Mapping) -> dict:
    """The row's figures under vLLM's --save-result keys (p50 is vLLM's median_*, every other
    percentile p<q>_*)."""
    figures = {key: json_value(row[column]) for column, key in _VLLM_KEYS.items() if column in row}
    for metric in LATENCY_METRICS:
        name = _VLLM_METRICS[metric]
        for stat, column in percentile_columns([row], metric):
            if column in row:
                key = {"mean": f"mean_{name}", "p50": f"median_{name}"}.get(stat, f"{stat}_{name}")
                figures[key] = json_value(row[column])
    return figures


def report_document(rows: Sequence[Mapping], *, command: str, percentiles: Sequence[float],
                    slo: Mapping[str, float | None] | None) -> dict:
    """The JSON document of a run's summary rows (one per variant, or per run of a repeated variant):
    a variant per label, its ``summary`` (the median of its runs when repeated, every run in ``runs``)."""
    variants = []
    for runs in group_by_label(rows):
        summary = runs[0] if len(runs) == 1 else median_row(runs)
        variant = {"label": summary.get("label"), "num_runs": len(runs),
                   "summary": {column: json_value(value) for column, value in summary.items()},
                   "vllm": vllm_figures(summary)}
        if len(runs) > 1:
            variant["runs"] = [{column: json_value(value) for column, value in run.items()} for run in runs]
        variants.append(variant)
    first = rows[0] if rows else {}
    return {"format_version": FORMAT_VERSION, "command": command, "kvtool_version": first.get("kvtool_version"),
            "git_revision": first.get("git_revision"),
            "interrupted": any(str(row.get("interrupted")) == "True" for row in rows),
            "percentiles": list(percentiles), "slo": dict(slo) if slo else None, "variants": variants}


def write_report_json(path: str | os.PathLike, document: Mapping) -> Path:
    """Writes the document atomically (a reader sees the previous file or the new one)."""
    path = Path(path)
    with atomic_write(path) as out:
        json.dump(document, out, indent=2, allow_nan=False)
        out.write("\n")
    return path
