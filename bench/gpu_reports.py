"""What the GPU benchmark scripts share: their CSV files, and timing a GPU call."""

from __future__ import annotations

import csv
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple


def median_gpu_ms(fn: Callable[[], object], reps: int, warmup: int, sleep_cycles: int = 0) -> float:
    """Median GPU time (ms) of ``fn()`` on the current stream, CUDA events around each call. With
    ``sleep_cycles``, a sleep kernel keeps the GPU busy while Python enqueues (so launch overhead leaves
    no gaps inside the timed region)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def write_rows_csv(path: Path, rows: Sequence[NamedTuple], header: Mapping[str, str]) -> None:
    """One line per row, the run's header (device, model, ...) repeated on each, so that files from
    several machines concatenate."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(header) + list(type(rows[0])._fields) if rows else list(header))
        writer.writeheader()
        for row in rows:
            writer.writerow({**header, **row._asdict()})
