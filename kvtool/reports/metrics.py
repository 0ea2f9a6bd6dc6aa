"""Per-request and summary metrics of a bench run, as trtllm-bench defines them.

Times come from the Request (time.perf_counter seconds); reports give them in seconds since the
bench start (``arrival_s``, ``first_token_s``, ``finish_s``) and latencies in milliseconds. The
definitions (arrival, TTFT, TPOT, ITL, E2E, throughput, percentiles) are in
docs/architecture.md#how-bench-measures and the README; goodput under service-level objectives in
kvtool.reports.slo.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtool.runtime.request import MISS_REASONS, Request

if TYPE_CHECKING:
    from kvtool.reports.slo import Slo

MS_PER_S = 1000.0
PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@dataclass(slots=True)
class RequestMetrics:
    """One row of the per-request CSV. Times in seconds since the bench start, latencies in ms.
    ``engine`` names what served the request (kvtool, or a peer replayed by bench/peers/).

    Not frozen: a frozen dataclass sets each of its 28 fields through object.__setattr__, 7 µs a
    row, a tenth of what `kvtool simulate` may spend on a whole request."""

    label: str
    engine: str
    request_id: str
    session_id: str | None
    turn: int | None
    input_tokens: int
    output_tokens: int
    reused_tokens: int
    onboarded_blocks: int
    arrival_s: float
    first_token_s: float | None
    finish_s: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    itl_ms: float | None
    e2e_ms: float | None
    error: str | None = None
    endpoint: str | None = None  # the server's URL when replayed through `kvtool bench --endpoint`
    # Full prompt blocks not reused, and by reason (MISS_REASONS, docs/architecture.md#kv-cache-rules):
    # they sum to missed_blocks. None where the engine does not say (an endpoint, a peer engine).
    missed_blocks: int | None = None
    missed_never_seen_blocks: int | None = None
    missed_evicted_primary_blocks: int | None = None
    missed_evicted_host_blocks: int | None = None
    missed_identity_blocks: int | None = None
    missed_partial_blocks: int | None = None
    missed_last_token_blocks: int | None = None
    missed_reuse_off_blocks: int | None = None
    replica: int | None = None  # which replica of a fleet served it (kvtool.fleet); None: not a fleet's
    # Every gap between consecutive tokens (ms); kept in memory for the pooled ITL, not written to CSV.
    token_gaps_ms: tuple[float, ...] = ()
    # The generated token ids; kept in memory (bench/peers/ compares them across engines), not written to CSV.
    output_token_ids: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_s is not None


CSV_COLUMNS = tuple(name for name in RequestMetrics.__dataclass_fields__
                    if name not in ("token_gaps_ms", "output_token_ids"))
ENGINE = "kvtool"
MISS_COLUMNS = ("missed_blocks", *(f"missed_{reason}_blocks" for reason in MISS_REASONS))


_miss_counts = operator.itemgetter(*MISS_REASONS)  # a {reason: blocks} dict's counts in MISS_REASONS order


def request_metrics(request: Request, *, label: str, bench_start: float, engine: str = ENGINE,
                    endpoint: str | None = None) -> RequestMetrics:
    """One request's row (see the module docstring)."""
    arrival = request.arrival_time
    first_token, finish = request.first_token_time, request.finish_time
    ttft = None if first_token is None else (first_token - arrival) * MS_PER_S
    e2e = None if finish is None else (finish - arrival) * MS_PER_S
    num_output = request.num_output_tokens
    tpot = (e2e - ttft) / (num_output - 1) if ttft is not None and e2e is not None and num_output > 1 else None
    gaps: tuple[float, ...] = ()
    itl = None
    times = request.token_times
    if len(times) > 1:
        gaps = tuple((b - a) * MS_PER_S for a, b in zip(times, times[1:]))
        itl = sum(gaps) / len(gaps)
    error = request.error
    if error is None and request.finish_reason in ("error", "abort"):
        error = request.finish_reason
    line = request.line
    reasons = request.miss_reasons
    misses = (None,) * len(MISS_COLUMNS) if reasons is None else (sum(reasons.values()), *_miss_counts(reasons))
    # Positional, in field order (MISS_COLUMNS follow endpoint, then replica): a row is built per finished
    # request, and keywords cost `kvtool simulate` a few of the ~50 µs it has for one.
    return RequestMetrics(
        label, engine, request.name, None if line is None else line.session_id, None if line is None else line.turn,
        request.num_prompt_tokens, num_output, request.num_reused_tokens, request.num_onboarded_blocks,
        arrival - bench_start, None if first_token is None else first_token - bench_start,
        None if finish is None else finish - bench_start, ttft, tpot, itl, e2e, error, endpoint, *misses,
        request.replica, gaps, tuple(request.output_token_ids))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    return _sorted_percentile(sorted(values), q)


