"""Scenario files: validation (unknown keys named), overrides, and sweeps run over a fake engine."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml
from bench_fakes import FakeLLM

from kvtool.bench.scenario import ScenarioError, load_scenario
from kvtool.bench.sweep import run_scenario

CONFIG_DIR = Path(__file__).resolve().parent.parent / "bench_configs"
SHIPPED = sorted(CONFIG_DIR.glob("*.yaml"))

BASE = {
    "name": "demo",
    "model": "preset:tiny-llama",
    "dataset": {"generator": "random", "num_requests": 4, "input_len": 8, "output_len": 2},
    "bench": {"mode": "sequential"},
    "sweep": [{"label": "on", "enable_kv_cache_reuse": True}, {"label": "off", "enable_kv_cache_reuse": False}],
}


def write_yaml(tmp_path, document, name="scenario.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(document))
    return path


def test_the_shipped_scenarios_are_all_there_and_valid():
    names = {path.stem for path in SHIPPED}
    assert names >= {"system_prompt", "multi_turn", "offload_abab", "block_size_sweep", "host_cache_sweep",
                     "scheduler_policies"}
    for path in SHIPPED:
        scenario = load_scenario(path)
        assert len(scenario.variants) >= 2, path
        assert all(v.model == "preset:tiny-llama" for v in scenario.variants), path


def test_block_size_sweep_builds_one_plan_per_block_size():
    scenario = load_scenario(CONFIG_DIR / "block_size_sweep.yaml")
    assert [v.build["tokens_per_block"] for v in scenario.variants] == [16, 32, 64, 128]
    assert all(v.engine.tokens_per_block is None for v in scenario.variants)  # baked into the plan instead


def test_offload_scenario_compares_host_cache_on_and_off():
    variants = {v.label: v for v in load_scenario(CONFIG_DIR / "offload_abab.yaml").variants}
    assert variants["reuse"].engine.kv_cache_config.host_cache_size == 0
    assert variants["reuse+offload"].engine.kv_cache_config.host_cache_size == 512 << 20
    assert {v.engine.kv_cache_config.max_tokens for v in variants.values()} == {1152}
    assert {v.replay.mode for v in variants.values()} == {"sequential"}


def test_variants_merge_base_flags_and_overrides(tmp_path):
    scenario = load_scenario(write_yaml(tmp_path, BASE))
    assert scenario.name == "demo"
    on, off = scenario.variants
    assert (on.label, on.engine.kv_cache_config.enable_block_reuse, on.replay.mode) == ("on", True, "sequential")
    assert (off.label, off.engine.kv_cache_config.enable_block_reuse) == ("off", False)
    assert on.dataset.generator == "random" and on.dataset.parameters["num_requests"] == 4


@pytest.mark.parametrize("change, where, key", [
    (lambda d: d.update(benchmark={}), "top level", "benchmark"),
    (lambda d: d["bench"].update(max_batch=4), "bench", "max_batch"),
    (lambda d: d["sweep"][1].update(enable_reuse=True), "sweep[1]", "enable_reuse"),
    (lambda d: d.update(build={"tokens_per_blok": 16}), "build", "tokens_per_blok"),
    (lambda d: d["dataset"].update(num_request=3), "dataset", "num_request"),
])
def test_unknown_keys_are_named_with_the_file_and_the_allowed_keys(tmp_path, change, where, key):
    document = yaml.safe_load(yaml.safe_dump(BASE))
    change(document)
    path = write_yaml(tmp_path, document, "typo.yaml")
    with pytest.raises(ScenarioError) as error:
        load_scenario(path)
    message = str(error.value)
    assert str(path) in message and where in message and repr(key) in message
    assert "allowed" in message


@pytest.mark.parametrize("change, message", [
    (lambda d: d["bench"].update(scheduler_policy="fastest"), "scheduler_policy 'fastest' is unknown"),
    (lambda d: d.update(build={"tokens_per_block": 24}), "build.tokens_per_block must be a power of 2"),
    (lambda d: d["sweep"].append({"label": "on"}), "label 'on' is used twice"),
    (lambda d: d.update(plan="plans/x"), "either `model:`"),
    (lambda d: d.pop("dataset"), "no `dataset:`"),
    (lambda d: d.update(dataset={"generator": "random", "num_requests": 2}), "needs parameter(s)"),
    (lambda d: d.update(sweep={"label": "x"}), "expected a list of variants"),
])
def test_bad_values_are_errors_naming_the_file(tmp_path, change, message):
    document = yaml.safe_load(yaml.safe_dump(BASE))
    change(document)
    path = write_yaml(tmp_path, document)
    with pytest.raises(ScenarioError) as error:
        load_scenario(path)
    assert str(path) in str(error.value) and message in str(error.value)


def test_set_overrides_and_command_line_model_win(tmp_path):
    path = write_yaml(tmp_path, BASE)
    scenario = load_scenario(path, sets=["bench.max_batch_size=4", "sweep.0.label=reuse", "dataset.input_len=16"],
                             model="preset:small-llama")
    assert [v.label for v in scenario.variants] == ["reuse", "off"]
    assert all(v.engine.max_batch_size == 4 and v.model == "preset:small-llama" for v in scenario.variants)
    assert scenario.variants[0].dataset.parameters["input_len"] == 16
    only_plan = load_scenario(path, plan=tmp_path / "myplan", bench_overrides={"warmup": 1})
    assert all(v.plan == tmp_path / "myplan" and v.model is None and v.replay.warmup == 1
               for v in only_plan.variants)


def test_set_errors(tmp_path):
    path = write_yaml(tmp_path, BASE)
    with pytest.raises(ScenarioError, match="is not KEY=VALUE"):
        load_scenario(path, sets=["bench.max_batch_size"])
    with pytest.raises(ScenarioError, match="sweep.7 is not an item of the list"):
        load_scenario(path, sets=["sweep.7.label=x"])
    with pytest.raises(ScenarioError, match="unknown key 'bench_flags'"):
        load_scenario(path, sets=["bench_flags.x=1"])


def test_tokens_per_block_is_a_flag_checked_against_a_fixed_plan(tmp_path):
    document = {**BASE, "plan": "plans/fixed", "sweep": [{"label": "a", "tokens_per_block": 16}]}
    document.pop("model")
    variant, = load_scenario(write_yaml(tmp_path, document)).variants
    assert variant.plan == Path("plans/fixed") and variant.engine.tokens_per_block == 16 and not variant.build


def test_runtime_limits_above_the_default_build_are_built_in(tmp_path):
    document = {**BASE, "bench": {"max_batch_size": 32, "max_num_tokens": 256}}
    variant = load_scenario(write_yaml(tmp_path, document)).variants[0]
    assert variant.build == {"max_batch_size": 32}  # 256 tokens per step fit the default plan
    assert variant.engine.max_batch_size == 32


# -- running a sweep --------------------------------------------------------------------------

class Recorder:
    def __init__(self, interrupt_in_variant=None):
        self.plans, self.llms, self.interrupt_in_variant = [], [], interrupt_in_variant

    def resolve(self, variant):
        self.plans.append(dict(variant.build))
        return f"plans/{variant.label}"

    def create(self, plan_dir, config, replay, dataset=None):
        interrupt = 3 if len(self.llms) == self.interrupt_in_variant else None
        llm = FakeLLM(interrupt_at_step=interrupt, enable_block_reuse=config.kv_cache_config.enable_block_reuse,
                      config=config)
        self.llms.append((plan_dir, config, llm))
        return llm


def test_a_sweep_writes_one_summary_row_per_variant_and_request_files(tmp_path):
    document = {**BASE, "sweep": [{"label": "tpb4", "tokens_per_block": 4}, {"label": "tpb8", "tokens_per_block": 8}]}
    recorder = Recorder()
    result = run_scenario(load_scenario(write_yaml(tmp_path, document)), tmp_path / "out",
                          llm_factory=recorder.create, plan_resolver=recorder.resolve)
    assert not result.interrupted
    assert recorder.plans == [{"tokens_per_block": 4}, {"tokens_per_block": 8}]  # a plan per block size
    assert all(llm.shut_down for _, _, llm in recorder.llms)
    with result.summary_csv.open() as f:
        rows = list(csv.DictReader(f))
    assert [row["label"] for row in rows] == ["tpb4", "tpb8"]
    assert [row["build_tokens_per_block"] for row in rows] == ["4", "8"]
    assert {row["scenario"] for row in rows} == {"demo"}
    for label in ("tpb4", "tpb8"):
        with (tmp_path / "out" / f"requests-{label}.csv").open() as f:
            assert len(list(csv.DictReader(f))) == 4
    assert (tmp_path / "out" / "dataset.jsonl").is_file()  # the generated dataset is kept beside the results


def test_an_interrupted_sweep_keeps_finished_variants_and_the_partial_one(tmp_path):
    recorder = Recorder(interrupt_in_variant=1)
    result = run_scenario(load_scenario(write_yaml(tmp_path, BASE)), tmp_path / "out",
                          llm_factory=recorder.create, plan_resolver=recorder.resolve)
    assert result.interrupted
    with result.summary_csv.open() as f:
        rows = list(csv.DictReader(f))
    assert [(row["label"], row["interrupted"]) for row in rows] == [("on", "False"), ("off", "True")]
    assert rows[1]["num_requests"] == "1"  # sequential, two steps per request: one finished before step 3


def test_repeated_variants_run_alternately_with_a_row_and_request_file_per_run(tmp_path):
    recorder = Recorder()
    scenario = load_scenario(write_yaml(tmp_path, BASE), sets=["repeat=3"])
    assert scenario.repeat == 3
    result = run_scenario(scenario, tmp_path / "out", llm_factory=recorder.create, plan_resolver=recorder.resolve)
    with result.summary_csv.open() as f:
        rows = list(csv.DictReader(f))
    assert [(row["label"], row["repeat"]) for row in rows] == [("on", "1"), ("off", "1"), ("on", "2"), ("off", "2"),
                                                               ("on", "3"), ("off", "3")]
    assert [row["requests_csv"] for row in rows[:2]] == ["requests-on-1.csv", "requests-off-1.csv"]
    assert len(recorder.llms) == 6 and len(recorder.plans) == 2  # a plan per variant, a fresh engine per run
    with pytest.raises(ScenarioError, match="repeat: expected a number of runs >= 1, got 0"):
        load_scenario(write_yaml(tmp_path, {**BASE, "repeat": 0}))


def test_the_demo_scenarios_load_with_the_plan_and_dataset_the_demo_gives(tmp_path):
    dataset = tmp_path / "d.jsonl"
    demos = sorted((CONFIG_DIR.parent / "examples").glob("demo_*.yaml"))
    assert len(demos) == 2
    for path in demos:
        scenario = load_scenario(path, plan=tmp_path / "plan", dataset=dataset)
        # 4 runs per variant is the fewest for which compare's Mann-Whitney test can give a verdict.
        assert scenario.repeat >= 4 and len(scenario.variants) == 2, path
        assert all(v.plan == tmp_path / "plan" and v.dataset.path == dataset for v in scenario.variants), path
        assert all(v.replay.warmup == 2 for v in scenario.variants) and scenario.warmup_rounds == 1, path


def test_warmup_rounds_run_every_variant_first_and_leave_no_trace(tmp_path):
    recorder = Recorder()
    scenario = load_scenario(write_yaml(tmp_path, {**BASE, "repeat": 2, "warmup_rounds": 1}))
    result = run_scenario(scenario, tmp_path / "out", llm_factory=recorder.create, plan_resolver=recorder.resolve)
    assert len(recorder.llms) == 2 + 4  # one warm-up round of both variants, then two recorded rounds
    with result.summary_csv.open() as f:
        assert [(row["label"], row["repeat"]) for row in csv.DictReader(f)] == [
            ("on", "1"), ("off", "1"), ("on", "2"), ("off", "2")]
    assert sorted(p.name for p in (tmp_path / "out").glob("*requests*")) == [
        "requests-off-1.csv", "requests-off-2.csv", "requests-on-1.csv", "requests-on-2.csv"]
