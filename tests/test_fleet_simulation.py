"""A simulated fleet (kvtool/fleet/simulated_fleet.py): replicas on one simulated clock, requests routed
when they arrive. Checked against independent references: a fleet of one replays exactly as one simulated
engine; round-robin replicas each replay exactly what one engine replays of their share; least_loaded
chooses, at each arrival, the replica with the fewest requests in flight as the finished rows show them."""

from __future__ import annotations

import random

import pytest
from test_cli_bench import invoke, read_rows

from kvtool.bench.runner import run_bench
from kvtool.fleet.routers import RouterOptions, make_router
from kvtool.fleet.simulated_fleet import SimulatedFleet
from kvtool.flags import configs
from kvtool.plan import load_plan
from kvtool.simulate.cost_model import CostModel
from kvtool.simulate.simulated_llm import SimulatedLLM
from kvtool.workloads.datasets import load_dataset, write_jsonl

# 2 ms a step, 20 µs a context token, 0.1 ms a decode row: prefill dominates, decode steps are short.
COST = {"step": 2e-3, "context_token": 2e-5, "decode_row": 1e-4}
POOL = {"max_tokens_in_paged_kv_cache": 4096}


def cost_model() -> CostModel:
    return CostModel(device="cpu: test", coefficients=COST)


def trace_lines(num: int, *, seed: int = 0, sessions: bool = False, spacing_s: float = 0.004) -> list[dict]:
    """Prompts from 4 shared system prompts (3 blocks of 16) plus their own tokens, arriving ``spacing_s``
    apart on average (several in flight at once), outputs of 1 to 12 tokens."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 1000) for _ in range(48)] for _ in range(4)]
    lines, now, turns = [], 0.0, {}
    for i in range(num):
        now += rng.expovariate(1 / spacing_s)
        line = {"input_ids": systems[rng.randrange(4)] + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 40))],
                "output_tokens": rng.randrange(1, 13), "request_id": f"r{i}", "arrival_time_s": round(now, 6)}
        if sessions and i % 3:  # two thirds are turns of 5 sessions
            session = f"s{i % 5}"
            turns[session] = turn = turns.get(session, -1) + 1
            line.update(session_id=session, turn=turn)
            if turn:
                del line["arrival_time_s"]  # a later turn is sent when the previous one finishes
                line["input_ids"] = line["input_ids"][48:] or [7]
        lines.append(line)
    return lines


def replay(plan, lines, tmp_path, name, *, replicas=None, router="round_robin", **flags):
    """The per-request rows of ``lines`` replayed by one SimulatedLLM (replicas None) or a fleet."""
    dataset = load_dataset(write_jsonl(tmp_path / f"{name}.jsonl", lines))
    engine, options = configs({**POOL, **flags})
    if replicas is None:
        target = SimulatedLLM(plan, cost_model(), engine)
    else:
        llms = [SimulatedLLM(plan, cost_model(), engine) for _ in range(replicas)]
        target = SimulatedFleet(llms, make_router(RouterOptions(router), replicas, block_size=16,
                                                  capacity_tokens=[4096] * replicas))
    result = run_bench(target, dataset, options, label=name, requests_csv=tmp_path / f"{name}.csv")
    assert result.failure is None and not result.interrupted
    return {r.request_id: r for r in result.requests}, target


def assert_same_timing(rows, expected):
    """Every request arrived, got its first token and finished at the same simulated times, reusing as much."""
    assert rows.keys() == expected.keys()
    for key, r in expected.items():
        got = rows[key]
        assert (got.reused_tokens, got.output_tokens) == (r.reused_tokens, r.output_tokens), key
        assert (got.arrival_s, got.first_token_s, got.finish_s) == pytest.approx(
            (r.arrival_s, r.first_token_s, r.finish_s), abs=1e-9), key


@pytest.mark.parametrize("lines, flags", [
    (trace_lines(40), {"mode": "trace"}),
    (trace_lines(40, spacing_s=0.0005), {"mode": "trace", "concurrency": 3}),
    (trace_lines(30, sessions=True), {"mode": "trace"}),
    (trace_lines(20), {"mode": "sequential"}),
    (trace_lines(30), {"concurrency": 4}),
], ids=["trace", "trace-concurrency", "sessions", "sequential", "concurrency"])
def test_a_fleet_of_one_replays_exactly_as_one_simulated_engine(tiny_llama_plan, tmp_path, lines, flags):
    plan = load_plan(tiny_llama_plan)
    single, _ = replay(plan, lines, tmp_path, "single", **flags)
    fleet, _ = replay(plan, lines, tmp_path, "fleet", replicas=1, **flags)
    assert_same_timing(fleet, single)
    assert {r.replica for r in fleet.values()} == {0}


def test_round_robin_replicas_each_replay_their_share_as_one_engine_would(tiny_llama_plan, tmp_path):
    plan = load_plan(tiny_llama_plan)
    lines = trace_lines(60, spacing_s=0.002)  # arrivals ascending: the router's turn follows the file
    fleet, target = replay(plan, lines, tmp_path, "fleet", replicas=3)
    for replica in range(3):
        share = [line for i, line in enumerate(lines) if i % 3 == replica]
        alone, _ = replay(plan, share, tmp_path, f"alone{replica}")
        assert_same_timing({k: fleet[k] for k in alone}, alone)
        assert {fleet[k].replica for k in alone} == {replica}
        assert target.engine.replica_stats(replica)["reused_blocks"] == sum(r.reused_tokens for r in alone.values()) // 16


def test_least_loaded_chooses_the_fewest_in_flight_at_each_arrival(tiny_llama_plan, tmp_path):
    plan = load_plan(tiny_llama_plan)
    rows, _ = replay(plan, trace_lines(80, spacing_s=0.001), tmp_path, "fleet", replicas=3, router="least_loaded",
                     mode="trace")
    ordered = sorted(rows.values(), key=lambda r: (r.arrival_s, int(r.request_id[1:])))
    last, loads_seen = -1, set()
    for i, request in enumerate(ordered):
        # In flight at its arrival: sent before it and not finished by then (a finish at the same moment
        # is released before the arrival).
        loads = [0, 0, 0]
        for earlier in ordered[:i]:
            if earlier.finish_s > request.arrival_s:
                loads[earlier.replica] += 1
        turn = [(last + 1 + k) % 3 for k in range(3)]
        assert request.replica == next(r for r in turn if loads[r] == min(loads)), (request.request_id, loads)
        last = request.replica
        loads_seen.add(tuple(sorted(loads)))
    assert len(loads_seen) > 3  # the replay did load the replicas unevenly


def test_no_request_is_served_before_it_arrives_and_tokens_come_in_order(tiny_llama_plan, tmp_path):
    plan = load_plan(tiny_llama_plan)
    rows, target = replay(plan, trace_lines(60, spacing_s=0.001), tmp_path, "fleet", replicas=4,
                          router="prefix_aware", mode="trace")
    for r in rows.values():
        assert r.arrival_s <= r.first_token_s <= r.finish_s
    assert sum(target.engine.busy_seconds) > 0 and all(n > 0 for n in target.engine.num_steps)
    assert target.router.num_in_flight == [0, 0, 0, 0]


# -- the command ------------------------------------------------------------------------------------

@pytest.fixture
def trace_dataset(tmp_path):
    return write_jsonl(tmp_path / "trace.jsonl", trace_lines(60, spacing_s=0.002))


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(cost_model().to_json())
    return path


def simulate_fleet(plan, dataset, profile, output, *args):
    result = invoke("simulate", "--plan", plan, "--dataset", dataset, "--profile", profile, "--mode", "trace",
                    "--max_tokens_in_paged_kv_cache", 4096, "--output", output, *args)
    assert result.exit_code == 0, result.output
    return read_rows(output / "summary.csv"), read_rows(output / "requests.csv"), result.output


def test_simulate_reports_the_fleet_and_each_replica(tiny_llama_plan, trace_dataset, profile, tmp_path):
    rows, requests, output = simulate_fleet(tiny_llama_plan, trace_dataset, profile, tmp_path / "fleet", "--replicas",
                                            3, "--router", "prefix_aware", "--slo", "ttft_p90=50ms,tpot=5ms")
    fleet, replicas = rows[0], rows[1:]
    assert [r["label"] for r in rows] == ["tiny-llama"] + [f"tiny-llama replica {i}" for i in range(3)]
    assert [r["replica"] for r in rows] == ["", "0", "1", "2"]
    assert {r["num_replicas"] for r in rows} == {"3"} and {r["router"] for r in rows} == {"prefix_aware"}
    assert int(fleet["num_requests"]) == 60 == sum(int(r["num_requests"]) for r in replicas)
    for column in ("reused_blocks", "missed_blocks", "evicted_blocks"):
        assert int(fleet[column]) == sum(int(r[column]) for r in replicas)
    # Each replica's requests, by the requests file's replica column; the imbalance from them by hand.
    work = []
    for replica in range(3):
        mine = [r for r in requests if r["replica"] == str(replica)]
        assert int(replicas[replica]["num_requests"]) == len(mine)
        work.append(sum(int(r["input_tokens"]) - int(r["reused_tokens"]) + int(r["output_tokens"]) for r in mine))
    assert int(fleet["computed_tokens"]) == sum(work)
    assert float(fleet["load_imbalance"]) == pytest.approx(max(work) / (sum(work) / 3))
    assert fleet["slo_met"] in ("True", "False") and float(fleet["slo_ttft_ms_p90"]) == 50
    assert "load imbalance (max / mean)" in output and "percentile objectives met" in output


def test_compare_names_fleets_by_router_and_keeps_replicas_apart(tiny_llama_plan, trace_dataset, profile, tmp_path):
    for router in ("round_robin", "prefix_aware"):
        simulate_fleet(tiny_llama_plan, trace_dataset, profile, tmp_path / router, "--replicas", 2, "--router", router)
    result = invoke("compare", tmp_path / "round_robin", tmp_path / "prefix_aware")
    assert result.exit_code == 0, result.output
    header = result.output.split("\n")[:12]
    text = " ".join(header)
    assert "router round_robin" in text and "router prefix_aware" in text
    assert "tiny-llama replica 1 (router prefix_aware)" in result.output.replace("\n", " ") or \
        "replica 1" in result.output


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "--replicas must be at least 1, got 0"),
    (["--router", "fastest"], "--router 'fastest' is unknown: use one of round_robin, least_loaded, prefix_aware"),
    (["--replicas", "2", "--sweep", "max_batch_size=1,2"], "--replicas and --router run one fleet"),
    (["--router_block_size", "0"], "--router_block_size must be a positive number of tokens"),
])
def test_bad_fleet_flags_are_one_clear_line(tiny_llama_plan, trace_dataset, profile, args, message):
    result = invoke("simulate", "--plan", tiny_llama_plan, "--dataset", trace_dataset, "--profile", profile, *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