def _sorted_percentile(ordered: Sequence[float], q: float) -> float:
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentile_name(q: float) -> str:
    """A percentile's column suffix: 'p50', 'p99.9' (vLLM's report spells them alike)."""
    return "p" + f"{q:.6f}".rstrip("0").rstrip(".")


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``--percentiles 95,99.9``: the percentiles reported besides the default p50, p90 and p99 (every
    report keeps those, so that any two can be compared), ascending."""
    values = set(PERCENTILES)
    for part in text.split(","):
        try:
            q = float(part)
        except ValueError:
            q = None
        if q is None or not 0 <= q <= 100:
            raise ValueError(f"--percentiles {text!r}: {part.strip()!r} is not a percentile: give numbers from 0 to "
                             "100 separated by commas (e.g. --percentiles 95,99.9)")
        values.add(int(q) if q.is_integer() else q)
    return tuple(sorted(values))


@dataclass(frozen=True)
class SummaryOptions:
    """What a summary reports beyond the defaults: more percentiles (--percentiles), goodput under
    service-level objectives (--slo: a kvtool.reports.slo.Slo)."""

    percentiles: tuple[float, ...] = PERCENTILES
    slo: Slo | None = None

    def __post_init__(self) -> None:
        if not self.percentiles or any(not 0 <= q <= 100 for q in self.percentiles):
            raise ValueError(f"percentiles must lie in 0..100, got {self.percentiles}")
        if self.slo is not None and not set(self.slo.percentile_values) <= set(self.percentiles):
            # A percentile objective (--slo ttft_p95=2s) is reported as the percentiles asked for are.
            object.__setattr__(self, "percentiles", tuple(sorted({*self.percentiles, *self.slo.percentile_values})))


@dataclass(frozen=True)
class LatencyStats:
    """Mean and percentiles of one latency metric (ms); None where no value exists."""

    mean: float | None
    percentiles: tuple[tuple[float, float | None], ...]  # (q, value), ascending q

    def at(self, q: float) -> float | None:
        return dict(self.percentiles).get(q)

    @property
    def p50(self) -> float | None:
        return self.at(50)

    @property
    def p90(self) -> float | None:
        return self.at(90)

    @property
    def p99(self) -> float | None:
        return self.at(99)

    @classmethod
    def of(cls, values: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> LatencyStats:
        if not values:
            return cls(None, tuple((q, None) for q in percentiles))
        ordered = sorted(values)
        return cls(sum(values) / len(values), tuple((q, _sorted_percentile(ordered, q)) for q in percentiles))

    def columns(self, metric: str) -> dict[str, float | None]:
        """'<metric>_mean', '<metric>_p50', ... (ttft_ms_p99.9)."""
        return {f"{metric}_mean": self.mean, **{f"{metric}_{percentile_name(q)}": v for q, v in self.percentiles}}


@dataclass(frozen=True)
class BenchMetrics:
    """The summary metrics of a run (what the summary CSV's metric columns hold)."""

    num_requests: int            # finished without error
    num_errors: int
    total_input_tokens: int
    total_output_tokens: int
    total_reused_tokens: int
    # total_reused_tokens / total_input_tokens: the share of prompt tokens read from the cache (a
    # server's cached_tokens, kvtool's reused blocks' tokens), so an endpoint run compares with an
    # in-process one; None without prompt tokens. cache_hit_rate counts full blocks instead.
    token_hit_rate: float | None
    duration_s: float | None     # last finish - first arrival
    output_tokens_per_s: float | None
    input_tokens_per_s: float | None
    total_tokens_per_s: float | None   # input + output tokens
    requests_per_s: float | None
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    # With service-level objectives (kvtool.reports.slo): the share of measured requests (errors
    # included) that met all of them, and how many did per second; None without.
    slo_attainment: float | None = None
    goodput_requests_per_s: float | None = None
    # With percentile objectives (--slo ttft_p90=2s): whether the run's percentiles met every one; None without.
    slo_met: bool | None = None

    def as_row(self) -> dict[str, float | int | None]:
        """Flat columns: scalars by name, latency stats as '<metric>_<stat>' (ttft_ms_p99, ...); the
        goodput columns only when objectives were given, slo_met only when percentile objectives were."""
        row: dict[str, float | int | None] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, LatencyStats):
                row.update(value.columns(name))
            elif name == "slo_met":
                if value is not None:
                    row[name] = value
            elif name not in ("slo_attainment", "goodput_requests_per_s") or self.slo_attainment is not None:
                row[name] = value
        return row


