"""kvtool.reports.differences: what differs between summary rows, and the names that tell variants apart."""

from __future__ import annotations

from pathlib import Path

from kvtool.flags import CONFIG_FLAGS
from kvtool.reports.differences import FLAG_FIELDS, default_label, differing_fields, telling_apart, variant_names


def run(label="sm32", **columns):
    """A summary row as kvtool bench writes it for `--plan plans/sm32` without --label."""
    return {"label": label, "model": "plans/sm32", "plan_path": "plans/sm32", "enable_kv_cache_reuse": "True",
            "kv_host_cache_bytes": "0", "tokens_per_block": "32", "max_batch_size": "", "dataset": "d/sp.jsonl",
            "dataset_sha256": "ab" * 32, "device": "cpu: test", "kv_primary_tokens": "16384", "kv_host_bytes": "0",
            **columns}


def names(rows, sources=None):
    return variant_names(rows, sources or [Path(f"out/{i}/summary.csv") for i in range(len(rows))]).names


def test_default_labels_give_way_to_what_differs():
    assert names([run(), run(enable_kv_cache_reuse="False")]) == ["reuse on", "reuse off"]
    assert names([run(), run(kv_host_cache_bytes="45097156608", kv_host_bytes="45097156608")]) == [
        "host off", "host 42.0 GiB"]


def test_fields_that_follow_from_an_earlier_one_stay_out_of_the_names_but_not_out_of_differs():
    small = run(tokens_per_block="16", plan_tokens_per_block="16", kv_primary_tokens="8192")
    rows = [run(plan_tokens_per_block="32"), small]
    assert names(rows) == ["block 32", "block 16"]
    assert [field.name for field in differing_fields(rows)] == ["--tokens_per_block", "plan tokens_per_block",
                                                                "primary pool"]


def test_every_kind_of_configuration_is_a_field_that_differs():
    rows = [run(), run(model="plans/qwen", plan_path="plans/qwen", dataset="d/abab.jsonl", dataset_sha256="cd" * 32,
                       device="cuda:0 NVIDIA H100", engine="kvtool", simulated="True", cost_profile="h100 (estimated)",
                       plan_dtype="bfloat16", build_dtype="bfloat16", max_batch_size="8")]
    found = {field.name: (field.value(rows[0]), field.value(rows[1])) for field in differing_fields(rows)}
    assert found == {"--max_batch_size": ("default", "8"), "model": ("plans/sm32", "plans/qwen"),
                     "dataset": ("sp.jsonl (sha256 abababababab)", "abab.jsonl (sha256 cdcdcdcdcdcd)"),
                     "device": ("cpu: test", "cuda:0 NVIDIA H100")}
    # A field only one report records does not differ: engine, simulated, cost profile, the dtypes above.
    rows[0].update(simulated="False", plan_dtype="float32")
    assert {"simulated", "plan dtype"} <= {field.name for field in differing_fields(rows)}


def test_chosen_labels_stay_and_repeated_ones_get_what_differs_then_their_place():
    rows = [run("on"), run("off", enable_kv_cache_reuse="False"),
            run("on", kv_host_cache_bytes="1073741824"), run("off", enable_kv_cache_reuse="False")]
    sources = [Path("out/a/summary.csv"), Path("out/a/summary.csv"), Path("out/b/summary.csv"),
               Path("out/b/summary.csv")]
    assert names(rows, sources) == ["on (host off)", "off (a)", "on (host 1.0 GiB)", "off (b)"]


def test_a_default_label_no_other_run_shares_stays():
    assert names([run(), run("sm64", model="plans/sm64", plan_path="plans/sm64", tokens_per_block="64")]) == [
        "sm32", "sm64"]
    assert names([run("in-process"), run("sm32@endpoint", model="sm32", engine="vllm@endpoint")]) == [
        "in-process", "sm32@endpoint"]
    # Two plans run with reuse on and off: names alike across the plans get the plan added.
    rows = [run(), run(enable_kv_cache_reuse="False")]
    rows += [{**row, "label": "sm64", "model": "plans/sm64", "plan_path": "plans/sm64"} for row in rows]
    assert names(rows) == ["reuse on (sm32)", "reuse off (sm32)", "reuse on (sm64)", "reuse off (sm64)"]


def test_the_same_configuration_twice_is_told_apart_by_directory_or_file():
    assert names([run(), run()], [Path("out/one/summary.csv"), Path("out/two/summary.csv")]) == [
        "sm32 (one)", "sm32 (two)"]
    assert names([run(), run()], [Path("a.csv"), Path("b.csv")]) == ["sm32 (a)", "sm32 (b)"]
    assert names([run(), run()], [Path("a.csv"), Path("a.csv")]) == ["sm32 (a.csv)", "sm32 (a.csv) #2"]


def test_a_default_label_is_known_by_its_source_column_or_by_matching_the_model():
    assert default_label(run()) and default_label(run("tiny-llama", model="preset:tiny-llama"))
    assert default_label(run("vllm@endpoint", model="vllm"))
    assert not default_label(run("baseline"))
    assert not default_label(run(label_source="--label")) and default_label(run("x", label_source="default"))


def test_telling_apart_takes_fields_in_order_until_every_row_is_distinct():
    rows = [run(), run(enable_kv_cache_reuse="False"), run(kv_host_cache_bytes="1024"),
            run(enable_kv_cache_reuse="False", kv_host_cache_bytes="1024")]
    chosen = telling_apart(rows, differing_fields(rows))
    assert [field.column for field in chosen] == ["enable_kv_cache_reuse", "kv_host_cache_bytes"]


def test_every_bench_flag_is_a_configuration_field():
    assert {flag.column or flag.name for flag in CONFIG_FLAGS} == {field.column for field in FLAG_FIELDS}


def test_a_simulated_run_beside_a_measured_one_is_named_so():
    measured = run("reuse", engine="kvtool")
    simulated = run("reuse", engine="kvtool simulate (h100 (estimated))")  # older reports: no `simulated` column
    assert names([measured, simulated]) == ["reuse (measured)", "reuse (simulated)"]
    assert names([measured, {**simulated, "engine": "kvtool", "simulated": "True"}]) == [
        "reuse (measured)", "reuse (simulated)"]
