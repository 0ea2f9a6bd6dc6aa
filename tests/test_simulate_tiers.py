"""`kvtool simulate` with a third KV tier: a disk tier given by its size alone, a remote store shared
by every replica, each staged block costing this machine's measured latency + bytes / bandwidth (or
--tier_cost's), and every bad flag refused in one line naming it."""

from __future__ import annotations

import csv

import pytest
from test_cli_bench import invoke

from kvtool.simulate.cost_model import CostModel
from kvtool.simulate.tier_costs import Transfer, calibrated_costs, fit_transfer
from kvtool.workloads.datasets import write_jsonl

# tiny-llama with 16-token blocks: 2 layers x (K, V) x 16 tokens x 2 heads x 32 dims x 4 bytes.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 32 * 4


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(CostModel(device="cpu: test", coefficients={"step": 1e-3, "context_token": 1e-5,
                                                                 "decode_row": 1e-4}).to_json())
    return path


def _dataset(tmp_path, names: str, rounds: int = 2):
    """Each name an 8-block prompt of its own (and a last token), the names in turn ``rounds`` times."""
    prompts = {name: [(7 * i + 100 * k) % 1000 + 1 for i in range(128)] for k, name in enumerate(names)}
    lines = [{"input_ids": prompt + [999], "output_tokens": 2, "request_id": f"{name}{i}"}
             for i in range(rounds) for name, prompt in prompts.items()]
    return write_jsonl(tmp_path / f"{names}.jsonl", lines)


