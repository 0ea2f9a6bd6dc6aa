"""GET /metrics: the engine's counters and the server's latencies in Prometheus' text format.

Each server has its own registry (two servers in one process, as in the tests, never share a
counter). The cache counters are read from the engine when scraped, between two steps, so
they are exactly the counters `kvtool bench` writes in its summary; TTFT and end-to-end latency
are histograms the handlers observe as requests finish (TTFT counted from when the server read
the request, so it includes queueing).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtool.reports.cache_counters import COUNTERS

if TYPE_CHECKING:  # the engine (and torch) load only when a server runs
    from kvtool.serve.engine_loop import EngineCounts

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "kvtool"
# Seconds: from a fully cached prompt on a GPU to long prompts on a busy CPU.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

GAUGES = (
    ("primary_blocks", "Blocks of the primary pool"),
    ("primary_free_blocks", "Primary blocks holding nothing"),
    ("primary_cached_blocks", "Primary blocks holding reusable KV"),
    ("primary_used_blocks", "Primary blocks held by running requests"),
    ("secondary_blocks", "Blocks of the host pool"),
    ("secondary_cached_blocks", "Host blocks holding offloaded KV"),
)


class _EngineCollector:
    """Yields the counters of the EngineCounts read for this scrape."""

    def __init__(self) -> None:
        self.counts: EngineCounts | None = None

    def collect(self) -> Iterator[Metric]:
        counts = self.counts
        if counts is None:
            return
        stats = counts.stats
        for key, text in COUNTERS:
            if key in stats:  # the third tier's only where the engine has one
                yield CounterMetricFamily(f"{PREFIX}_{key}", text, value=stats[key])
        yield GaugeMetricFamily(f"{PREFIX}_cache_hit_rate", "Reused / (reused + missed) full prompt blocks",
                                value=stats["cache_hit_rate"])
        for key, text in GAUGES:
            yield GaugeMetricFamily(f"{PREFIX}_{key}", text, value=stats[key])
        yield GaugeMetricFamily(f"{PREFIX}_num_requests_running", "Requests the scheduler runs",
                                value=counts.num_running_requests)
        yield GaugeMetricFamily(f"{PREFIX}_num_requests_waiting", "Requests queued in the scheduler",
                                value=counts.num_queued_requests)
        yield GaugeMetricFamily(f"{PREFIX}_tokens_per_block", "Tokens per KV block (a router's block size, and the "
                                "pools' blocks in tokens)", value=counts.tokens_per_block)
        yield CounterMetricFamily(f"{PREFIX}_aborted_requests", "Requests aborted: the client went away, or the "
                                  "server stopped", value=counts.num_aborted_requests)


class ServerMetrics:
    """The registry of one server: latency histograms, request counts, and the engine's counters."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time to first token (server side)",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Request latency, read to last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self._engine = _EngineCollector()
        self.registry.register(self._engine)

    def observe(self, *, ttft_s: float | None, e2e_s: float | None) -> None:
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if e2e_s is not None:
            self.e2e.observe(e2e_s)

    def render(self, counts: EngineCounts) -> bytes:
        self._engine.counts = counts
        return generate_latest(self.registry)