def summarize(requests: Sequence[RequestMetrics], options: SummaryOptions = SummaryOptions()) -> BenchMetrics:
    """Summary metrics of finished requests (see the module docstring for the definitions)."""
    ok = [r for r in requests if r.ok]
    errors = [r for r in requests if not r.ok]
    duration = None
    if ok:
        duration = max(r.finish_s for r in ok) - min(r.arrival_s for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    total_input, total_reused = sum(r.input_tokens for r in ok), sum(r.reused_tokens for r in ok)

    def rate(amount: float) -> float | None:
        return amount / duration if duration else None

    percentiles = options.percentiles
    gaps = [g for r in ok for g in r.token_gaps_ms]
    if gaps or not ok:
        itl = LatencyStats.of(gaps, percentiles)
    else:
        # Rows read back from a CSV carry only each request's mean gap: the pooled mean is exact.
        weighted = [(r.itl_ms, r.output_tokens - 1) for r in ok if r.itl_ms is not None and r.output_tokens > 1]
        num_gaps = sum(n for _, n in weighted)
        itl = LatencyStats(sum(m * n for m, n in weighted) / num_gaps if num_gaps else None,
                           tuple((q, None) for q in percentiles))

    def stats(name: str) -> LatencyStats:
        return LatencyStats.of([getattr(r, name) for r in ok if getattr(r, name) is not None], percentiles)

    attainment = goodput = None
    if options.slo is not None and requests:
        num_met = sum(options.slo.met(r) for r in ok)
        attainment, goodput = num_met / len(requests), rate(num_met)
    metrics = BenchMetrics(
        num_requests=len(ok), num_errors=len(errors),
        total_input_tokens=total_input, total_output_tokens=total_output,
        total_reused_tokens=total_reused, token_hit_rate=total_reused / total_input if total_input else None,
        duration_s=duration,
        output_tokens_per_s=rate(total_output), input_tokens_per_s=rate(total_input),
        total_tokens_per_s=rate(total_input + total_output), requests_per_s=rate(len(ok)),
        ttft_ms=stats("ttft_ms"), tpot_ms=stats("tpot_ms"), itl_ms=itl, e2e_ms=stats("e2e_ms"),
        slo_attainment=attainment, goodput_requests_per_s=goodput)
    if options.slo is not None and options.slo.percentiles:
        metrics = dataclasses.replace(metrics, slo_met=options.slo.percentiles_met(metrics))
    return metrics


def percentile_columns(rows: Sequence[Mapping], metric: str) -> list[tuple[str, str]]:
    """(stat, column) of a latency metric the rows hold: 'mean' first, then every percentile any row
    has, ascending ([('mean', 'ttft_ms_mean'), ('p50', 'ttft_ms_p50'), ('p99.9', 'ttft_ms_p99.9')])."""
    found: dict[str, float] = {}
    prefix = f"{metric}_p"
    for row in rows:
        for column in row:
            if column.startswith(prefix):
                try:
                    found[column] = float(column[len(prefix):])
                except ValueError:
                    continue
    ordered = sorted(found, key=found.__getitem__)
    return [("mean", f"{metric}_mean"), *((column[len(metric) + 1:], column) for column in ordered)]
