"""Service-level objectives of a bench run (``--slo ttft=500ms,tpot=50ms``) and whether a request met them.

Goodput, as vLLM's ``--goodput`` and DistServe define it, counts the requests that met every objective
given: a request that failed meets none, and a one-token answer has no TPOT to miss (vLLM counts its
TPOT as 0). The summary reports the fraction of measured requests that met them (``slo_attainment``)
and how many did per second of the run (``goodput_requests_per_s``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvtool.reports.metrics import RequestMetrics

# The objectives, by the name --slo takes (vLLM's `e2el` accepted too), and the RequestMetrics field each bounds.
_NAMES = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms", "e2el": "e2e_ms"}
_UNITS = {"ms": 1.0, "s": 1000.0, "": 1.0}  # a bare number is milliseconds, as vLLM's --goodput takes it
_VALUE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s|)\s*$")
EXPECTED = "expected NAME=VALUE[ms|s] pairs separated by commas, NAME one of ttft, tpot, e2e (e.g. " \
           "--slo ttft=500ms,tpot=50ms)"


@dataclass(frozen=True)
class Slo:
    """Upper bounds in milliseconds (None: not an objective); at least one is given."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        bounds = self.bounds()
        if not bounds:
            raise ValueError(f"--slo names no objective: {EXPECTED}")
        for name, bound in bounds:
            if not bound > 0 or bound == float("inf"):
                raise ValueError(f"--slo {name.removesuffix('_ms')}={bound:g}ms: a bound must be a positive, finite "
                                 "time")

    def bounds(self) -> tuple[tuple[str, float], ...]:
        """(RequestMetrics field, bound in ms) of each objective given."""
        return tuple((name, bound) for name, bound in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms),
                                                       ("e2e_ms", self.e2e_ms)) if bound is not None)

    def met(self, request: RequestMetrics) -> bool:
        """Whether the request finished without error within every bound (a missing TPOT, one output
        token, meets a TPOT bound)."""
        if not request.ok:
            return False
        for name, bound in self.bounds():
            value = getattr(request, name)
            if value is None:
                if name == "tpot_ms":
                    continue
                return False
            if value > bound:
                return False
        return True

    def as_row(self) -> dict[str, float | None]:
        """The summary's configuration columns: slo_ttft_ms, slo_tpot_ms, slo_e2e_ms."""
        return {"slo_ttft_ms": self.ttft_ms, "slo_tpot_ms": self.tpot_ms, "slo_e2e_ms": self.e2e_ms}

    def describe(self) -> str:
        """'TTFT ≤ 500 ms, TPOT ≤ 50 ms'."""
        return describe_bounds(self.as_row())


def describe_bounds(row) -> str:
    """The objectives a summary row records ('TTFT ≤ 500 ms, TPOT ≤ 50 ms'); '' when it records none."""
    parts = []
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E")):
        value = row.get(f"slo_{name}_ms")
        if value not in (None, ""):
            parts.append(f"{title} ≤ {float(value):g} ms")
    return ", ".join(parts)


def parse_slo(text: str) -> Slo:
    """``ttft=500ms,tpot=50ms,e2e=2s`` (vLLM's ``ttft:500`` spelling too; a bare number is ms) as an Slo;
    a ValueError naming --slo and the expected form otherwise."""
    bounds: dict[str, float] = {}
    for part in text.split(","):
        name, separator, value = part.replace(":", "=", 1).partition("=")
        name = name.strip().lower()
        if not separator or name not in _NAMES:
            raise ValueError(f"--slo {text!r}: {part.strip()!r} is not an objective: {EXPECTED}")
        match = _VALUE.match(value)
        if match is None:
            raise ValueError(f"--slo {text!r}: {value.strip()!r} is not a time for {name}: {EXPECTED}")
        field = _NAMES[name]
        if field in bounds:
            raise ValueError(f"--slo {text!r}: {name} is given twice: give each objective once")
        bounds[field] = float(match.group(1)) * _UNITS[match.group(2)]
    return Slo(**bounds)