def _summary(out) -> list[dict]:
    with open(out / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def _simulate(tmp_path, profile, *flags, name="out"):
    out = tmp_path / name
    result = invoke("simulate", "--plan", flags[0], "--profile", profile, "--output", out, *flags[1:])
    return result, out


def test_a_simulated_disk_tier_serves_the_revisits_the_real_one_does(tmp_path, tiny_llama_plan, profile):
    """tests/test_bench_tier3.py's run, simulated from the disk tier's size alone: the same 32 blocks staged
    from disk, and staging them took 32 fetches at this machine's measured disk cost."""
    result, out = _simulate(tmp_path, profile, tiny_llama_plan, "--dataset", _dataset(tmp_path, "ABCD"),
                            "--mode", "sequential", "--max_tokens_in_paged_kv_cache", 160,
                            "--kv_host_cache_bytes", 8 * BLOCK_BYTES, "--kv_disk_cache_bytes", "12MiB")
    assert result.exit_code == 0, result.output
    assert "a simulated disk tier of" in " ".join(result.output.split())
    row = _summary(out)[0]
    assert int(row["missed_never_seen_blocks"]) == int(row["missed_blocks"]) == 32
    assert int(row["disk_hit_blocks"]) == int(row["tier3_staged_blocks"]) == 32
    assert int(row["disk_out_bytes"]) == 32 * BLOCK_BYTES
    disk = calibrated_costs()["disk"]
    # The staging's own time: 32 fetches, and the spills of the host blocks they displaced.
    fetches, spills = 32 * disk.fetch.seconds(BLOCK_BYTES), int(row["tier3_spilled_blocks"]) * disk.spill.seconds(
        BLOCK_BYTES)
    assert fetches <= float(row["tier3_staging_s"]) <= fetches + spills + 1e-6
    assert "calibrated from results/tiers.md" in row["tier_costs"]


def test_tier_cost_overrides_what_a_staged_block_costs(tmp_path, tiny_llama_plan, profile):
    dataset = _dataset(tmp_path, "ABCD")
    common = (tiny_llama_plan, "--dataset", dataset, "--mode", "sequential", "--max_tokens_in_paged_kv_cache", 160,
              "--kv_host_cache_bytes", 8 * BLOCK_BYTES, "--kv_disk_cache_bytes", "12MiB")
    result, out = _simulate(tmp_path, profile, *common, "--tier_cost", "disk=2ms,100MB/s", name="slow")
    assert result.exit_code == 0, result.output
    slow = _summary(out)[0]
    fetches = 32 * (2e-3 + BLOCK_BYTES / 100e6)
    assert fetches <= float(slow["tier3_staging_s"]) <= fetches + 1e-3
    fast, fast_out = _simulate(tmp_path, profile, *common, name="fast")
    assert fast.exit_code == 0, fast.output
    # The staging is on the step path: the 8 requests' TTFTs grow by its time, and by nothing else.
    quick = _summary(fast_out)[0]
    extra_staging_s = float(slow["tier3_staging_s"]) - float(quick["tier3_staging_s"])
    extra_ttft_s = 8 * (float(slow["ttft_ms_mean"]) - float(quick["ttft_ms_mean"])) / 1000
    assert extra_staging_s > 0.05 and extra_ttft_s == pytest.approx(extra_staging_s, rel=1e-3)


def test_a_remote_store_is_shared_by_every_replica(tmp_path, tiny_llama_plan, profile):
    """Five prompts twice, round robin over 2 replicas: each revisit goes to the replica that did not
    compute the prompt. Without a third tier it recomputes it; with a remote store the blocks the other
    replica spilled are found there (discovered: not in this replica's index) and reused: each replica's."""
    dataset = _dataset(tmp_path, "ABCDE")
    # A host tier of 4 blocks: a prompt reaches the store when later ones push it out of the host tier.
    common = (tiny_llama_plan, "--dataset", dataset, "--mode", "sequential", "--max_tokens_in_paged_kv_cache", 160,
              "--kv_host_cache_bytes", 4 * BLOCK_BYTES, "--replicas", 2)
    alone, alone_out = _simulate(tmp_path, profile, *common, name="host-only")
    assert alone.exit_code == 0, alone.output
    assert int(_summary(alone_out)[0]["reused_blocks"]) == 0
    shared, shared_out = _simulate(tmp_path, profile, *common, "--kv_remote_cache_bytes", "64MiB", name="remote")
    assert shared.exit_code == 0, shared.output
    fleet, *replicas = _summary(shared_out)
    remote_hits = int(fleet["remote_hit_blocks"])
    assert remote_hits >= 8 and int(fleet["tier3_discovered_blocks"]) >= remote_hits
    assert all(int(row["remote_hit_blocks"]) > 0 for row in replicas)
    assert int(fleet["reused_blocks"]) >= remote_hits
    assert int(fleet["missed_blocks"]) == 5 * 8 + 5 * 8 - int(fleet["reused_blocks"])
    remote = calibrated_costs()["remote"]
    assert remote.lookup_s > 0 and float(fleet["tier3_staging_s"]) >= remote_hits * remote.fetch.seconds(BLOCK_BYTES)


def test_a_full_remote_store_drops_its_least_recently_used_blocks(tmp_path, tiny_llama_plan, profile):
    """A store of 4 blocks keeps none of an 8-block prompt's leading blocks by the time it is revisited."""
    dataset = _dataset(tmp_path, "ABCDE")
    result, out = _simulate(tmp_path, profile, tiny_llama_plan, "--dataset", dataset, "--mode", "sequential",
                            "--max_tokens_in_paged_kv_cache", 160, "--kv_host_cache_bytes", 8 * BLOCK_BYTES,
                            "--replicas", 2, "--kv_remote_cache_bytes", 4 * (BLOCK_BYTES + 80))
    assert result.exit_code == 0, result.output
    assert int(_summary(out)[0]["remote_hit_blocks"]) == 0


def test_the_fitted_tier_cost_follows_the_measured_points():
    """latency + bytes / bandwidth through points on that line gives it back; a negative latency is dropped."""
    line = Transfer(1e-4, 2e9)
    points = [(size, line.seconds(size) * 1e6) for size in (1 << 18, 1 << 20, 1 << 22)]
    fitted = fit_transfer(points)
    assert fitted.latency_s == pytest.approx(1e-4) and fitted.bytes_per_s == pytest.approx(2e9)
    through_zero = fit_transfer([(1 << 20, 100.0), (1 << 22, 500.0)])
    assert through_zero.latency_s == 0 and through_zero.bytes_per_s > 0


@pytest.mark.parametrize("flags, message", [
    (("--kv_remote_cache", "redis://store:6379"), "Error: --kv_remote_cache redis://store:6379: a simulated store "
     "holds what its size says"),
    (("--kv_disk_cache_bytes", "1KiB"), "Error: --kv_disk_cache_bytes 1024 holds no KV block"),
    (("--kv_disk_cache_bytes", "1GiB", "--tier_cost", "ssd=1ms,1GB/s"), "Error: --tier_cost ssd=1ms,1GB/s: give "
     "TIER=LATENCY,BANDWIDTH"),
    (("--kv_disk_cache_bytes", "1GiB", "--tier_cost", "disk=fast"), "Error: --tier_cost disk=fast: latency 'fast' "
     "is not a duration"),
    (("--kv_disk_cache_bytes", "1GiB", "--tier_cost", "disk=1ms,quick"), "Error: --tier_cost disk=1ms,quick: "
     "bandwidth 'quick' is not a rate"),
    (("--kv_disk_cache_bytes", "1GiB", "--kv_remote_cache_bytes", "1GiB"), "Error: --kv_remote_cache_bytes and "
     "the disk cache are both given"),
])
def test_a_bad_third_tier_flag_is_one_line_naming_it(tmp_path, tiny_llama_plan, profile, flags, message):
    result, _ = _simulate(tmp_path, profile, tiny_llama_plan, "--dataset", _dataset(tmp_path, "AB"),
                          "--kv_host_cache_bytes", "1MiB", *flags)
    assert result.exit_code == 2, result.output
    assert " ".join(result.output.split()).startswith(message), result.output
    assert "Traceback" not in result.output


def test_a_real_engine_refuses_what_only_a_simulation_models(tmp_path, tiny_llama_plan):
    result = invoke("bench", "--plan", tiny_llama_plan, "--dataset", _dataset(tmp_path, "AB"), "--kv_host_cache_bytes",
                    "1MiB", "--kv_disk_cache_bytes", "1GiB", "--output", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert " ".join(result.output.split()).startswith(
        "Error: --kv_disk_cache_bytes 1073741824: a disk tier writes its files to --kv_disk_cache_dir DIR: give it")


def test_sweep_capacity_points_to_a_sweep_of_the_third_tier(tmp_path, tiny_llama_plan, profile):
    result, _ = _simulate(tmp_path, profile, tiny_llama_plan, "--dataset", _dataset(tmp_path, "AB"),
                          "--kv_disk_cache_bytes", "1GiB", "--sweep_capacity")
    assert result.exit_code == 2, result.output
    assert " ".join(result.output.split()).startswith("Error: --kv_disk_cache_bytes: --sweep_capacity sweeps the GPU "
                                                      "pool and the host tier")


def test_a_sweep_of_the_disk_tier_size_raises_the_hit_rate(tmp_path, tiny_llama_plan, profile):
    result, out = _simulate(tmp_path, profile, tiny_llama_plan, "--dataset", _dataset(tmp_path, "ABCD"),
                            "--mode", "sequential", "--max_tokens_in_paged_kv_cache", 160, "--kv_host_cache_bytes",
                            8 * BLOCK_BYTES, "--sweep", "kv_disk_cache_bytes=0,12MiB")
    assert result.exit_code == 0, result.output
    rates = {row["label"]: float(row["cache_hit_rate"]) for row in _summary(out)}
    assert rates == {"kv_disk_cache_bytes=0": 0.0, "kv_disk_cache_bytes=12MiB": 0.5}
