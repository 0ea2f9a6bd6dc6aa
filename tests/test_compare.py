"""kvtool.reports.compare_table: variants from summary and per-request CSVs, ratios, the TTFT plot."""

from __future__ import annotations

import pytest

from kvtool.reports.compare_table import (compare_rows, format_metric, format_ratio, load_variants, plot_ttft,
                                  setup_differences, verdicts)
from kvtool.reports.metrics import request_metrics
from kvtool.reports.csv_report import RequestCsvWriter, write_summary_csv
from kvtool.errors import KvtoolError
from kvtool.runtime.request import Request


def write_requests(path, label, ttfts_ms):
    """Requests arriving at 0 with their first token after ttft and a second token 10 ms later."""
    with RequestCsvWriter(path) as writer:
        for i, ttft in enumerate(ttfts_ms):
            rec = Request([1] * 100, arrival_time=0.0, name=str(i))
            rec.token_times = [ttft / 1000, ttft / 1000 + 0.010]
            rec.output_token_ids = [1, 2]
            rec.first_token_time, rec.finish_time = rec.token_times[0], rec.token_times[-1]
            writer.write(request_metrics(rec, label=label, bench_start=0.0))
    return path


def summary_row(label, ttft_mean, reuse, requests_csv=""):
    return {"label": label, "enable_kv_cache_reuse": reuse, "started_at": f"now-{label}", "num_requests": 3,
            "ttft_ms_mean": ttft_mean, "ttft_ms_p50": ttft_mean, "reused_blocks": 0 if not reuse else 12,
            "requests_csv": requests_csv}


def row_named(rows, column):
    return next(row for row in rows if row.column == column)


def test_summary_rows_are_variants_with_ratios_against_the_first(tmp_path):
    path = write_summary_csv(tmp_path / "summary.csv", [summary_row("off", 200.0, False),
                                                        summary_row("on", 50.0, True)])
    variants = load_variants([path])
    assert [v.name for v in variants] == ["off", "on"]
    rows = compare_rows(variants)
    ttft = row_named(rows, "ttft_ms_mean")
    assert ttft.values == (200.0, 50.0) and ttft.ratios == (1.0, 0.25)
    assert format_ratio(ttft.ratios[1]) == "0.25x"
    reused = row_named(rows, "reused_blocks")
    assert reused.ratios == (None, None)  # no ratio against zero
    # Configuration that differs gets a row, first; per-run noise (started_at) does not.
    assert rows[0].name == "--enable_kv_cache_reuse" and rows[0].values == ("off", "on")
    assert all(row.column != "started_at" for row in rows)


def test_per_request_csv_is_summarized(tmp_path):
    path = write_requests(tmp_path / "requests.csv", "plain", [10.0, 20.0, 60.0])
    variant, = load_variants([path])
    assert variant.name == "plain" and len(variant.requests) == 3
    rows = compare_rows([variant])
    assert row_named(rows, "ttft_ms_mean").values == (pytest.approx(30.0),)
    assert row_named(rows, "ttft_ms_p50").values == (pytest.approx(20.0),)
    assert row_named(rows, "tpot_ms_mean").values == (pytest.approx(10.0),)
    assert row_named(rows, "num_requests").values == (3.0,)


def test_summary_and_per_request_inputs_mix_and_duplicate_labels_get_file_names(tmp_path):
    summary = write_summary_csv(tmp_path / "a.csv", [summary_row("x", 40.0, True)])
    requests = write_requests(tmp_path / "b.csv", "x", [10.0, 30.0])
    variants = load_variants([summary, requests])
    assert [v.name for v in variants] == ["x (a)", "x (b)"]
    assert row_named(compare_rows(variants), "ttft_ms_mean").ratios == (1.0, pytest.approx(0.5))


def test_a_summary_finds_its_request_file_for_the_plot(tmp_path):
    write_requests(tmp_path / "requests-on.csv", "on", [5.0, 6.0, 7.0])
    path = write_summary_csv(tmp_path / "summary.csv", [summary_row("on", 6.0, True, "requests-on.csv"),
                                                        summary_row("off", 9.0, False, "missing.csv")])
    on, off = load_variants([path])
    assert [r.ttft_ms for r in on.requests] == pytest.approx([5.0, 6.0, 7.0])
    assert off.requests is None


