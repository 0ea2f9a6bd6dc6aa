"""`kvtool explain`: a report's misses in sentences whose numbers come from the report, and what-ifs
whose numbers come from simulating the report's own dataset and flags with one change."""

from __future__ import annotations

import csv
import re

import pytest
import yaml
from test_cli_bench import invoke

from kvtool.workloads.datasets import write_jsonl
from kvtool.simulate.cost_model import CostModel


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(CostModel(device="cpu: test", coefficients={"step": 1e-3, "context_token": 1e-4,
                                                                 "decode_row": 1e-4}).to_json())
    return path


def bench_abab(tmp_path, plan, *flags):
    """A, B, A, B, A, B sequential through a primary pool that holds one of them: B evicts A, and A
    evicts B, so every revisit misses blocks evicted from the primary pool (no host cache)."""
    a, b = [list(range(1, 129)), list(range(300, 428))]
    lines = [{"input_ids": prompt + [999], "output_tokens": 2, "request_id": f"{name}{i}"}
             for i in range(3) for name, prompt in (("A", a), ("B", b))]
    dataset = write_jsonl(tmp_path / "abab.jsonl", lines)
    out = tmp_path / "report"
    result = invoke("bench", "--plan", plan, "--dataset", dataset, "--mode", "sequential",
                    "--max_tokens_in_paged_kv_cache", 160, "--output", out, *flags)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture
def abab_report(tmp_path, tiny_llama_plan):
    return bench_abab(tmp_path, tiny_llama_plan)


def test_explain_splits_the_misses_and_simulates_a_host_cache(abab_report, profile):
    with open(abab_report / "summary.csv", newline="") as f:
        row = next(csv.DictReader(f))
    evicted, missed = int(row["missed_evicted_primary_blocks"]), int(row["missed_blocks"])
    # A and B are 8 full blocks each: 2 first sights, then 4 revisits that find at most their first block
    # (eviction takes leaves first, so the other prompt's root block can survive).
    assert int(row["missed_never_seen_blocks"]) == 16 and evicted == missed - 16 >= 4 * 7
    result = invoke("explain", abab_report, "--profile", profile)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"{evicted / missed:.0%} of missed blocks ({evicted}) had been evicted from the primary pool" in text
    assert f"{16 / missed:.0%} of missed blocks (16) were seen for the first time" in text
    # The what-if: a host cache big enough for what was evicted, simulated; the hit rate goes up.
    # Sizes as every screen shows them (binary units), rounded up to one a user would type.
    match = re.search(r"With a host cache of [\d.,]+ (?:[KMG]iB|B) \(simulated\), the hit rate goes from ([\d.]+) to "
                      r"([\d.]+) and TTFT p50 from ([\d,]+) to ([\d,]+) ms", text)
    assert match, text
    before, after = float(match.group(1)), float(match.group(2))
    assert before == round(float(row["cache_hit_rate"]), 2) and after > 0.5  # the simulated baseline is the run
    assert int(match.group(4).replace(",", "")) < int(match.group(3).replace(",", ""))
    assert "primary pool twice as large" in text and "cpu-test (calibrated) step cost model" in text


def test_a_sampled_run_is_explained_by_its_greedy_twin(tmp_path, tiny_llama_plan, profile):
    # The cost model times greedy steps (simulate refuses --temperature): the what-ifs simulate the run
    # greedily, each against the same simulated baseline.
    report = bench_abab(tmp_path, tiny_llama_plan, "--temperature", 0.9, "--top_k", 50)
    result = invoke("explain", report, "--profile", profile)
    assert result.exit_code == 0, result.output
    assert "(simulated), the hit rate goes from" in " ".join(result.output.split())


def test_explain_names_a_report_without_the_split_and_a_missing_one(tmp_path, abab_report, profile):
    missing = invoke("explain", tmp_path / "nowhere", "--profile", profile)
    assert missing.exit_code == 2 and "does not exist" in missing.output and "Traceback" not in missing.output
    summary = abab_report / "summary.csv"
    with open(summary, newline="") as f:
        rows = list(csv.DictReader(f))
    old = tmp_path / "old.csv"
    columns = [c for c in rows[0] if not c.startswith("missed_") or c == "missed_blocks"]
    with open(old, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    result = invoke("explain", old, "--profile", profile)
    assert result.exit_code == 0, result.output
    assert "no miss split (written by an older kvtool)" in " ".join(result.output.split())


def test_a_repeated_scenario_is_one_paragraph_per_variant_with_its_runs_ranges(tmp_path, tiny_llama_plan, profile):
    scenario = tmp_path / "repeated.yaml"
    scenario.write_text(yaml.safe_dump({
        "dataset": {"generator": "abab", "prompt_len": 128, "num_rounds": 3, "output_len": 2},
        "bench": {"mode": "sequential", "max_tokens_in_paged_kv_cache": 160},
        "repeat": 2,
        "sweep": [{"label": "small-pool"}, {"label": "host", "kv_host_cache_bytes": "1MiB"}]}))
    out = tmp_path / "repeated"
    result = invoke("bench", "--config", scenario, "--plan", tiny_llama_plan, "--output", out)
    assert result.exit_code == 0, result.output
    with open(out / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    explained = invoke("explain", out, "--profile", profile)
    assert explained.exit_code == 0, explained.output
    paragraphs = [" ".join(p.split()) for p in explained.output.split("\n\n") if p.strip()]
    assert [p.split(":")[0] for p in paragraphs] == ["small-pool", "host"]
    small_pool = paragraphs[0]
    p50s = sorted(float(r["ttft_ms_p50"]) for r in rows if r["label"] == "small-pool")
    span = f"{p50s[0]:,.0f} ms" if f"{p50s[0]:,.0f}" == f"{p50s[-1]:,.0f}" else f"{p50s[0]:,.0f}-{p50s[-1]:,.0f} ms"
    assert small_pool.startswith(f"small-pool: 6 requests each, over 2 runs; 4 of 48 full prompt blocks were "
                                 f"reused (hit rate 0.08); TTFT p50 {span}")
    # The what-ifs are simulated once for the variant, not once per run.
    assert small_pool.count("(simulated)") == 2 and small_pool.count("(Simulated with") == 1
