"""Service-level objectives of a run (``--slo``) and whether requests and runs met them.

Two forms, one grammar (``NAME=TIME`` pairs separated by commas, TIME in ms or s, a bare number ms):

- ``ttft=500ms``, ``tpot=50ms``, ``e2e=2s``: a bound on every request. Goodput, as vLLM's ``--goodput``
  and DistServe define it, counts the requests that met every bound: a request that failed meets none,
  and a one-token answer has no TPOT to miss (vLLM counts its TPOT as 0). The summary reports the
  fraction of measured requests that met them (``slo_attainment``) and how many did per second
  (``goodput_requests_per_s``).
- ``ttft_p90=2s``, ``tpot_p99.9=80ms``: a bound on the run's percentile (Vidur-Search's and DistServe's
  form of an SLO: p90 TTFT within 2 s). The summary reports the percentile and whether every such
  objective was met (``slo_met``); their bounds also count per request in the attainment and goodput
  (a request meets ``ttft_p90=2s`` when its TTFT is within 2 s: the objective holds when at least about
  90% do), so goodput is reported under either form.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from kvtool.reports.metrics import BenchMetrics, RequestMetrics

# The objectives, by the name --slo takes (vLLM's `e2el` accepted too), and the RequestMetrics field each bounds.
_NAMES = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms", "e2el": "e2e_ms"}
_TITLES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "e2e_ms": "E2E"}
_UNITS = {"ms": 1.0, "s": 1000.0, "": 1.0}  # a bare number is milliseconds, as vLLM's --goodput takes it
_VALUE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s|)\s*$")
_NAME = re.compile(r"^(ttft|tpot|e2el|e2e)(?:_p([0-9]*\.?[0-9]+))?$")
EXPECTED = ("expected NAME=VALUE[ms|s] pairs separated by commas, NAME one of ttft, tpot, e2e (a bound on every "
            "request) or NAME_pQ (a bound on the run's Q-th percentile), e.g. --slo ttft=500ms,tpot=50ms or "
            "--slo ttft_p90=2s,tpot_p90=80ms")


def _percentile_name(q: float) -> str:
    """'p90', 'p99.9' (kvtool.reports.metrics.percentile_name, without importing the report code)."""
    return "p" + f"{q:.6f}".rstrip("0").rstrip(".")


class PercentileObjective(NamedTuple):
    """The run's ``percentile``-th ``metric`` (a RequestMetrics field: ttft_ms, tpot_ms, e2e_ms) within ``bound_ms``."""

    metric: str
    percentile: float
    bound_ms: float

    @property
    def name(self) -> str:
        """As --slo spells it: 'ttft_p90'."""
        return f"{self.metric.removesuffix('_ms')}_{_percentile_name(self.percentile)}"

    @property
    def column(self) -> str:
        """The summary column of the percentile: 'ttft_ms_p90'."""
        return f"{self.metric}_{_percentile_name(self.percentile)}"

    def describe(self) -> str:
        return f"{_TITLES[self.metric]} {_percentile_name(self.percentile)} ≤ {self.bound_ms:g} ms"


