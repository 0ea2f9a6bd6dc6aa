"""Configuration: the API dataclasses hold every default and rule; the C++ runtime and the bench flags agree."""

from __future__ import annotations

import pytest

from kvtool import _core
from kvtool.config import (CapacitySchedulerPolicy, ContextChunkingPolicy, EngineConfig, KvCacheConfig,
                           ReplayOptions, SamplingParams, SchedulerConfig)
from kvtool.flags import CONFIG_FLAGS, as_row, configs
from kvtool.plan.build_options import DEFAULT_MAX_SEQ_LEN_CAP, BuildOptions


def test_the_cpp_cache_config_defaults_are_the_python_ones():
    core, kv, build = _core.CacheConfig(), KvCacheConfig(), BuildOptions()
    assert (core.enable_block_reuse, core.enable_partial_reuse, core.secondary_offload_min_priority,
            core.event_buffer_max_size, core.max_attention_window or None, core.tokens_per_block) == (
        kv.enable_block_reuse, kv.enable_partial_reuse, kv.secondary_offload_min_priority,
        kv.event_buffer_max_size, kv.max_attention_window, build.tokens_per_block)
    assert SamplingParams().priority == kv.secondary_offload_min_priority  # default blocks are offloaded


def test_the_cpp_scheduler_config_defaults_are_the_python_ones():
    core, scheduler, build = _core.SchedulerConfig(), SchedulerConfig(), BuildOptions()
    assert (core.capacity_scheduler_policy, core.context_chunking_policy, core.enable_chunked_context) == (
        scheduler.capacity_scheduler_policy, scheduler.context_chunking_policy, scheduler.enable_chunked_context)
    assert (core.max_batch_size, core.max_num_tokens, core.max_seq_len) == (
        build.max_batch_size, build.max_num_tokens, DEFAULT_MAX_SEQ_LEN_CAP)


def test_to_core_hands_every_field_and_the_enums_as_they_are():
    kv = KvCacheConfig(enable_block_reuse=False, enable_partial_reuse=False, secondary_offload_min_priority=60,
                       event_buffer_max_size=7)
    core = kv.to_core(tokens_per_block=16, num_primary_blocks=10, num_secondary_blocks=3, max_attention_window=None)
    assert (core.tokens_per_block, core.num_primary_blocks, core.num_secondary_blocks, core.enable_block_reuse,
            core.enable_partial_reuse, core.secondary_offload_min_priority, core.max_attention_window,
            core.event_buffer_max_size) == (16, 10, 3, False, False, 60, 0, 7)
    scheduler = SchedulerConfig("max_utilization", "Equal-Progress", enable_chunked_context=True)
    core = scheduler.to_core(max_batch_size=2, max_num_tokens=64, max_seq_len=128)
    assert core.capacity_scheduler_policy is _core.CapacitySchedulerPolicy.MAX_UTILIZATION
    assert core.context_chunking_policy is _core.ContextChunkingPolicy.EQUAL_PROGRESS
    assert (core.enable_chunked_context, core.max_batch_size, core.max_num_tokens, core.max_seq_len) == (
        True, 2, 64, 128)


@pytest.mark.parametrize("make", [lambda: KvCacheConfig(tokens_per_block=48), lambda: BuildOptions(tokens_per_block=48),
                                  lambda: EngineConfig(tokens_per_block=48),
                                  lambda: configs({"tokens_per_block": 48})])
def test_one_power_of_two_rule_for_every_block_size(make):
    with pytest.raises(ValueError, match="tokens_per_block must be a power of 2 .* got 48"):
        make()


