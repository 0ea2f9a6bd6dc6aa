"""The search for the cheapest fleet that meets an SLO (kvtool/fleet/slo_search.py, search_space.py,
slo_early_stop.py, and `kvtool simulate --search`): its answer equals running every configuration, its
early stop never stops a run that could still meet the SLO, and bad --search values are one line."""

from __future__ import annotations

import pytest
import test_fleet_simulation
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli_bench import invoke, read_rows
from test_fleet_simulation import trace_lines

from kvtool.fleet.search_space import parse_search
from kvtool.fleet.slo_early_stop import exceeding_needed
from kvtool.fleet.slo_search import Evaluation, search
from kvtool.reports.metrics import percentile
from kvtool.reports.slo import parse_slo
from kvtool.workloads.datasets import write_jsonl

profile = test_fleet_simulation.profile  # the fixture: a cost model file

# -- the search, against running every configuration --------------------------------------------


@st.composite
def fleets(draw):
    """Settings each needing some number of replicas (None: no count searched suffices) with a headroom
    per count that shrinks as replicas are added (more replicas never hurt)."""
    counts = sorted(draw(st.sets(st.integers(1, 20), min_size=1, max_size=8)))
    num_settings = draw(st.integers(1, 5))
    needs = [draw(st.one_of(st.none(), st.integers(1, 21))) for _ in range(num_settings)]
    base = [draw(st.integers(1, 4)) for _ in range(num_settings)]  # ties in headroom happen
    return counts, needs, base


@settings(max_examples=200, deadline=None)
@given(fleets())
def test_the_search_answers_as_running_every_configuration(fleet):
    counts, needs, base = fleet

    def evaluate(setting, replicas):
        need = needs[setting["i"]]
        met = need is not None and replicas >= need
        return Evaluation(met=met, headroom=base[setting["i"]] / (replicas + 1), row={})

    settings_ = [{"i": i} for i in range(len(needs))]
    result = search(settings_, counts, evaluate)
    every = [(replicas, evaluate(s, replicas).headroom, i) for i, s in enumerate(settings_) for replicas in counts
             if evaluate(s, replicas).met]
    expected = min(every) if every else None
    got = None if result.best is None else (result.best.replicas, result.best.evaluation.headroom,
                                             result.best.setting_index)
    assert got == expected
    # It runs no configuration twice, and at most one binary search's worth per setting.
    runs = [(t.setting_index, t.replicas) for t in result.tried]
    assert len(runs) == len(set(runs))
    assert len(runs) <= len(needs) * (len(counts).bit_length() + 1)
    assert result.num_not_run == len(needs) * len(counts) - len(runs)


# -- the early stop -------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=60), st.floats(0, 100),
       st.sampled_from([50, 90, 95, 99, 99.9, 100]))
def test_enough_values_above_a_bound_put_the_percentile_above_it(values, bound, q):
    above = sum(v > bound for v in values)
    needed = exceeding_needed(len(values), q)
    if above >= needed:
        assert percentile(values, q) > bound
    # One fewer above the bound may still meet it: the value of the rank the percentile starts from does.
    fewer = sorted([bound + 1] * (needed - 1) + [bound] * (len(values) - needed + 1))
    assert fewer[int(q / 100 * (len(values) - 1))] <= bound


# -- the --slo and --search grammar --------------------------------------------------------------

def test_percentile_objectives_are_parsed_beside_bounds_on_every_request():
    slo = parse_slo("ttft_p90=2s,tpot_p99.9=80ms,e2e=10s")
    assert [(p.name, p.column, p.bound_ms) for p in slo.percentiles] == [
        ("ttft_p90", "ttft_ms_p90", 2000.0), ("tpot_p99.9", "tpot_ms_p99.9", 80.0)]
    assert slo.e2e_ms == 10000.0 and dict(slo.bounds()) == {"e2e_ms": 10000.0, "ttft_ms": 2000.0, "tpot_ms": 80.0}


@pytest.mark.parametrize("text, message", [
    ("ttft_p101=1s", "the percentile must be in (0, 100]"),
    ("ttft_p90=1s,ttft_p90=2s", "ttft_p90 is given twice"),
    ("latency_p90=1s", "'latency_p90=1s' is not an objective"),
    ("ttft_p90=fast", "'fast' is not a time for ttft_p90"),
])
def test_a_bad_percentile_objective_is_one_line_naming_slo(text, message):
    with pytest.raises(ValueError, match="--slo") as error:
        parse_slo(text)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_search_space_is_every_combination_and_replica_counts_ascending():
    assert parse_search(["replicas=8,2,4"]).replica_counts == [2, 4, 8]
    space = parse_search(["max_batch_size=8,16", "replicas=1..3", "router=round_robin,prefix_aware"])
    assert space.replica_counts == [1, 2, 3]
    assert space.settings == [{"max_batch_size": 8, "router": "round_robin"},
                              {"max_batch_size": 8, "router": "prefix_aware"},
                              {"max_batch_size": 16, "router": "round_robin"},
                              {"max_batch_size": 16, "router": "prefix_aware"}]
    assert space.num_configurations == 12


