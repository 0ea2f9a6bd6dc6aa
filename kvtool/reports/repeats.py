"""Repeated runs of a variant (a scenario's ``repeat: N``): each figure's median and spread, and whether
two variants differ by more than their runs vary.

The verdict is a two-sided Mann-Whitney U test on the runs (exact for the few runs a bench makes):
a difference is reported when runs this far apart would happen by chance less than 5% of the time
if both variants were the same. One run disturbed by the machine's load (a common case on a shared
machine) does not hide a real difference; runs that mostly overlap are called inconclusive.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache

SIGNIFICANCE = 0.05


def as_number(value) -> float | None:
    if value is None or value == "" or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Spread:
    """A figure over the runs of a variant."""

    median: float
    low: float
    high: float
    values: tuple[float, ...]

    @property
    def num_runs(self) -> int:
        return len(self.values)

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values), tuple(values))


@cache
def _num_orderings(m: int, n: int, u: int) -> int:
    """How many orderings of m + n distinct runs have exactly u (a, b) pairs with a < b."""
    if u < 0 or u > m * n:
        return 0
    if m == 0 or n == 0:
        return 1 if u == 0 else 0
    # The largest run is an a (every b is below it: no pair added) or a b (it is above all m a's).
    return _num_orderings(m - 1, n, u) + _num_orderings(m, n - 1, u - m)


def mann_whitney_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test (exact null distribution; ties count half)."""
    m, n = len(a), len(b)
    u = sum(1.0 if x < y else 0.5 if x == y else 0.0 for x in a for y in b)
    low = math.floor(min(u, m * n - u))
    total = math.comb(m + n, m)
    tail = sum(_num_orderings(m, n, k) for k in range(low + 1)) / total
    return min(1.0, 2 * tail)


def spread(rows: Sequence[Mapping], column: str) -> Spread | None:
    """The figure ``column`` over these runs (None when no run has it)."""
    values = [number for number in (as_number(row.get(column)) for row in rows) if number is not None]
    return Spread.of(values) if values else None


def group_by_label(rows: Sequence[Mapping]) -> list[list[Mapping]]:
    """Rows of the same label (the runs of one variant), in first-seen order."""
    groups: dict[str, list[Mapping]] = {}
    for row in rows:
        groups.setdefault(str(row.get("label", "")), []).append(row)
    return list(groups.values())


def median_row(rows: Sequence[Mapping]) -> dict:
    """One row standing for the runs: numbers are medians, other values the first run's; a run that was
    interrupted marks the whole; ``num_runs`` counts them."""
    merged = dict(rows[0])
    for column in merged:
        if column in ("interrupted", "repeat"):
            continue
        figure = spread(rows, column)
        if figure is not None and all(as_number(row.get(column)) is not None for row in rows):
            merged[column] = figure.median
    merged["interrupted"] = any(str(row.get("interrupted")) == "True" for row in rows)
    merged["num_runs"] = len(rows)
    return merged


@dataclass(frozen=True)
class Verdict:
    """How a variant compares with the baseline on one figure (lower is better)."""

    ratio: float                 # median / baseline median
    conclusive: bool             # every run on one side of every baseline run
    text: str


def verdict(name: str, figure: Spread, baseline_name: str, baseline: Spread, unit: str = "ms") -> Verdict | None:
    """Faster or slower when the runs show it (mann_whitney_p below SIGNIFICANCE), else inconclusive;
    None when the baseline's median is 0."""
    if not baseline.median:
        return None
    ratio = figure.median / baseline.median
    if figure.num_runs < 2 or baseline.num_runs < 2:
        return Verdict(ratio, False, f"{name} / {baseline_name} = {ratio:.2f}x from single runs: how much runs vary "
                                    "is unknown (repeat them: a scenario's `repeat: 5`)")
    p = mann_whitney_p(figure.values, baseline.values)
    runs = (f"medians of {figure.num_runs} and {baseline.num_runs} runs; runs {name} {figure.low:,.1f}-"
            f"{figure.high:,.1f} {unit}, {baseline_name} {baseline.low:,.1f}-{baseline.high:,.1f} {unit}; p = {p:.3f}")
    if p >= SIGNIFICANCE:
        apart = figure.low > baseline.high or figure.high < baseline.low
        why = ("too few runs to tell, even apart (repeat them 5 times)" if apart
               else "the runs overlap too much")
        return Verdict(ratio, False, f"{name} / {baseline_name} = {ratio:.2f}x is inconclusive: {why} ({runs})")
    direction = "slower" if figure.median > baseline.median else "faster"
    return Verdict(ratio, True, f"{name} is {direction}: {ratio:.2f}x {baseline_name} ({runs})")
