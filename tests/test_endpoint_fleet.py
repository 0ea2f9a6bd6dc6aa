"""`kvtool bench --endpoint URL --endpoint URL --router NAME` (kvtool/fleet/endpoint_fleet.py): real kvtool
servers behind kvtool's routers. Checked against `kvtool simulate --replicas N --router NAME` on the same
dataset: where routing does not depend on timing (sequential replays), each server's cache counters
equal its simulated replica's, exactly."""

from __future__ import annotations

import contextlib

import pytest
import test_fleet_simulation
from serve_helpers import running_server, tiny_llm
from test_cli_bench import invoke, read_rows
from test_fleet_simulation import trace_lines

from kvtool import KvCacheConfig
from kvtool.workloads.datasets import write_jsonl

POOL_TOKENS = 4096
COUNTERS = ("reused_blocks", "missed_blocks", "evicted_blocks", "missed_never_seen_blocks")

profile = test_fleet_simulation.profile  # the fixture: a cost model file


@pytest.fixture
def servers(tiny_llama_plan):
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(running_server(tiny_llm(tiny_llama_plan,
                                                           kv_cache_config=KvCacheConfig(max_tokens=POOL_TOKENS))))
               for _ in range(2)]


@pytest.fixture
def dataset(tmp_path):
    return write_jsonl(tmp_path / "trace.jsonl", trace_lines(16, sessions=True))


@pytest.mark.parametrize("router", ["round_robin", "least_loaded", "prefix_aware"])
def test_each_server_counts_what_its_simulated_replica_counts(tiny_llama_plan, servers, dataset, profile, tmp_path,
                                                              router):
    bench = invoke("bench", *(a for s in servers for a in ("--endpoint", s.url)), "--router", router,
                   "--router_block_size", 16, "--dataset", dataset, "--mode", "sequential", "--output",
                   tmp_path / "real")
    assert bench.exit_code == 0, bench.output
    simulated = invoke("simulate", "--plan", tiny_llama_plan, "--profile", profile, "--replicas", 2, "--router", router,
                       "--dataset", dataset, "--mode", "sequential", "--max_tokens_in_paged_kv_cache", POOL_TOKENS,
                       "--output", tmp_path / "simulated")
    assert simulated.exit_code == 0, simulated.output
    real, predicted = read_rows(tmp_path / "real" / "summary.csv"), read_rows(tmp_path / "simulated" / "summary.csv")
    assert [r["replica"] for r in real] == ["", "0", "1"] and {r["router"] for r in real} == {router}
    assert [r["endpoint"] for r in real[1:]] == [f"{s.url}/v1" for s in servers]
    for got, expected in zip(real, predicted):
        assert {c: got[c] for c in COUNTERS} == {c: expected[c] for c in COUNTERS}, got["label"]
        assert got["num_requests"] == expected["num_requests"]
    assert int(real[0]["reused_blocks"]) > 0 and all(int(r["num_requests"]) > 0 for r in real[1:])
    # Which server served each request, as the simulation routed it.
    served = {r["request_id"]: r["replica"] for r in read_rows(tmp_path / "real" / "requests.csv")}
    assert served == {r["request_id"]: r["replica"] for r in read_rows(tmp_path / "simulated" / "requests.csv")}


@pytest.mark.parametrize("args, message", [
    (["--endpoint", "http://127.0.0.1:1", "--router", "prefix_aware"], "--router routes requests over servers: give "
                                                                       "two --endpoint URL or more"),
    (["--router", "round_robin"], "--router routes requests over servers"),
    (["--endpoint", "http://127.0.0.1:1", "--endpoint", "http://127.0.0.1:1"], "--endpoint: a server is given twice"),
    (["--endpoint", "http://127.0.0.1:1", "--endpoint", "http://127.0.0.1:2", "--router", "fastest"],
     "--router 'fastest' is unknown: use one of round_robin, least_loaded, prefix_aware"),
])
def test_bad_fleet_flags_of_bench_are_one_clear_line(dataset, tmp_path, args, message):
    result = invoke("bench", "--dataset", dataset, "--output", tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output


def test_prefix_aware_records_of_kvtool_servers_hold_what_their_pools_hold(tiny_llama_plan):
    from kvtool.bench.endpoint import EndpointOptions
    from kvtool.fleet.endpoint_fleet import EndpointFleet
    from kvtool.fleet.routers import RouterOptions

    host_bytes = 1 << 20
    configs = [KvCacheConfig(max_tokens=POOL_TOKENS), KvCacheConfig(max_tokens=2 * POOL_TOKENS,
                                                                     host_cache_size=host_bytes)]
    with contextlib.ExitStack() as stack:
        llms = [tiny_llm(tiny_llama_plan, kv_cache_config=config) for config in configs]
        servers = [stack.enter_context(running_server(llm)) for llm in llms]
        fleet = EndpointFleet([EndpointOptions(url=s.url) for s in servers], RouterOptions("prefix_aware"), timed=False)
        try:
            # The block size and pools each server reports on /metrics, as a simulated replica's record holds them.
            block = llms[0].pool_sizes.tokens_per_block
            assert fleet.router.block_size == block == 16
            assert [record.capacity for record in fleet.router.records] == [
                llm.pool_sizes.num_primary_blocks + llm.pool_sizes.num_secondary_blocks for llm in llms]
            assert llms[1].pool_sizes.num_secondary_blocks > 0
        finally:
            fleet.shutdown()
