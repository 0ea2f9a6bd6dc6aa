"""The third KV tier through the LLM API, as a user turns it on (KvCacheConfig.disk_cache_dir /
remote_cache_url; --kv_disk_cache_dir / --kv_remote_cache): blocks pushed out of the host tier come
back from disk or a real redis-server, the greedy output is the same whatever tier served the
prompt, two models or tenants never read each other's blocks, and a server killed mid-run is a miss,
never a crash or a wrong token."""

from __future__ import annotations

import time

import pytest
from redis_servers import REDIS_SERVER, RedisServer

from kvtool import LLM, KvCacheConfig, SamplingParams
from kvtool.errors import KvtoolError

T = 16  # tokens per block
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = [(7 * i + 3) % 1000 for i in range(5 * T + 3)]  # 5 full blocks, then 3 tokens
FILLERS = [[(11 * i + 100 * k + 1) % 1000 for i in range(8 * T)] for k in range(1, 5)]
BLOCK_BYTES = 2 * 2 * T * 2 * 32 * 4  # tiny presets: 2 layers, K and V, 16 tokens, 2 KV heads of 32, float32

needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed (`make setup`)")


def make_llm(model: str = "preset:tiny-llama", *, host_blocks: int = 8, **tier) -> LLM:
    """16 primary blocks, a small host tier and the third tier asked for: four fillers push a prompt's
    blocks out of the primary and host tiers."""
    return LLM(model=model, max_batch_size=1, max_seq_len=256, kv_cache_config=KvCacheConfig(
        max_tokens=16 * T, tokens_per_block=T, host_cache_size=host_blocks * BLOCK_BYTES, **tier))


def push_out(llm: LLM) -> None:
    for filler in FILLERS:
        llm.generate(filler, GREEDY)


def served(llm: LLM, prompt=PROMPT, params=GREEDY) -> tuple[list[int], dict[str, int]]:
    """The prompt's greedy output, and the reused blocks each tier served for it."""
    before = llm.get_stats()
    output = llm.generate(prompt, params)
    assert output.error is None
    after = llm.get_stats()
    hits = {tier: after.get(f"{tier}_hit_blocks", 0) - before.get(f"{tier}_hit_blocks", 0)
            for tier in ("primary", "host", "disk", "remote")}
    return output.outputs[0].token_ids, {tier: n for tier, n in hits.items() if n}


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


@needs_redis
def test_greedy_outputs_are_identical_whatever_tier_served_the_prompt(tmp_path, redis_server):
    with make_llm() as llm:
        miss, hits = served(llm)  # computed in full
        assert hits == {}
        assert served(llm) == (miss, {"primary": 5})
    with make_llm(host_blocks=64) as llm:
        served(llm)
        push_out(llm)
        assert served(llm) == (miss, {"host": 5})
    for tier in ({"disk_cache_dir": str(tmp_path / "disk"), "disk_cache_size": 1 << 20},
                 {"remote_cache_url": redis_server.url}):
        with make_llm(**tier) as llm:
            served(llm)
            push_out(llm)
            name = "disk" if "disk_cache_dir" in tier else "remote"
            output, hits = served(llm)
            assert (output, hits) == (miss, {name: 5})
            stats = llm.get_stats()
            assert stats[f"{name}_out_bytes"] >= 5 * BLOCK_BYTES and stats["tier3_staged_blocks"] >= 5
            assert stats[f"{name}_evicted_blocks"] == 0 and stats["tier3_staging_s"] > 0


def test_the_disk_tier_starts_empty_after_a_restart(tmp_path):
    disk = {"disk_cache_dir": str(tmp_path / "disk"), "disk_cache_size": 1 << 20}
    with make_llm(**disk) as llm:
        served(llm)
        push_out(llm)
    with make_llm(**disk) as llm:  # the directory's lock was released, and its files emptied
        _, hits = served(llm)
        assert hits == {} and llm.get_stats()["tier3_staged_blocks"] == 0


@needs_redis
def test_remote_blocks_outlive_the_engine_that_stored_them(redis_server):
    with make_llm(remote_cache_url=redis_server.url) as llm:
        reference, _ = served(llm)
        push_out(llm)
    with make_llm(remote_cache_url=redis_server.url) as llm:
        assert served(llm) == (reference, {"remote": 5})
        assert llm.get_stats()["tier3_discovered_blocks"] == 5


@needs_redis
def test_two_models_or_tenants_never_read_each_others_blocks(redis_server):
    """tiny-qwen3 has tiny-llama's KV shapes and vocabulary, other weights: only the plan identity in
    the keys tells their blocks apart. A cache salt or a LoRA task does the same within one model."""
    tenant_a = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, cache_salt="tenant-a")
    with make_llm(remote_cache_url=redis_server.url) as llm:
        for params in (GREEDY, tenant_a):
            served(llm, params=params)
        push_out(llm)
    keys = redis_server.client().dbsize()
    assert keys >= 10
    with make_llm("preset:tiny-qwen3", remote_cache_url=redis_server.url) as other_model:
        output, hits = served(other_model)
        assert hits == {} and other_model.get_stats()["tier3_staged_blocks"] == 0
        assert output == served(make_llm("preset:tiny-qwen3"))[0]
    with make_llm(remote_cache_url=redis_server.url) as llm:
        tenant_b = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, cache_salt="tenant-b")
        lora = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, lora_task_id=7)
        assert served(llm, params=tenant_b)[1] == {}
        assert served(llm, params=lora)[1] == {}
        assert served(llm, params=tenant_a)[1] == {"remote": 5}


@needs_redis
def test_a_server_killed_mid_run_is_a_miss_not_a_crash(redis_server):
    with make_llm(remote_cache_url=redis_server.url) as llm:
        reference, _ = served(llm)
        push_out(llm)
        llm.engine.tier3.store.flush()
        redis_server.kill()
        output, hits = served(llm)  # its blocks were in the store: now computed again
        assert (output, hits) == (reference, {})
        push_out(llm)  # spills fail, counted
        stats = llm.get_stats()
        assert stats["tier3_lookup_failures"] + stats["tier3_read_failures"] >= 1
        assert stats["tier3_write_failures"] >= 1
        redis_server.start()  # back, empty: the engine asks it again once its rest is over
        time.sleep(llm.engine.tier3.store.retry_after_s)
        failures = llm.get_stats()["tier3_lookup_failures"]
        assert served(llm)[0] == reference
        assert llm.get_stats()["tier3_lookup_failures"] == failures


def test_a_bad_third_tier_is_refused_naming_its_flag(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(KvtoolError, match=r"^--kv_disk_cache_dir cannot use .*file/kv for the disk tier: Not a "
                                         "directory"):
        make_llm(disk_cache_dir=str(blocker / "kv"), disk_cache_size=1 << 20)
    with pytest.raises(KvtoolError, match=r"^--kv_disk_cache_bytes 4096 holds no KV block: a block takes 20480 "):
        make_llm(disk_cache_dir=str(tmp_path / "disk"), disk_cache_size=4096)
    with pytest.raises(KvtoolError, match=r"^--kv_remote_cache redis://127.0.0.1:1/0: no Redis server answers"):
        make_llm(remote_cache_url="redis://127.0.0.1:1/0")
    with make_llm(disk_cache_dir=str(tmp_path / "disk"), disk_cache_size=1 << 20):
        with pytest.raises(KvtoolError, match="holds the disk tier of another running engine"):
            make_llm(disk_cache_dir=str(tmp_path / "disk"), disk_cache_size=1 << 20)
