"""`kvtool bench --kv_disk_cache_dir` and `kvtool explain` on its report: the summary tells which tier
served the reused blocks, which tier dropped blocks and what staging cost; explain says it in sentences."""

from __future__ import annotations

import csv

from test_cli_bench import invoke

from kvtool.workloads.datasets import write_jsonl


def test_bench_and_explain_tell_the_tier_of_each_hit(tmp_path, tiny_llama_plan):
    """A, B, C, D, A, B, C, D sequential: a primary pool of 10 blocks and a host tier of 8 hold two
    of these 8-block prompts, so each revisit finds its prompt on disk, staged through the host tier."""
    prompts = {name: [(7 * i + 100 * k) % 1000 + 1 for i in range(128)] for k, name in enumerate("ABCD")}
    lines = [{"input_ids": prompt + [999], "output_tokens": 2, "request_id": f"{name}{i}"}
             for i in range(2) for name, prompt in prompts.items()]
    dataset = write_jsonl(tmp_path / "abcd.jsonl", lines)
    block_bytes = 2 * 2 * 16 * 2 * 32 * 4
    out = tmp_path / "report"
    result = invoke("bench", "--plan", tiny_llama_plan, "--dataset", dataset, "--mode", "sequential",
                    "--max_tokens_in_paged_kv_cache", 160, "--kv_host_cache_bytes", 8 * block_bytes,
                    "--kv_disk_cache_dir", tmp_path / "disk", "--kv_disk_cache_bytes", "12MiB", "--output", out)
    assert result.exit_code == 0, result.output
    with open(out / "summary.csv", newline="") as f:
        row = {key: value for key, value in next(csv.DictReader(f)).items()}
    disk_hits, reused = int(row["disk_hit_blocks"]), int(row["reused_blocks"])
    # Each prompt is 8 full blocks: 4 first sights, then 4 revisits served from disk.
    assert int(row["missed_never_seen_blocks"]) == int(row["missed_blocks"]) == 32
    assert disk_hits == 32 and reused == disk_hits + int(row["primary_hit_blocks"]) + int(row["host_hit_blocks"])
    assert int(row["tier3_staged_blocks"]) == disk_hits and float(row["tier3_staging_s"]) > 0
    assert int(row["disk_out_bytes"]) == disk_hits * block_bytes
    table = " ".join(result.output.split())
    assert "reused blocks by tier │ 32 disk │" in table and "evicted blocks by tier │ none │" in table
    explain = invoke("explain", out)
    assert explain.exit_code == 0, explain.output
    explained = " ".join(explain.output.split())
    assert f"the disk tier ({disk_hits})." in explained
    assert f"Staging {disk_hits} blocks from the third tier took" in explained
