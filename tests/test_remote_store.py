"""The remote tier's data plane (kvtool/runtime/remote_store.py) against a real redis-server (started
per test on a free loopback port: tests/redis_servers.py). Blocks come back bit for bit, engines on
one store find each other's blocks, and every failure of the server (killed mid-run, too slow, full)
is a counted miss: never an exception, never a wrong token (every position a request reads is
checked, tests/tier3_engine.py)."""

from __future__ import annotations

import time

import pytest
import torch
from redis_servers import RedisServer
from tier3_engine import PLAN, SHAPE, T, TieredEngine, prompt

from kvtool._core import PoolKind
from kvtool.runtime.remote_store import RemoteStore, RemoteStoreError
from kvtool.runtime.tier3_store import plan_digest

pytest.importorskip("redis")


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture
def start_redis(tmp_path):
    """Starts servers with other settings: start_redis(maxmemory="2mb", maxmemory_policy="noeviction")."""
    servers = []

    def start(**kwargs) -> RedisServer:
        servers.append(RedisServer(tmp_path / f"redis-{len(servers)}", **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def remote(server, **kwargs) -> RemoteStore:
    kwargs.setdefault("timeout_s", 0.5)
    kwargs.setdefault("retry_after_s", 0.2)
    return RemoteStore(server.url, SHAPE.num_bytes, PLAN, **kwargs)


def spilled(store, num_secondary_blocks=3):
    """An engine whose system prompt of three blocks went down to the store."""
    e = TieredEngine(store, num_secondary_blocks=num_secondary_blocks)
    system = prompt(0, 3 * T + 1)
    e.run(system)
    e.fill(1000)
    store.flush()
    return e, system


def block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE.dims, generator=torch.Generator().manual_seed(seed)).to(SHAPE.dtype)


def key(n: int) -> bytes:
    return n.to_bytes(32, "little")


def test_evicted_blocks_spill_to_redis_and_come_back_identical(redis_server):
    with remote(redis_server) as store:
        e, system = spilled(store)
        assert redis_server.client().dbsize() >= 3
        r = e.run(system)  # every position is checked against the KV it was computed with
        assert (r.num_reused_blocks, r.missed.total) == (3, 0)
        assert e.manager.stats().tier(PoolKind.REMOTE).hit_blocks == 3


def test_an_engine_finds_the_blocks_another_engine_stored(redis_server):
    system = prompt(0, 3 * T + 1)
    with remote(redis_server) as a_store, remote(redis_server) as b_store:
        a = TieredEngine(a_store)
        a.run(system)
        a.fill(1000)
        a_store.flush()
        b = TieredEngine(b_store, num_secondary_blocks=3)
        r = b.run(system)  # b never computed it: found in the store, checked token by token
        assert (r.num_reused_blocks, r.missed.total) == (3, 0)
        assert b.manager.stats().tier3_traffic.discovered_blocks == 3


def test_another_model_on_the_same_store_reads_nothing_of_it(redis_server):
    other = plan_digest(weights_digest="sha256:another-model", kv_dtype=SHAPE.dtype, tokens_per_block=T,
                        num_layers=2, num_kv_heads=2, head_dim=8)
    system = prompt(0, 3 * T + 1)
    with remote(redis_server) as a_store, RemoteStore(redis_server.url, SHAPE.num_bytes, other) as b_store:
        a = TieredEngine(a_store)
        a.run(system)
        a.fill(1000)
        a_store.flush()
        b = TieredEngine(b_store, plan=other)
        assert b_store.count_present(b.manager.tier3_lookup(system).keys) == 0  # other keys altogether
        r = b.run(system)
        assert r.num_reused_blocks == 0 and b_store.counters.num_reads == 0


def test_a_value_under_a_colliding_store_key_is_refused(redis_server):
    # Store keys of 1 byte: keys 1 and 257 share one ("01"); the full key in the value tells them apart.
    with remote(redis_server, key_bytes=1) as store:
        store.write(-1, key(1), block(1))
        store.flush()
        out = torch.zeros(SHAPE.dims, dtype=SHAPE.dtype)
        assert store.count_present([key(257)]) == 1  # the store key is there...
        assert store.read([(-1, key(257), out)]) == [False]  # ...but it is another block
        assert not out.any() and store.counters.num_verify_failures == 1
        assert store.read([(-1, key(1), out)]) == [True] and torch.equal(out, block(1))


def test_server_killed_mid_run_degrades_to_misses(redis_server):
    with remote(redis_server) as store:
        e, system = spilled(store)
        redis_server.kill()
        r = e.run(system)  # the lookup fails: nothing is staged, the prompt is computed again
        assert (r.num_reused_blocks, r.missed.not_staged) == (0, 3)
        assert store.counters.num_lookup_failures == 1
        other = prompt(5000, 3 * T + 1)
        e.run(other)
        e.fill(2000)  # spills to the dead server are counted and dropped
        store.flush()
        assert store.counters.num_write_failures > 0
        redis_server.start()  # back, and empty: the manager's index entries are found gone
        time.sleep(0.3)  # retry_after_s
        r = e.run(other)
        assert r.num_reused_blocks == 0 and r.missed.evicted_remote == 3
        assert e.manager.stats().tier3_traffic.lost_blocks >= 3


def test_server_dying_between_lookup_and_fetch_fails_the_fetch_not_the_step(redis_server):
    with remote(redis_server) as store:
        e, system = spilled(store)
        m = e.manager
        lookup = m.tier3_lookup(system)
        assert store.count_present(lookup.keys) == 3
        m.stage_tier3(system, 3)
        redis_server.kill()
        failed = e.copies()
        assert len(failed) == 3
        m.complete_staging(failed)
        r = e.run(system, stage=False)
        assert r.num_reused_blocks == 0 and r.missed.fetch_failed == 3


def test_a_server_slower_than_the_timeout_is_a_miss(redis_server):
    with remote(redis_server, timeout_s=0.2) as store:
        store.write(-1, key(1), block(1))
        store.flush()
        redis_server.client().execute_command("CLIENT", "PAUSE", "1500", "ALL")  # every command waits 1.5 s
        started = time.monotonic()
        assert store.count_present([key(1)]) is None  # could not ask: not "absent"
        assert store.read([(-1, key(1), torch.empty(SHAPE.dims, dtype=SHAPE.dtype))]) == [False]
        assert time.monotonic() - started < 1.0  # one timeout, then the store rests (retry_after_s)
        assert store.counters.num_timeouts == 1


def test_a_full_server_refusing_writes_is_counted_and_its_blocks_missed(start_redis):
    server = start_redis(maxmemory="3mb", maxmemory_policy="noeviction")
    big = SHAPE.num_bytes * 256  # 256 KiB blocks: a dozen fill the server
    with RemoteStore(server.url, big, PLAN, timeout_s=0.5) as store:
        data = torch.zeros(big // 2, dtype=torch.bfloat16)
        for n in range(40):
            store.write(-1, key(n), data)
        store.flush()
        assert store.counters.num_write_failures > 0  # OOM command not allowed when used memory > 'maxmemory'
        stored = store.count_present([key(n) for n in range(40)])
        assert 0 < stored < 40
        out = torch.empty_like(data)
        assert store.read([(-1, key(39), out)]) == [False]


def test_bad_urls_are_refused_naming_the_url():
    with pytest.raises(RemoteStoreError, match="'http://x' is not a Redis URL"):
        RemoteStore("http://x", 8, PLAN)
