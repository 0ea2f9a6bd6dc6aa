"""Stopping a run once a percentile objective is provably missed (the SLO search's cheapest pruning: an
overloaded fleet, the slowest to simulate, is the one whose answer is known first).

The q-th percentile of N values (numpy's linear interpolation, kvtool.reports.metrics.percentile) lies at
or above the value of rank floor(q/100 * (N - 1)) in ascending order; that value exceeds the bound as soon
as N - floor(q/100 * (N - 1)) values do. Values only add up as requests finish, so once that many
finished requests exceed a bound, the run's percentile will too. N counts the measured requests that
will have the value (a TPOT needs two output tokens); a request that fails leaves fewer values, which
never needs more exceeding ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvtool.reports.slo import PercentileObjective, Slo
from kvtool.runtime.request import Request


class SloMissed(Exception):
    """A run stopped because a percentile objective can no longer be met (the message says which)."""


def exceeding_needed(num_values: int, percentile: float) -> int:
    """How many of ``num_values`` values above a bound put their ``percentile``-th percentile above it."""
    return num_values - math.floor(percentile / 100 * (num_values - 1)) if num_values else 1


def _value_ms(request: Request, metric: str) -> float | None:
    first, finish, arrival = request.first_token_time, request.finish_time, request.arrival_time
    if first is None or finish is None or arrival is None:
        return None
    if metric == "ttft_ms":
        return (first - arrival) * 1000
    if metric == "e2e_ms":
        return (finish - arrival) * 1000
    num_output = request.num_output_tokens
    return (finish - first) * 1000 / (num_output - 1) if num_output > 1 else None


class SloEarlyStop:
    """Counts the finished requests above each percentile objective's bound; ``finished`` raises SloMissed
    once one objective cannot be met. ``output_lengths``: the measured requests' output tokens."""

    def __init__(self, slo: Slo, output_lengths: Sequence[int]) -> None:
        self.objectives: list[PercentileObjective] = list(slo.percentiles)
        num_values = {"ttft_ms": len(output_lengths), "e2e_ms": len(output_lengths),
                      "tpot_ms": sum(1 for n in output_lengths if n > 1)}
        self.needed = [exceeding_needed(num_values[o.metric], o.percentile) for o in self.objectives]
        self.exceeding = [0] * len(self.objectives)

    def reset(self) -> None:
        """Forget what finished so far (the warm-up's requests)."""
        self.exceeding = [0] * len(self.objectives)

    def finished(self, request: Request) -> None:
        if request.error is not None:
            return
        for i, objective in enumerate(self.objectives):
            value = _value_ms(request, objective.metric)
            if value is not None and value > objective.bound_ms:
                self.exceeding[i] += 1
                if self.exceeding[i] >= self.needed[i]:
                    raise SloMissed(f"{objective.name} is missed: {self.exceeding[i]:,} requests took more than "
                                    f"{objective.bound_ms:g} ms, so the {objective.name.rpartition('_')[2]} of the "
                                    "run exceeds it whatever the rest take")
