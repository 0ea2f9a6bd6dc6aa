"""`kvtool bench --html` and `kvtool compare --html`: one self-contained page, opened in a real browser.

Each page is loaded in headless Chromium (tests/headless_browser.py): no console error, nothing
requested but the page itself and its embedded images, every image decoded. Its tables are read
back and checked against the CSVs the same run wrote. The first test shows the browser check fails
on a page that has errors, so the others mean something.
"""

from __future__ import annotations

import csv
from html.parser import HTMLParser

import pytest
from headless_browser import find_chromium, open_page
from test_cli_bench import invoke, read_rows
from test_report_outputs import dataset, fake_llms  # noqa: F401 - fixtures

from kvtool.workloads.datasets import write_jsonl

needs_chromium = pytest.mark.skipif(find_chromium() is None,
                                    reason="chromium is not installed (make setup installs Debian's chromium)")


class _Tables(HTMLParser):
    """Every <table id=...> of a page: its rows, each a list of cell texts (header row included)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._table: list[list[str]] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._table = self.tables.setdefault(dict(attrs).get("id") or f"table{len(self.tables)}", [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th") and self._table is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._table[-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def tables_of(path) -> dict[str, list[list[str]]]:
    parser = _Tables()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser.tables


def assert_self_contained_and_clean(path):
    """The page opens in Chromium with no console error, asks for nothing but itself and data: URIs,
    and every image decodes."""
    page = open_page(path)
    assert page.errors == []
    assert page.requests[0] == path.resolve().as_uri()
    assert all(url.startswith("data:image/png;base64,") for url in page.requests[1:]), page.requests
    assert page.images and all(image["width"] > 0 for image in page.images), page.images
    return page


@needs_chromium
def test_the_browser_check_reports_script_errors_console_errors_and_outside_requests(tmp_path):
    page_path = tmp_path / "broken.html"
    page_path.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'><title>broken</title></head><body>"
                         "<p>a page with mistakes</p><script>console.error('deliberate'); notDefined();</script>"
                         "<img src='https://example.invalid/plot.png'></body></html>", encoding="utf-8")
    page = open_page(page_path)
    assert any("deliberate" in error for error in page.errors)
    assert any("notDefined is not defined" in error for error in page.errors)
    assert "https://example.invalid/plot.png" in page.requests
    assert page.images == [{"src": "https://example.invalid/plot.png", "width": 0}]
    with pytest.raises(AssertionError):
        assert_self_contained_and_clean(page_path)


@needs_chromium
def test_a_bench_html_report_is_clean_in_a_browser_and_holds_the_csv_numbers(tmp_path, dataset, fake_llms):  # noqa: F811 - the fixtures
    out = tmp_path / "run"
    fake_llms.settings["refuse_when_added"] = lambda prompt: "refused by the test" if prompt[-1] == 13 else None
    result = invoke("bench", "--model", "preset:tiny-llama", "--dataset", dataset, "--output", out, "--html",
                    "--percentiles", "99.9", "--slo", "ttft=1s,tpot=100ms")
    assert result.exit_code == 3, result.output  # a refused request: the reports are written, then exit 3
    html_path = out / "report.html"
    assert str(html_path) in result.output.replace("\n", "")
    page = assert_self_contained_and_clean(html_path)
    assert "kvtool bench report" in page.text and "Why blocks were missed" in page.text

    (summary,) = read_rows(out / "summary.csv")
    tables = tables_of(html_path)
    # Every summary column, each cell exactly as summary.csv holds it.
    columns = {row[0]: row[1:] for row in tables["summary-columns"][1:]}
    assert list(columns) == list(summary)
    for column, text in summary.items():
        assert columns[column] == [text], column
    # The summary table as the terminal shows it, from the same numbers.
    shown = {row[0]: row[1:] for row in tables["summary"][1:]}
    assert shown["TTFT p99.9 (ms)"] == [f"{float(summary['ttft_ms_p99.9']):,.2f}"]
    assert shown["total tokens/s"] == [f"{float(summary['total_tokens_per_s']):,.2f}"]
    assert shown["goodput (requests/s)"] == [f"{float(summary['goodput_requests_per_s']):,.2f}"]
    assert shown["requests (errors)"] == [f"{summary['num_requests']} ({summary['num_errors']})"]
    # Missed blocks by reason, from the summary's counts; the error with its count.
    reasons = {row[0]: row[1] for row in tables["miss-reasons"][1:]}
    assert reasons["missed blocks (all reasons)"] == summary["missed_blocks"]
    never_seen = int(summary["missed_never_seen_blocks"])
    assert reasons["never seen"] == f"{never_seen} ({never_seen / int(summary['missed_blocks']):.0%})"
    errors = [r["error"] for r in read_rows(out / "requests.csv") if r["error"]]
    assert errors and tables["errors"][1] == ["tiny-llama", str(len(errors)), errors[0]]


@needs_chromium
def test_a_compare_html_report_is_clean_in_a_browser_and_holds_the_table(tmp_path, dataset, fake_llms):  # noqa: F811 - the fixtures
    for label, reuse in (("on", "--enable_kv_cache_reuse"), ("off", "--disable_kv_cache_reuse")):
        assert invoke("bench", "--model", "preset:tiny-llama", "--dataset", dataset, "--output", tmp_path / label,
                      "--label", label, reuse).exit_code == 0
    html_path = tmp_path / "pages" / "compare.html"
    result = invoke("compare", tmp_path / "on" / "summary.csv", tmp_path / "off" / "summary.csv", "--html", html_path,
                    "--output", tmp_path / "compare.csv")
    assert result.exit_code == 0, result.output
    page = assert_self_contained_and_clean(html_path)
    assert len(page.images) == 1    # the TTFT plot
    assert "kvtool compare report" in page.text

    tables = tables_of(html_path)
    header, *body = tables["compare"]
    assert header == ["metric", "on", "off", "ratio"]
    shown = {row[0]: row[1:] for row in body}
    with open(tmp_path / "compare.csv", newline="") as f:
        compared = {row["metric"]: row for row in csv.DictReader(f)}
    on, off = read_rows(tmp_path / "on" / "summary.csv")[0], read_rows(tmp_path / "off" / "summary.csv")[0]
    # The same cells as the terminal's table.
    terminal = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.split("│")[1:-1]]
                                                  for line in result.output.splitlines() if line.count("│") > 2)}
    assert shown == terminal
    assert float(shown["TTFT p50 (ms)"][0]) == pytest.approx(float(on["ttft_ms_p50"]), abs=5e-3)
    assert shown["cache hit rate"][:2] == [f"{float(on['cache_hit_rate']):.1%}", f"{float(off['cache_hit_rate']):.1%}"]
    assert shown["TTFT p50 (ms)"][2] == f"{float(compared['ttft_ms_p50']['off / on']):.2f}x"
    columns = {row[0]: row[1:] for row in tables["summary-columns"][1:]}
    for column in on:
        assert columns[column] == [on[column], off[column]], column
    # The lines printed around the table (what the variants share, verdicts) are on the page too.
    notes = [line.strip() for line in result.output.splitlines()
             if line.strip() and not set(line) & set("│┃━─┏┗┡└") and not line.startswith("wrote")]
    assert any(line.startswith("same for all:") for line in notes)
    assert any(line.startswith("TTFT p50: off / on") for line in notes)
    text = " ".join(page.text.split())
    assert all(" ".join(line.split()) in text for line in notes), notes


@needs_chromium
def test_a_simulated_sweep_report_embeds_the_sweep_plot(tmp_path, tiny_llama_plan):
    sweep_dataset = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": list(range(100, 164)) + [i] * 8,
                                                       "output_tokens": 2} for i in range(8)])
    out = tmp_path / "sweep"
    result = invoke("simulate", "--plan", tiny_llama_plan, "--dataset", sweep_dataset, "--profile", "h100",
                    "--output", out, "--sweep", "max_batch_size=1,4", "--html")
    assert result.exit_code == 0, result.output
    page = assert_self_contained_and_clean(out / "report.html")
    assert len(page.images) == 2    # the TTFT plot and sweep.png
    assert "kvtool simulate report (simulated)" in page.text
    columns = {row[0]: row[1:] for row in tables_of(out / "report.html")["summary-columns"][1:]}
    rows = read_rows(out / "summary.csv")
    assert columns["ttft_ms_p50"] == [row["ttft_ms_p50"] for row in rows]
