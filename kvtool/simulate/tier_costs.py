"""What moving a block into and out of the third KV tier costs a simulated engine: per tier (disk,
remote), a fetch (third tier -> host, on the step path before the request is admitted) and a spill
(host -> third tier: the part on the step path; a writer thread does the rest) each cost
``latency + bytes / bandwidth`` per block, and a remote lookup one round trip per staging.

The defaults are fitted to what bench/tiers.py measured on this machine (results/tiers.md), whose
points kvtool/simulate/tier_costs.json holds; ``--tier_cost`` overrides them:
``--tier_cost disk=80us,7GB/s`` (a fetch: latency, bandwidth), ``--tier_cost remote.spill=0us,10GB/s``,
``--tier_cost remote.lookup=300us``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtool.units import parse_bytes

CALIBRATION = Path(__file__).with_name("tier_costs.json")
TIER_NAMES = ("disk", "remote")
_DURATION_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


@dataclass(frozen=True)
class Transfer:
    """One direction's cost per block: ``latency_s`` + bytes / ``bytes_per_s``."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s

    def describe(self) -> str:
        return f"{self.latency_s * 1e6:.0f} µs + bytes / {self.bytes_per_s / 1e9:.2f} GB/s"


@dataclass(frozen=True)
class TierCost:
    """A third tier's costs on the step path: a block fetched, a block spilled, a lookup (remote)."""

    fetch: Transfer
    spill: Transfer
    lookup_s: float

    def describe(self) -> str:
        lookup = f", lookup {self.lookup_s * 1e6:.0f} µs" if self.lookup_s else ""
        return f"fetch {self.fetch.describe()}, spill {self.spill.describe()}{lookup}"


def fit_transfer(points: Sequence[Sequence[float]]) -> Transfer:
    """latency + bytes / bandwidth fitted to (block bytes, microseconds) points by least squares on the
    relative error; a latency that comes out negative is dropped (the bandwidth alone is fitted)."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float) * 1e-6
    solution, *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1) / y[:, None], np.ones_like(y), rcond=None)
    latency, per_byte = float(solution[0]), float(solution[1])
    if latency < 0:
        ratio = x / y
        latency, per_byte = 0.0, float(ratio.sum() / (ratio * ratio).sum())
    return Transfer(latency, 1.0 / per_byte)


def calibrated_costs(path: Path = CALIBRATION) -> dict[str, TierCost]:
    """Each tier's costs fitted to the measured points in ``path``."""
    document = json.loads(path.read_text(encoding="utf-8"))
    return {name: TierCost(fit_transfer(tier["fetch_us"]), fit_transfer(tier["spill_us"]), tier["lookup_us"] * 1e-6)
            for name, tier in document["tiers"].items()}



@dataclass(frozen=True)
class TierCosts:
    """The costs of both third tiers, and where they come from (a report column)."""

    tiers: dict[str, TierCost]
    source: str

    def describe(self, tier: str) -> str:
        return f"{tier} tier: {self.tiers[tier].describe()} ({self.source})"


def tier_costs(overrides: Sequence[str] = ()) -> TierCosts:
    """The calibrated costs with ``--tier_cost`` overrides applied (ValueError naming the flag)."""
    tiers = calibrated_costs()
    for spec in overrides:
        name, _, value = spec.partition("=")
        tier, _, part = name.strip().partition(".")
        part = part or "fetch"
        if tier not in TIER_NAMES or part not in ("fetch", "spill", "lookup") or not value:
            raise ValueError(f"--tier_cost {spec}: give TIER=LATENCY,BANDWIDTH (a fetch), TIER.spill=LATENCY,"
                             "BANDWIDTH or remote.lookup=LATENCY, TIER one of disk|remote, e.g. --tier_cost "
                             "disk=80us,7GB/s")
        cost = tiers[tier]
        if part == "lookup":
            tiers[tier] = dataclasses.replace(cost, lookup_s=_duration(value, spec))
            continue
        latency, _, bandwidth = value.partition(",")
        transfer = Transfer(_duration(latency, spec), _bandwidth(bandwidth, spec))
        tiers[tier] = dataclasses.replace(cost, **{part: transfer})
    source = "calibrated from results/tiers.md" + (f", {' '.join(overrides)}" if overrides else "")
    return TierCosts(tiers, source)


def _duration(text: str, spec: str) -> float:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us|µs|ns)\s*", text)
    if not match:
        raise ValueError(f"--tier_cost {spec}: latency {text.strip()!r} is not a duration: give e.g. 80us, 0.1ms")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def _bandwidth(text: str, spec: str) -> float:
    amount = text.strip().removesuffix("/s")
    try:
        value = parse_bytes(amount) if amount else 0
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"--tier_cost {spec}: bandwidth {text.strip()!r} is not a rate: give e.g. 1.2GB/s, 800MB/s")
    return float(value)
