"""KV pool sizes: TensorRT-LLM's rule for the primary pool (max_tokens, the memory fraction, the smaller
of the two), the host pool as a limit, and what the LLM reports it created."""

from __future__ import annotations

import pytest

from kvtool import LLM, KvCacheConfig
from kvtool.errors import KvtoolError
from kvtool.runtime import pool_sizes
from kvtool.runtime.pool_sizes import CPU_PRIMARY_POOL_CAP_BYTES, size_pools

MiB, GiB = 1 << 20, 1 << 30


def sizes(*, max_tokens=None, fraction=0.9, free=64 * GiB, host=0, on_cpu=True, available=64 * GiB,
          workload=None, block_bytes=MiB, tokens_per_block=16):
    return size_pools(block_bytes, tokens_per_block, max_tokens=max_tokens, free_memory_fraction=fraction,
                      free_memory_bytes=free, host_cache_size=host, on_cpu=on_cpu, available_host_bytes=available,
                      num_workload_blocks=workload)


def test_an_explicit_max_tokens_is_honoured_on_a_cpu_beyond_the_default_cap():
    asked = 4 * CPU_PRIMARY_POOL_CAP_BYTES // MiB * 16  # four times the cap, in tokens
    result = sizes(max_tokens=asked)
    assert result.num_primary_blocks * 16 == asked and result.notes == ()


def test_without_max_tokens_a_cpu_pool_is_capped_and_says_so():
    result = sizes()
    assert result.num_primary_blocks * MiB == CPU_PRIMARY_POOL_CAP_BYTES
    assert "capped at 256.0 MiB" in result.notes[0] and "--max_tokens_in_paged_kv_cache" in result.notes[0]
    assert sizes(on_cpu=False, free=10 * GiB).num_primary_blocks == int(0.9 * 10 * GiB) // MiB  # a GPU: no cap


def test_the_pool_is_the_smaller_of_max_tokens_and_the_fraction_budget():
    assert sizes(max_tokens=160, on_cpu=False, free=1 << 40).num_primary_blocks == 10
    # 90 blocks asked, half of 100 MiB free allows 50: the pool has 50 and a note says why.
    clipped = sizes(max_tokens=90 * 16, fraction=0.5, free=100 * MiB, on_cpu=False)
    assert clipped.num_primary_blocks == 50
    assert "the smaller of the two" in clipped.notes[0] and "800 tokens" in clipped.notes[0]


def test_a_max_tokens_no_memory_could_hold_names_the_flag_and_both_sizes():
    with pytest.raises(KvtoolError) as error:
        sizes(max_tokens=10_000_000_000, free=24 * GiB)
    message = str(error.value)
    assert "--max_tokens_in_paged_kv_cache" in message and f"{625_000_000 * MiB:,} bytes" in message
    assert f"{24 * GiB:,} bytes" in message and "choose at most 393,216 tokens" in message


def test_a_block_larger_than_the_cpu_cap_names_the_cap_and_the_flag_that_lifts_it():
    # 1 GiB blocks: the available memory would hold 18 of them, the 256 MiB cap none.
    with pytest.raises(KvtoolError) as error:
        sizes(block_bytes=GiB, tokens_per_block=256, free=20 * GiB)
    message = str(error.value)
    assert "one block of 256 tokens takes 1,073,741,824 bytes (1.0 GiB), more than the 256.0 MiB a CPU primary " \
           "pool is capped at without --max_tokens_in_paged_kv_cache" in message
    assert "give --max_tokens_in_paged_kv_cache 256 or more (up to 4,608 tokens fit" in message
    assert "--tokens_per_block" in message and "budget is" not in message
    lifted = sizes(block_bytes=GiB, tokens_per_block=256, free=20 * GiB, max_tokens=512)
    assert lifted.num_primary_blocks == 2


def test_a_fraction_too_small_for_one_block_names_the_flag_not_the_field():
    with pytest.raises(KvtoolError) as error:
        sizes(fraction=1e-6, free=GiB, on_cpu=False)
    message = str(error.value)
    assert "one block of 16 tokens takes 1,048,576 bytes (1.0 MiB) but the budget is 1,073 bytes (1.0 KiB): " \
           "--kv_cache_free_gpu_mem_fraction 1e-06 of the 1,073,741,824 bytes (1.0 GiB) of free device " \
           "memory" in message
    assert "free_gpu_memory_fraction=" not in message and "max_tokens=" not in message


def test_a_host_cache_smaller_than_one_block_is_an_error():
    with pytest.raises(KvtoolError, match=r"--kv_host_cache_bytes of 1,000 bytes is smaller than one KV block of 16 "
                                          r"tokens, 1,048,576 bytes \(1.0 MiB\): give at least"):
        sizes(max_tokens=160, host=1000)
    assert sizes(max_tokens=160, host=0).num_secondary_blocks == 0


def test_a_host_cache_beyond_memory_is_a_limit_the_workload_may_never_reach():
    available = 24 * GiB
    with pytest.raises(KvtoolError,
                       match=rf"exceeds the {available - 10 * MiB:,} bytes \([\d.]+ GiB\) of host memory available"):
        sizes(max_tokens=160, host=45_000_000_000, available=available)  # no workload known: refused
    fits = sizes(max_tokens=160, host=45_000_000_000, available=available, workload=300)
    assert fits.num_secondary_blocks == 45_000_000_000 // MiB
    assert "it is a limit" in fits.notes[0] and "at most 300 blocks (300.0 MiB)" in fits.notes[0]
    too_much = 30 * GiB // MiB
    with pytest.raises(KvtoolError) as error:
        sizes(max_tokens=160, host=45_000_000_000, available=available, workload=too_much)
    assert (f"can fill {30 * GiB:,} bytes (30.0 GiB) of it, {6 * GiB + 10 * MiB:,} bytes (6.0 GiB) more than "
            "available") in str(error.value)


def test_on_a_cpu_the_host_pool_shares_memory_with_the_primary_pool():
    # 100 MiB available: a 60 MiB primary pool leaves 40 MiB for host blocks.
    assert sizes(max_tokens=60 * 16, host=40 * MiB, available=100 * MiB, free=100 * MiB).num_secondary_blocks == 40
    with pytest.raises(KvtoolError, match=f"exceeds the {40 * MiB:,} bytes"):
        sizes(max_tokens=60 * 16, host=41 * MiB, available=100 * MiB, free=100 * MiB)


def test_the_llm_reports_the_pools_it_created(monkeypatch):
    monkeypatch.setattr(pool_sizes, "CPU_PRIMARY_POOL_CAP_BYTES", 64 << 10)  # a cap an explicit size exceeds
    llm = LLM(model="preset:tiny-llama", max_seq_len=256,
              kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=16, host_cache_size=1 << 20))
    created = llm.pool_sizes
    assert created.num_primary_blocks * 16 == 4096 == llm.engine.executor.pools.num_primary_blocks * 16
    assert created.as_row() == {"kv_primary_blocks": 256, "kv_primary_tokens": 4096, "kv_primary_bytes": 4 << 20,
                                "kv_host_blocks": 64, "kv_host_tokens": 1024, "kv_host_bytes": 1 << 20}
    assert created.describe("cpu") == ("KV cache: primary 256 blocks x 16 tokens = 4,096 tokens (4.0 MiB, cpu); "
                                       "host 64 blocks = 1,024 tokens (1.0 MiB, allocated as blocks are offloaded)")