@pytest.mark.parametrize("specs, kwargs, message", [
    (["replicas"], {}, "--search 'replicas' is not NAME=V1,V2,... or NAME=LOW..HIGH"),
    (["replicas=4..1"], {}, "'4..1' is empty"),
    (["replicas=0..3"], {}, "replica counts are whole numbers from 1 up"),
    (["replicas=a..b"], {}, "'a..b' is not a range of whole numbers"),
    (["colour=red"], {}, "'colour' cannot be searched"),
    (["router=fastest"], {}, "'fastest' is not a router"),
    (["max_batch_size=8", "max_batch_size=16"], {}, "--search max_batch_size is given twice"),
    (["replicas=1..4"], {"replicas": 2}, "--replicas is given and searched"),
    (["max_batch_size=8,16"], {"given": {"max_batch_size": 4}}, "--max_batch_size is given and searched"),
])
def test_bad_search_values_are_one_line_naming_search(specs, kwargs, message):
    with pytest.raises(ValueError) as error:
        parse_search(specs, **kwargs)
    assert message in str(error.value) and "\n" not in str(error.value)


# -- the command --------------------------------------------------------------------------------

@pytest.fixture
def busy_trace(tmp_path):
    """Arrivals 1 ms apart on average: one replica queues them, several keep up."""
    return write_jsonl(tmp_path / "trace.jsonl", trace_lines(60, spacing_s=0.001))


def simulate(plan, dataset, profile, output, *args):
    return invoke("simulate", "--plan", plan, "--dataset", dataset, "--profile", profile, "--mode", "trace",
                  "--max_tokens_in_paged_kv_cache", 4096, "--output", output, *args)


def test_search_returns_the_cheapest_fleet_that_a_run_of_it_confirms(tiny_llama_plan, busy_trace, profile, tmp_path):
    slo = "ttft_p90=30ms"
    result = simulate(tiny_llama_plan, busy_trace, profile, tmp_path / "search", "--slo", slo,
                      "--search", "replicas=1..6", "--search", "max_batch_size=2,8")
    assert result.exit_code == 0, result.output
    tried = read_rows(tmp_path / "search" / "search.csv")
    cheapest = [r for r in tried if r["result"] == "met"]
    assert cheapest, result.output
    best = min(cheapest, key=lambda r: (int(r["replicas"]), float(r["headroom"])))
    assert f"cheapest meeting TTFT p90 ≤ 30 ms: {best['replicas']} replica" in " ".join(result.output.split())
    # Independent runs of the fleets named: the cheapest meets the SLO, one replica fewer does not (either
    # batch size).
    replicas = int(best["replicas"])
    for count, batch, met in [(replicas, best["max_batch_size"], "True"), *(
            (replicas - 1, b, "False") for b in ("2", "8") if replicas > 1)]:
        out = tmp_path / f"run-{count}-{batch}"
        run = simulate(tiny_llama_plan, busy_trace, profile, out, "--slo", slo, "--replicas", count,
                       "--max_batch_size", batch)
        assert run.exit_code == 0, run.output
        assert read_rows(out / "summary.csv")[0]["slo_met"] == met, (count, batch)
    # summary.csv holds the fleet row of every configuration tried (compare reads it).
    assert len(read_rows(tmp_path / "search" / "summary.csv")) == len(tried)


@pytest.mark.parametrize("args, message", [
    (["--search", "replicas=1..4"], "--search looks for the cheapest fleet meeting percentile objectives"),
    (["--slo", "ttft=5ms", "--search", "replicas=1..4"], "--search looks for the cheapest fleet"),
    (["--slo", "ttft_p90=5ms", "--search", "replicas=1..x"], "--search 'replicas=1..x'"),
    (["--slo", "ttft_p90=5ms", "--search", "replicas=1..4", "--replicas", "2"], "--replicas is given and searched"),
    (["--slo", "ttft_p90=5ms", "--search", "router=round_robin", "--router", "least_loaded"],
     "--router is given and searched"),
])
def test_bad_search_flags_are_one_clear_line(tiny_llama_plan, busy_trace, profile, tmp_path, args, message):
    result = simulate(tiny_llama_plan, busy_trace, profile, tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output


def test_a_configuration_that_cannot_run_stops_the_search_keeping_those_run(tiny_llama_plan, busy_trace, profile,
                                                                            tmp_path):
    result = simulate(tiny_llama_plan, busy_trace, profile, tmp_path / "search", "--slo", "ttft_p90=30ms",
                      "--search", "replicas=1..2", "--search", "max_batch_size=8,16")  # the plan allows up to 8
    assert result.exit_code == 2 and "--max_batch_size 16 is outside what the plan was built for" in result.output
    assert {r["max_batch_size"] for r in read_rows(tmp_path / "search" / "search.csv")} == {"8"}
