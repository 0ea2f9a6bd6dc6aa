"""What every engine's replay script shares: the dataset's requests, and the reports they write.

Runs in kvtool's venv and in a peer's own venv (with the repository on PYTHONPATH): it imports
only kvtool's pure-Python report code (no torch, no C++ extension), so every engine writes the
per-request and summary columns `kvtool bench` writes, from one definition (RequestMetrics).
Each run writes, under its output directory:

    requests.csv    one row per measured request (kvtool's per-request columns, engine named)
    summary.csv     one row: kvtool's summary metrics + the engine's configuration and counters
    outputs.jsonl   {"request_id", "output_token_ids"} per measured request, to compare engines
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtool.workloads.datasets import load_dataset
from kvtool.reports.metrics import RequestMetrics, summarize
from kvtool.reports.csv_report import RequestCsvWriter, write_summary_csv
from kvtool.errors import DatasetError

MS_PER_S = 1000.0


@dataclass(frozen=True)
class PeerRequest:
    """One dataset line as the peers replay it: token ids in, a fixed number of tokens out, and when it
    is due (seconds after the measured run starts; None: as soon as a slot is free)."""

    request_id: str
    input_ids: list[int]
    output_tokens: int
    arrival_time_s: float | None = None


def replay_arguments(doc: str | None, *, model_help: str) -> argparse.ArgumentParser:
    """The arguments every replay script takes: the model, the dataset, where to write, the label, the warm-up."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "--plan", dest="model", required=True, help=model_help)
    parser.add_argument("--dataset", required=True, help="a kvtool dataset (JSON Lines of token ids)")
    parser.add_argument("--output", required=True, type=Path, help="the run's directory")
    parser.add_argument("--label", required=True, help="the variant's name in the reports")
    parser.add_argument("--warmup", type=int, default=1, help="leading requests run first, uncounted")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests in flight: 1 is sequential; 0 leaves them unlimited (with the dataset's "
                             "arrival times, a request rate)")
    return parser


def replay_mode(args, measured: Sequence[PeerRequest]) -> dict[str, object]:
    """The replay columns of the summary, named as `kvtool bench` names them."""
    timed = any(request.arrival_time_s is not None for request in measured)
    return {"mode": "sequential" if args.concurrency == 1 and not timed else "offline",
            "concurrency": args.concurrency or None, "arrivals": "dataset" if timed else None}


def load_requests(path: str | Path) -> list[PeerRequest]:
    """The dataset's lines; peers replay token-id lines only, one independent request each."""
    dataset = load_dataset(path)
    requests = []
    for index, record in enumerate(dataset.records):
        if record.input_ids is None or record.session_id is not None:
            raise DatasetError(f"{dataset.where(record)}: the peer scripts replay token-id lines without sessions "
                               "(write the dataset with `kvtool dataset ... --text FILE --plan DIR`)")
        request_id = record.request_id if record.request_id is not None else str(index)
        requests.append(PeerRequest(request_id, list(record.input_ids), record.output_tokens, record.arrival_time_s))
    return requests


def request_row(*, label: str, engine: str, request: PeerRequest, bench_start: float, arrival: float,
                ttft_s: float, finish: float, output_token_ids: Sequence[int], cached_tokens: int,
                token_times: Sequence[float] = (), mean_token_gap_s: float | None = None) -> RequestMetrics:
    """A finished request's row. ``token_times`` (each token's time) gives every inter-token gap; an
    engine that reports only its first and last token times gives their ``mean_token_gap_s``."""
    num_output = len(output_token_ids)
    ttft_ms, e2e_ms = ttft_s * MS_PER_S, (finish - arrival) * MS_PER_S
    tpot_ms = (e2e_ms - ttft_ms) / (num_output - 1) if num_output > 1 else None
    gaps = tuple((b - a) * MS_PER_S for a, b in zip(token_times, token_times[1:]))
    itl_ms = sum(gaps) / len(gaps) if gaps else None
    if mean_token_gap_s is not None:
        itl_ms = mean_token_gap_s * MS_PER_S
    return RequestMetrics(
        label=label, engine=engine, request_id=request.request_id, session_id=None, turn=None,
        input_tokens=len(request.input_ids), output_tokens=num_output, reused_tokens=cached_tokens,
        onboarded_blocks=0, arrival_s=arrival - bench_start, first_token_s=arrival + ttft_s - bench_start,
        finish_s=finish - bench_start, ttft_ms=ttft_ms, tpot_ms=tpot_ms, itl_ms=itl_ms, e2e_ms=e2e_ms,
        token_gaps_ms=gaps, output_token_ids=tuple(int(t) for t in output_token_ids))


class RunReport:
    """Writes one engine run: rows as requests finish, then the summary and the output ids."""

    def __init__(self, output_dir: str | Path, *, label: str, engine: str) -> None:
        self.output_dir = Path(output_dir)
        self.label, self.engine = label, engine
        self.started_at = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        self.rows: list[RequestMetrics] = []
        self._writer = RequestCsvWriter(self.output_dir / "requests.csv")

    def add(self, row: RequestMetrics) -> None:
        self._writer.write(row)
        self.rows.append(row)

    def finish(self, config: Mapping[str, object]) -> dict:
        """Close the files; ``config`` (engine version, flags, cache counters) joins the summary row."""
        from kvtool.runtime.device import host_description  # imports torch, which every engine here has

        self._writer.close()
        write_outputs(self.output_dir / "outputs.jsonl", self.rows)
        row = {"label": self.label, "engine": self.engine, "started_at": self.started_at, **config,
               **summarize(self.rows).as_row(), "device": f"cpu: {host_description()}", "host": host_description(),
               "requests_csv": "requests.csv"}
        write_summary_csv(self.output_dir / "summary.csv", [row])
        return row


def write_outputs(path: Path, rows: Sequence[RequestMetrics]) -> None:
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps({"request_id": row.request_id, "output_token_ids": list(row.output_token_ids)}) + "\n")


def read_outputs(path: str | Path) -> dict[str, list[int]]:
    with Path(path).open(encoding="utf-8") as source:
        lines = [json.loads(text) for text in source if text.strip()]
    return {line["request_id"]: line["output_token_ids"] for line in lines}