def test_every_flag_sets_its_field():
    values = {"enable_kv_cache_reuse": False, "kv_host_cache_bytes": "2KiB", "kv_disk_cache_dir": "/var/kv",
              "kv_disk_cache_bytes": "1GiB", "max_tokens_in_paged_kv_cache": 512,
              "kv_cache_free_gpu_mem_fraction": 0.5, "max_attention_window_size": 64,
              "scheduler_policy": "static_batch", "context_chunking_policy": "equal_progress",
              "enable_chunked_context": True, "max_batch_size": 3, "max_num_tokens": 100, "max_seq_len": 200,
              "enforce_eager": True, "tokens_per_block": 8, "mode": "offline", "concurrency": 2,
              "request_rate": 4.0, "seed": 9, "warmup": 1, "warmup_counts_in_stats": True, "num_requests": 5,
              "time_scale": 1.0, "cpu_kernels_isa": "avx2", "temperature": 0.7, "top_p": 0.9,
              "top_k": 40, "burstiness": 0.5}  # (other time scales contradict request_rate:
    # tests/test_trace_replay.py)
    # The remote tier's flags exclude the disk tier's: test_the_remote_tier_flag_sets_its_url.
    assert set(values) | {"kv_remote_cache", "kv_remote_cache_bytes"} == {flag.name for flag in CONFIG_FLAGS}
    engine, replay = configs(values)
    assert engine == EngineConfig(
        kv_cache_config=KvCacheConfig(enable_block_reuse=False, host_cache_size=2048, max_tokens=512,
                                      free_gpu_memory_fraction=0.5, max_attention_window=64,
                                      disk_cache_dir="/var/kv", disk_cache_size=1 << 30),
        scheduler_config=SchedulerConfig(CapacitySchedulerPolicy.STATIC_BATCH, ContextChunkingPolicy.EQUAL_PROGRESS,
                                         enable_chunked_context=True),
        max_batch_size=3, max_num_tokens=100, max_seq_len=200, tokens_per_block=8, enforce_eager=True,
        cpu_kernels_isa="avx2")
    assert replay == ReplayOptions(concurrency=2, request_rate=4.0, seed=9, warmup=1, warmup_counts_in_stats=True,
                                   num_requests=5, temperature=0.7, top_p=0.9, top_k=40, burstiness=0.5)
    # The summary columns keep the flags' names (and spellings), so older reports still compare.
    row = as_row(engine, replay)
    assert row == {**{name: value for name, value in values.items() if name not in (
        "kv_host_cache_bytes", "kv_disk_cache_bytes", "num_requests")}, "kv_host_cache_bytes": 2048,
        "kv_disk_cache_bytes": 1 << 30, "kv_remote_cache": None, "kv_remote_cache_bytes": 0, "num_requests_limit": 5}


def test_the_cpu_kernels_isa_takes_the_known_names_and_yaml_off():
    assert configs({"cpu_kernels_isa": False})[0].cpu_kernels_isa == "off"  # a scenario's `cpu_kernels_isa: off`
    for isa in ("auto", "off", "avx512_bf16", "avx512", "avx2", "generic"):
        assert EngineConfig(cpu_kernels_isa=isa).cpu_kernels_isa == isa
    with pytest.raises(ValueError, match=r"--cpu_kernels_isa 'sse2' is unknown: use auto, off or one of"):
        configs({"cpu_kernels_isa": "sse2"})


def test_the_remote_tier_flag_sets_its_url():
    engine, _ = configs({"kv_host_cache_bytes": "1GiB", "kv_remote_cache": "redis://cache:6379/2"})
    kv = engine.kv_cache_config
    assert (kv.remote_cache_url, kv.disk_cache_dir, kv.has_third_tier) == ("redis://cache:6379/2", None, True)
    core = kv.to_core(tokens_per_block=16, num_primary_blocks=4, num_secondary_blocks=2, max_attention_window=None,
                      num_tier3_blocks=100, plan_digest=b"p" * 32)
    assert (core.num_tier3_blocks, core.tier3_pool, core.plan_digest) == (100, _core.PoolKind.REMOTE, b"p" * 32)
    assert as_row(engine, ReplayOptions())["kv_remote_cache"] == "redis://cache:6379/2"


def test_a_simulated_third_tier_is_given_by_its_size_alone():
    """`kvtool simulate` models a disk tier from --kv_disk_cache_bytes and a shared store from
    --kv_remote_cache_bytes: neither needs a directory or a URL."""
    for flags, pool in (({"kv_disk_cache_bytes": "2TiB"}, _core.PoolKind.DISK),
                        ({"kv_remote_cache_bytes": "8TiB"}, _core.PoolKind.REMOTE)):
        engine, _ = configs({"kv_host_cache_bytes": "1GiB", **flags})
        kv = engine.kv_cache_config
        assert kv.has_third_tier and (kv.disk_cache_dir, kv.remote_cache_url) == (None, None)
        core = kv.to_core(tokens_per_block=16, num_primary_blocks=4, num_secondary_blocks=2,
                          max_attention_window=None, num_tier3_blocks=100)
        assert core.tier3_pool == pool


