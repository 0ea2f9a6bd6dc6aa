"""A simulated run schedules and caches exactly as a real one: on every bench_configs/ scenario with
the tiny preset, every cache counter of `kvtool simulate` equals `kvtool bench`'s, and so do each
request's reuse figures. (None of the scenarios times its arrivals, so the order of events does not
depend on how long a step takes.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from kvtool.bench.runner import create_llm
from kvtool.bench.scenario import load_scenario
from kvtool.bench.sweep import resolve_variant_plan, run_scenario
from kvtool.simulate.cost_model import CostModel
from kvtool.simulate.profiles import create_simulated_llm

SCENARIOS = sorted(Path(__file__).resolve().parent.parent.glob("bench_configs/*.yaml"))
COUNTERS = ("reused_blocks", "missed_blocks", "cache_hit_rate", "early_reused_blocks", "partial_reused_blocks",
            "alloc_total_blocks", "alloc_new_blocks", "offloaded_blocks", "onboarded_blocks", "evicted_blocks",
            "offloaded_bytes", "onboarded_bytes", "primary_blocks", "primary_free_blocks", "primary_cached_blocks",
            "secondary_blocks", "secondary_free_blocks", "secondary_cached_blocks", "num_requests", "num_errors",
            # per tier (third_tier's disk variant: the simulated disk tier's index-only store)
            "primary_hit_blocks", "host_hit_blocks", "disk_hit_blocks", "primary_evicted_blocks",
            "host_evicted_blocks", "disk_evicted_blocks", "disk_in_bytes", "disk_out_bytes",
            "tier3_spilled_blocks", "tier3_staged_blocks", "tier3_fetch_failed_blocks",
            "missed_evicted_disk_blocks", "missed_not_staged_blocks", "missed_fetch_failed_blocks")
REQUEST_FIELDS = ("input_tokens", "output_tokens", "reused_tokens", "onboarded_blocks", "error")
# Each scenario at about a quarter of its size (prompts and pools scaled together, so the same evictions,
# offloads and chunking happen): the real runs are what this test spends its time on.
SMALLER = {
    "block_size_sweep": ["dataset.prefix_len=250", "dataset.suffix_len=25", "dataset.num_requests=12",
                         "dataset.output_len=4"],
    "host_cache_sweep": ["dataset.prefix_len=128", "dataset.num_requests=24", "dataset.output_len=4",
                         "bench.max_tokens_in_paged_kv_cache=384"],
    "multi_turn": ["dataset.num_sessions=4", "dataset.system_prompt_len=64", "dataset.user_turn_len=32",
                   "dataset.answer_len=8"],
    "offload_abab": ["dataset.prompt_len=256", "bench.max_tokens_in_paged_kv_cache=320"],
    "scheduler_policies": ["dataset.num_requests=12", "dataset.output_len=8"],
    # tiny-llama's histories fit in the scenario's 32 MiB host tier: 1 MiB (32 blocks) makes them spill to disk.
    "third_tier": ["bench.kv_host_cache_bytes=1MiB"],
    "system_prompt": ["dataset.num_groups=2", "dataset.prompts_per_group=4", "dataset.system_prompt_len=256",
                      "dataset.question_len=32", "dataset.output_len=4"],
}


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "cost.json"
    path.write_text(CostModel(device="cpu: test", coefficients={"step": 1e-3, "context_token": 1e-5,
                                                                 "decode_row": 1e-4}).to_json())
    return str(path)


@pytest.mark.parametrize("scenario_file", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_simulated_counters_equal_the_real_run(scenario_file, profile, tmp_path):
    scenario = load_scenario(scenario_file, model="preset:tiny-llama", sets=SMALLER.get(scenario_file.stem, ()))
    quiet = Console(quiet=True)
    real = run_scenario(scenario, tmp_path / "real", console=quiet, llm_factory=create_llm,
                        plan_resolver=resolve_variant_plan)
    simulated = run_scenario(scenario, tmp_path / "simulated", console=quiet,
                             llm_factory=lambda model, engine, replay, dataset: create_simulated_llm(
                                 model, engine, replay, dataset, profile=profile),
                             plan_resolver=resolve_variant_plan)
    assert real.failure is None and simulated.failure is None
    assert [r["label"] for r in real.rows] == [r["label"] for r in simulated.rows]
    for real_row, simulated_row in zip(real.rows, simulated.rows):
        assert simulated_row["simulated"] is True and "simulated" not in real_row
        for counter in COUNTERS:
            assert simulated_row.get(counter) == real_row.get(counter), (real_row["label"], counter)
    if scenario_file.stem == "third_tier":  # the disk tier served blocks, staged as in the real run
        assert [int(r.get("disk_hit_blocks") or 0) > 0 for r in real.rows] == [False, True]
    for real_row, simulated_row in zip(real.rows, simulated.rows):
        real_requests = _requests(tmp_path / "real" / real_row["requests_csv"])
        simulated_requests = _requests(tmp_path / "simulated" / simulated_row["requests_csv"])
        assert simulated_requests == real_requests, real_row["label"]


def _requests(path: Path) -> dict[str, tuple]:
    import csv

    with open(path, newline="") as f:
        return {row["request_id"]: tuple(row[k] for k in REQUEST_FIELDS) for row in csv.DictReader(f)}
