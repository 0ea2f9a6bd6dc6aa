"""Metric definitions (trtllm-bench's) checked against values computed by hand."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvtool.reports.metrics import LatencyStats, percentile, request_metrics, summarize
from kvtool.workloads.datasets import DatasetRecord
from kvtool.runtime.request import Request


def record(arrival, token_times, *, name="0", prompt=10, reused=0, error=None, finish_reason="length", line=None):
    """A request as the engine leaves it: token i reached the host at token_times[i]."""
    request = Request(list(range(prompt)), arrival_time=arrival, name=name, line=line)
    request.token_times = list(token_times)
    request.output_token_ids = list(range(len(token_times)))
    request.first_token_time = token_times[0] if token_times else None
    request.finish_time = token_times[-1] if token_times else None
    request.num_reused_tokens = reused
    request.error = error
    request.finish_reason = finish_reason
    return request


def test_request_metrics_by_hand():
    # Arrives 1 s after the bench start; tokens at +100 ms, +150 ms, +300 ms.
    line = DatasetRecord(line_number=3, output_tokens=3, input_ids=tuple(range(10)), session_id="s", turn=2)
    m = request_metrics(record(10.0, [10.1, 10.15, 10.3], reused=32, name="r1", line=line), label="on",
                        bench_start=9.0)
    assert (m.label, m.request_id, m.session_id, m.turn) == ("on", "r1", "s", 2)
    assert m.arrival_s == pytest.approx(1.0)
    assert m.first_token_s == pytest.approx(1.1)
    assert m.finish_s == pytest.approx(1.3)
    assert m.ttft_ms == pytest.approx(100.0)
    assert m.e2e_ms == pytest.approx(300.0)
    assert m.tpot_ms == pytest.approx((300.0 - 100.0) / (3 - 1))
    assert m.token_gaps_ms == pytest.approx((50.0, 150.0))
    assert m.itl_ms == pytest.approx(100.0)
    assert (m.input_tokens, m.output_tokens, m.reused_tokens) == (10, 3, 32)
    assert m.ok


def test_single_token_output_has_no_tpot_or_itl():
    m = request_metrics(record(0.0, [0.25], name="0"), label="x", bench_start=0.0)
    assert m.ttft_ms == pytest.approx(250.0)
    assert m.e2e_ms == pytest.approx(250.0)
    assert m.tpot_ms is None and m.itl_ms is None


def test_engine_error_is_reported_and_request_not_ok():
    m = request_metrics(record(0.0, [], error="out of memory", finish_reason="error", name="0"), label="x",
                        bench_start=0.0)
    assert m.error == "out of memory" and not m.ok
    aborted = request_metrics(record(0.0, [0.1], finish_reason="abort", name="1"), label="x", bench_start=0.0)
    assert aborted.error == "abort"


@pytest.mark.parametrize("values", [[5.0], [1.0, 2.0], [3.0, 1.0, 2.0, 10.0], list(np.linspace(0, 7, 13) ** 2)])
@pytest.mark.parametrize("q", [0, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear_interpolation(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_latency_stats_by_hand():
    stats = LatencyStats.of([10.0, 20.0, 30.0, 40.0])
    assert stats.mean == pytest.approx(25.0)
    assert stats.p50 == pytest.approx(25.0)           # halfway between 20 and 30
    assert stats.p90 == pytest.approx(37.0)           # rank 2.7: 30 + 0.7 * 10
    assert stats.p99 == pytest.approx(39.7)           # rank 2.97
    assert LatencyStats.of([]) == LatencyStats(None, ((50, None), (90, None), (99, None)))


def test_summary_by_hand():
    start = 0.0
    requests = [
        # arrival, token times
        request_metrics(record(0.0, [0.1, 0.2, 0.3], prompt=100, reused=64, name="a"), label="v",
                        bench_start=start),
        request_metrics(record(0.5, [0.8, 1.0], prompt=50, name="b"), label="v", bench_start=start),
        request_metrics(record(1.0, [1.5], prompt=20, name="c"), label="v", bench_start=start),
        request_metrics(record(0.2, [], prompt=7, error="refused", finish_reason="error", name="d"), label="v",
                        bench_start=start),
    ]
    summary = summarize(requests)
    assert summary.num_requests == 3 and summary.num_errors == 1
    assert summary.total_input_tokens == 170          # errors are not counted
    assert summary.total_output_tokens == 6
    assert summary.total_reused_tokens == 64
    assert summary.token_hit_rate == pytest.approx(64 / 170)  # reused / prompt tokens of the requests that ran
    assert summarize([]).token_hit_rate is None
    assert summary.duration_s == pytest.approx(1.5)   # last finish 1.5 - first arrival 0.0
    assert summary.output_tokens_per_s == pytest.approx(6 / 1.5)
    assert summary.requests_per_s == pytest.approx(3 / 1.5)
    # TTFT: 100, 300, 500 ms
    assert summary.ttft_ms.mean == pytest.approx(300.0)
    assert summary.ttft_ms.p50 == pytest.approx(300.0)
    assert summary.ttft_ms.p90 == pytest.approx(460.0)
    # TPOT: (300-100)/2 = 100, (500-300)/1 = 200; the 1-token request has none
    assert summary.tpot_ms.mean == pytest.approx(150.0)
    # ITL pools every gap: 100, 100, 200
    assert summary.itl_ms.mean == pytest.approx(400.0 / 3)
    assert summary.itl_ms.p50 == pytest.approx(100.0)
    # E2E: 300, 500, 500
    assert summary.e2e_ms.mean == pytest.approx(1300.0 / 3)
    row = summary.as_row()
    assert row["ttft_ms_p50"] == pytest.approx(300.0)
    assert row["num_requests"] == 3
    assert set(row) >= {f"{m}_{s}" for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
                        for s in ("mean", "p50", "p90", "p99")}


def test_summary_of_rows_without_token_gaps_has_the_exact_pooled_itl_mean():
    full = [request_metrics(record(0.0, [0.1, 0.2, 0.3], name="a"), label="v", bench_start=0.0),
            request_metrics(record(0.0, [0.1, 0.5], name="b"), label="v", bench_start=0.0)]
    stripped = [dataclasses.replace(m, token_gaps_ms=()) for m in full]
    assert summarize(stripped).itl_ms.mean == pytest.approx(summarize(full).itl_ms.mean)
    assert summarize(stripped).itl_ms.p50 is None   # percentiles need the individual gaps


def test_summary_of_nothing_is_empty_not_an_error():
    summary = summarize([])
    assert summary.num_requests == 0
    assert summary.duration_s is None and summary.output_tokens_per_s is None
    assert summary.ttft_ms.mean is None