@dataclass(frozen=True)
class Slo:
    """Upper bounds in milliseconds on every request (None: not an objective) and on the run's
    percentiles (``percentiles``); at least one objective is given."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    percentiles: tuple[PercentileObjective, ...] = ()

    def __post_init__(self) -> None:
        if not self.bounds():
            raise ValueError(f"--slo names no objective: {EXPECTED}")
        named = [(name.removesuffix("_ms"), bound) for name, bound in self.request_bounds()]
        for name, bound in named + [(p.name, p.bound_ms) for p in self.percentiles]:
            if not bound > 0 or bound == float("inf"):
                raise ValueError(f"--slo {name}={bound:g}ms: a bound must be a positive, finite time")
        for objective in self.percentiles:
            if objective.metric not in _TITLES or not 0 < objective.percentile <= 100:
                raise ValueError(f"--slo {objective.name}: a percentile objective bounds ttft, tpot or e2e at a "
                                 "percentile in (0, 100]")

    def request_bounds(self) -> tuple[tuple[str, float], ...]:
        """(RequestMetrics field, bound in ms) of each bound on every request given."""
        return tuple((name, bound) for name, bound in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms),
                                                       ("e2e_ms", self.e2e_ms)) if bound is not None)

    def bounds(self) -> tuple[tuple[str, float], ...]:
        """(RequestMetrics field, bound in ms) a request must meet to count in the goodput: every bound on
        every request, and every percentile objective's bound (the tightest per field)."""
        tightest: dict[str, float] = {}
        for name, bound in (*self.request_bounds(), *((p.metric, p.bound_ms) for p in self.percentiles)):
            tightest[name] = min(bound, tightest.get(name, bound))
        return tuple(tightest.items())

    @property
    def percentile_values(self) -> tuple[float, ...]:
        """The percentiles the summary must report for the percentile objectives."""
        return tuple(sorted({p.percentile for p in self.percentiles}))

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

    def percentiles_met(self, metrics: BenchMetrics) -> bool | None:
        """Whether the run's percentiles are within every percentile objective (None: none given; a
        percentile without a value, no request having finished, is not met)."""
        if not self.percentiles:
            return None
        for objective in self.percentiles:
            value = getattr(metrics, objective.metric).at(objective.percentile)
            if value is None or value > objective.bound_ms:
                return False
        return True

    def as_row(self) -> dict[str, float | None]:
        """The summary's configuration columns: slo_ttft_ms, slo_tpot_ms, slo_e2e_ms, and slo_<column> of
        each percentile objective (slo_ttft_ms_p90)."""
        return {"slo_ttft_ms": self.ttft_ms, "slo_tpot_ms": self.tpot_ms, "slo_e2e_ms": self.e2e_ms,
                **{f"slo_{p.column}": p.bound_ms for p in self.percentiles}}

    def describe(self) -> str:
        """'TTFT ≤ 500 ms, TPOT p90 ≤ 80 ms'."""
        return describe_bounds(self.as_row())


def describe_bounds(row: Mapping) -> str:
    """The objectives a summary row records ('TTFT ≤ 500 ms, TTFT p90 ≤ 2000 ms'); '' when it records none."""
    parts = []
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E")):
        value = row.get(f"slo_{name}_ms")
        if value not in (None, ""):
            parts.append(f"{title} ≤ {float(value):g} ms")
        for column, value in row.items():
            if column.startswith(f"slo_{name}_ms_p") and value not in (None, ""):
                parts.append(f"{title} {column.removeprefix(f'slo_{name}_ms_')} ≤ {float(value):g} ms")
    return ", ".join(parts)


def parse_slo(text: str) -> Slo:
    """``ttft=500ms,tpot=50ms,e2e=2s`` (vLLM's ``ttft:500`` spelling too; a bare number is ms) and
    ``ttft_p90=2s,tpot_p99=80ms`` as an Slo; a one-line ValueError naming --slo and the expected form."""
    bounds: dict[str, float] = {}
    percentiles: dict[tuple[str, float], PercentileObjective] = {}
    for part in text.split(","):
        name, separator, value = part.replace(":", "=", 1).partition("=")
        name = name.strip().lower()
        spelled = _NAME.match(name)
        if not separator or spelled is None:
            raise ValueError(f"--slo {text!r}: {part.strip()!r} is not an objective: {EXPECTED}")
        match = _VALUE.match(value)
        if match is None:
            raise ValueError(f"--slo {text!r}: {value.strip()!r} is not a time for {name}: {EXPECTED}")
        bound = float(match.group(1)) * _UNITS[match.group(2)]
        field = _NAMES[spelled.group(1)]
        if spelled.group(2) is None:
            if field in bounds:
                raise ValueError(f"--slo {text!r}: {name} is given twice: give each objective once")
            bounds[field] = bound
            continue
        q = float(spelled.group(2))
        if not 0 < q <= 100:
            raise ValueError(f"--slo {text!r}: {name}: the percentile must be in (0, 100], e.g. {spelled.group(1)}_p90")
        if (field, q) in percentiles:
            raise ValueError(f"--slo {text!r}: {name} is given twice: give each objective once")
        percentiles[(field, q)] = PercentileObjective(field, int(q) if q.is_integer() else q, bound)
    return Slo(**bounds, percentiles=tuple(percentiles.values()))
