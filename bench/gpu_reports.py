"""What the GPU benchmark scripts (gpu_e2e.py, gpu_startup.py) share: their CSV files."""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple


def write_rows_csv(path: Path, rows: Sequence[NamedTuple], header: Mapping[str, str]) -> None:
    """One line per row, the run's header (device, model, ...) repeated on each, so that files from
    several machines concatenate."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(header) + list(type(rows[0])._fields) if rows else list(header))
        writer.writeheader()
        for row in rows:
            writer.writerow({**header, **row._asdict()})