def test_plot_writes_a_png_with_every_variant_that_has_requests(tmp_path):
    a = write_requests(tmp_path / "a.csv", "reuse-off", [100.0, 120.0, 150.0, 400.0])
    b = write_requests(tmp_path / "b.csv", "reuse-on", [10.0, 12.0, 11.0, 30.0])
    out = plot_ttft(load_variants([a, b]), tmp_path / "plots" / "ttft.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_without_any_per_request_data_is_a_clear_error(tmp_path):
    path = write_summary_csv(tmp_path / "summary.csv", [summary_row("x", 1.0, True)])
    with pytest.raises(KvtoolError, match="needs per-request data"):
        plot_ttft(load_variants([path]), tmp_path / "p.png")


def test_a_csv_that_is_not_a_report_is_refused(tmp_path):
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(KvtoolError, match="neither a kvtool summary CSV"):
        load_variants([tmp_path / "other.csv"])
    (tmp_path / "header.csv").write_text("label,ttft_ms_mean\n")
    with pytest.raises(KvtoolError, match="no rows"):
        load_variants([tmp_path / "header.csv"])


def run_row(label, repeat, ttft, **extra):
    return {"label": label, "repeat": repeat, "ttft_ms_mean": ttft, "ttft_ms_p50": ttft, "num_requests": 4,
            "num_errors": 0, "interrupted": False, "cache_hit_rate": 0.8245, "dataset": "d/abab.jsonl",
            "dataset_sha256": "ab" * 32, "tokens_per_block": 32, "kv_primary_tokens": 1024, "kv_host_bytes": 0,
            "device": "cpu: test", "model": "preset:tiny-llama", **extra}


def test_the_runs_of_a_repeated_variant_become_one_column_of_medians(tmp_path):
    rows = [run_row(label, r, ttft) for r in (1, 2, 3) for label, ttft in (("on", 10.0 + r), ("off", 50.0 + 10 * r))]
    on, off = load_variants([write_summary_csv(tmp_path / "summary.csv", rows)])
    assert (on.name, on.num_runs, off.num_runs) == ("on", 3, 3)
    ttft = row_named(compare_rows([on, off]), "ttft_ms_p50")
    assert ttft.values == (12.0, 70.0) and ttft.ratios[1] == pytest.approx(70 / 12)
    assert (ttft.spreads[0].low, ttft.spreads[0].high, ttft.spreads[1].high) == (11.0, 13.0, 80.0)
    found, = [line for line in verdicts([on, off]) if line.startswith("TTFT p50")]
    # Apart, but 3 runs each cannot show p < 0.05.
    assert "off / on = 5.83x is inconclusive: too few runs to tell" in found and "p = 0.100" in found


def test_what_differs_besides_the_compared_flags_is_named(tmp_path):
    a = write_summary_csv(tmp_path / "a.csv", [run_row("a", 1, 10.0)])
    b = write_summary_csv(tmp_path / "b.csv", [run_row("b", 1, 12.0, tokens_per_block=16, dataset_sha256="cd" * 32,
                                                       kv_host_bytes=1 << 30)])
    same, different = setup_differences(load_variants([a, b]))
    assert dict(same) == {"model": "preset:tiny-llama", "primary pool": "1,024 tokens", "device": "cpu: test"}
    assert dict(different) == {"dataset": ["abab.jsonl (sha256 abababababab)", "abab.jsonl (sha256 cdcdcdcdcdcd)"],
                               "--tokens_per_block": ["32", "16"], "host pool": ["off", "1.0 GiB"]}


def test_interrupted_and_errored_variants_are_marked(tmp_path):
    rows = [run_row("ok", 1, 1.0), run_row("cut", 1, 1.0, interrupted=True), run_row("bad", 1, 1.0, num_errors=2)]
    ok, cut, bad = load_variants([write_summary_csv(tmp_path / "s.csv", rows)])
    assert (ok.status(), cut.status(), bad.status()) == ("", "interrupted", "2 errors")


def test_plot_titles_name_the_workload_and_unit_and_the_legend_stays_off_the_curves(tmp_path, monkeypatch):
    import matplotlib.figure

    saved = {}
    original = matplotlib.figure.Figure.savefig

    def keep(figure, *args, **kwargs):
        result = original(figure, *args, **kwargs)
        renderer = figure.canvas.get_renderer()  # while the figure is open, as drawn
        cdf_axes = figure.axes[1]
        saved.update(figure=figure, legend=cdf_axes.get_legend().get_window_extent(renderer),
                     curves=cdf_axes.get_window_extent(renderer))
        return result

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    write_requests(tmp_path / "requests-on.csv", "on", [10.0, 12.0, 30.0])
    path = write_summary_csv(tmp_path / "summary.csv", [{**summary_row("on", 17.0, True, "requests-on.csv"),
                                                         "scenario": "system_prompt"}])
    plot_ttft(load_variants([path]), tmp_path / "p.png")
    figure = saved["figure"]
    assert figure._suptitle.get_text() == "Time to first token on the system_prompt workload (ms, lower is better)"
    box_axes, cdf_axes = figure.axes
    assert "lower is better" in box_axes.get_ylabel() and "lower is better" in cdf_axes.get_xlabel()
    assert not saved["legend"].overlaps(saved["curves"])


def test_miss_reasons_are_metric_rows_and_summaries_written_before_them_still_compare(tmp_path):
    old = write_summary_csv(tmp_path / "old.csv", [summary_row("old", 100.0, True)])
    new = write_summary_csv(tmp_path / "new.csv", [{**summary_row("new", 80.0, True), "missed_blocks": 4,
                                                    "missed_never_seen_blocks": 3, "missed_evicted_host_blocks": 0,
                                                    "missed_last_token_blocks": 1}])
    rows = compare_rows(load_variants([old, new]))
    never_seen = row_named(rows, "missed_never_seen_blocks")
    assert never_seen.name == "missed: never seen" and never_seen.values == (None, 3.0)
    assert row_named(rows, "missed_last_token_blocks").values == (None, 1.0)
    assert all(row.column != "missed_partial_blocks" for row in rows)  # neither report has it


def test_sizes_show_in_binary_units_as_on_every_screen():
    assert format_metric("offloaded_bytes", 1.5 * 2**30) == "1.5 GiB"
    assert format_metric("onboarded_bytes", 0.0) == "0 B"
    assert format_metric("offloaded_blocks", 2048.0) == "2,048"