def test_enforce_eager_turns_the_llms_cuda_graphs_off():
    assert EngineConfig().cuda_graphs is True
    engine, _ = configs({"enforce_eager": True})
    assert engine.cuda_graphs is False


def test_the_llm_apis_block_size_is_the_engines_build_option():
    """KvCacheConfig(tokens_per_block=...) (TensorRT-LLM's spelling) is taken over by EngineConfig, where the
    plan is checked against it and a model built on the fly gets it."""
    config = EngineConfig(kv_cache_config=KvCacheConfig(tokens_per_block=16))
    assert config.tokens_per_block == 16 and config.kv_cache_config.tokens_per_block is None
    assert EngineConfig(kv_cache_config=KvCacheConfig(tokens_per_block=16), tokens_per_block=16) == config
    with pytest.raises(ValueError, match=r"^EngineConfig\.tokens_per_block 32 and KvCacheConfig.tokens_per_block 16 "
                                         "disagree"):
        EngineConfig(kv_cache_config=KvCacheConfig(tokens_per_block=16), tokens_per_block=32)


@pytest.mark.parametrize("flags, message", [
    ({"enforce_eager": "yes please"}, "--enforce_eager must be true or false, got 'yes please'"),
    ({"max_tokens_in_paged_kv_cache": 0}, "--max_tokens_in_paged_kv_cache must be positive, got 0"),
    ({"kv_cache_free_gpu_mem_fraction": 1.5}, "--kv_cache_free_gpu_mem_fraction must be in (0, 1], got 1.5"),
    ({"scheduler_policy": "fast"}, "--scheduler_policy 'fast' is unknown: use one of guaranteed_no_evict|"
                                   "max_utilization|static_batch"),
    ({"max_batch_size": 0}, "--max_batch_size must be a positive integer, got 0"),
    ({"warmup": -1}, "--warmup must be >= 0 requests, got -1"),
    ({"kv_host_cache_bytes": "lots"}, "--kv_host_cache_bytes: byte size 'lots' is not understood"),
    ({"concurency": 2}, "--concurency is not a bench flag"),
    ({"kv_host_cache_bytes": "1GiB", "kv_remote_cache": "http://cache:6379"},
     "--kv_remote_cache 'http://cache:6379' is not a Redis URL: use redis://host:port"),
    ({"kv_host_cache_bytes": "1GiB", "kv_disk_cache_dir": "/var/kv"},
     "--kv_disk_cache_bytes must be given with the disk cache's directory"),
    ({"kv_remote_cache_bytes": "-1"}, "--kv_remote_cache_bytes: must be >= 0 bytes, got -1"),
    ({"kv_host_cache_bytes": "1GiB", "kv_disk_cache_bytes": "4GiB", "kv_remote_cache_bytes": "1TiB"},
     "--kv_remote_cache_bytes and the disk cache are both given"),
    ({"kv_remote_cache_bytes": "1TiB"}, "--kv_remote_cache_bytes needs a host cache, which blocks pass through"),
    ({"kv_host_cache_bytes": "1GiB", "kv_disk_cache_dir": "/var/kv", "kv_disk_cache_bytes": "lots"},
     "--kv_disk_cache_bytes: byte size 'lots' is not understood"),
    ({"kv_host_cache_bytes": "1GiB", "kv_disk_cache_dir": "/var/kv", "kv_disk_cache_bytes": "4GiB",
      "kv_remote_cache": "redis://cache:6379"}, "--kv_remote_cache and the disk cache are both given"),
    ({"kv_disk_cache_dir": "/var/kv", "kv_disk_cache_bytes": "4GiB"},
     "--kv_disk_cache_dir needs a host cache, which blocks pass through"),
])
def test_a_bad_flag_value_names_the_flag(flags, message):
    with pytest.raises(ValueError) as error:
        configs(flags)
    assert str(error.value).startswith(message)


def test_the_api_names_the_field():
    with pytest.raises(ValueError, match=r"^KvCacheConfig\.max_tokens must be positive, got 0"):
        KvCacheConfig(max_tokens=0)
    with pytest.raises(ValueError, match=r"^SchedulerConfig\.capacity_scheduler_policy 'fast' is unknown"):
        SchedulerConfig(capacity_scheduler_policy="fast")
