"""The disk tier's data plane (kvtool/runtime/disk_store.py): blocks spilled from the host tier to
preallocated files come back bit for bit, a value that is not the block asked for is a miss, and a
file of an earlier run is never read."""

from __future__ import annotations

import os

import pytest
import torch
from tier3_engine import PLAN, SHAPE, T, TieredEngine, prompt

from kvtool.runtime.disk_store import LOCK_FILE, PAGE_BYTES, DiskStore, DiskStoreError
from kvtool.runtime.tier3_store import HEADER_BYTES, plan_digest


def block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE.dims, generator=torch.Generator().manual_seed(seed)).to(SHAPE.dtype)


def key(n: int) -> bytes:
    return n.to_bytes(32, "little")


@pytest.fixture(params=[True, False], ids=["writer_thread", "synchronous"])
def store(request, tmp_path):
    with DiskStore(tmp_path / "tier3", 16, SHAPE.num_bytes, PLAN, writer_thread=request.param) as s:
        yield s


def test_evicted_blocks_spill_to_disk_and_come_back_identical(store):
    e = TieredEngine(store, num_secondary_blocks=3)  # staging three blocks takes three host blocks
    system = prompt(0, 3 * T + 1)
    e.run(system)
    e.fill(1000)
    assert e.manager.match_prefix(system).num_matched_blocks == 0
    r = e.run(system)  # every position is checked against the KV it was computed with
    assert (r.num_reused_blocks, r.missed.total) == (3, 0)
    assert store.counters.num_reads == 3 and store.counters.num_read_failures == 0
    assert e.manager.stats().tier3_traffic.staged_blocks == 3


def test_a_block_read_before_its_write_reached_the_file_comes_from_the_queue(tmp_path):
    with DiskStore(tmp_path, 4, SHAPE.num_bytes, PLAN) as store:
        data = block(1)
        store.write(2, key(1), data)
        out = torch.empty_like(data)
        assert store.read([(2, key(1), out)]) == [True]  # whether or not the writer got to it
        assert torch.equal(out, data)
        store.flush()
        out.zero_()
        assert store.read([(2, key(1), out)]) == [True] and torch.equal(out, data)


def test_adjacent_slots_read_in_one_batch_land_where_asked(store):
    blocks = {slot: block(slot) for slot in range(6)}
    for slot, data in blocks.items():
        store.write(slot, key(slot), data)
    store.flush()
    outs = {slot: torch.empty_like(blocks[slot]) for slot in (5, 0, 1, 2, 4)}
    assert store.read([(slot, key(slot), out) for slot, out in outs.items()]) == [True] * 5
    assert all(torch.equal(out, blocks[slot]) for slot, out in outs.items())


@pytest.mark.parametrize("asked", ["another key", "another plan", "another slot"])
def test_a_slot_that_is_not_the_block_asked_for_is_a_miss(tmp_path, asked):
    other_plan = plan_digest(weights_digest="sha256:another-model", kv_dtype=SHAPE.dtype, tokens_per_block=T,
                             num_layers=2, num_kv_heads=2, head_dim=8)
    with DiskStore(tmp_path, 4, SHAPE.num_bytes, PLAN) as store:
        store.write(1, key(1), block(1))
        store.flush()
        reader = store if asked != "another plan" else None
        out = torch.zeros(SHAPE.dims, dtype=SHAPE.dtype)
        if asked == "another key":
            assert store.read([(1, key(2), out)]) == [False]
        elif asked == "another slot":
            assert store.read([(3, key(1), out)]) == [False]  # never written: all zero
        else:
            store.plan_digest, reader = other_plan, store
            assert reader.read([(1, key(1), out)]) == [False]
        assert not out.any()  # nothing was copied into the host block
        assert store.counters.num_read_failures == 1


def test_a_file_of_an_earlier_run_is_never_read(tmp_path):
    with DiskStore(tmp_path, 4, SHAPE.num_bytes, PLAN) as store:
        store.write(0, key(7), block(7))
    with DiskStore(tmp_path, 4, SHAPE.num_bytes, PLAN) as store:  # a restart: the files are emptied
        out = torch.zeros(SHAPE.dims, dtype=SHAPE.dtype)
        assert store.count_present([key(7)]) == 0
        assert store.read([(0, key(7), out)]) == [False]
        assert not out.any()


def test_a_read_error_is_a_miss_not_an_exception(tmp_path):
    with DiskStore(tmp_path, 4, SHAPE.num_bytes, PLAN, direct_io=False) as store:
        store.write(0, key(1), block(1))
        store.flush()
        os.truncate(tmp_path / "kv-tier3-0000.bin", 0)  # the slot's bytes are gone under the store
        assert store.read([(0, key(1), torch.empty(SHAPE.dims, dtype=SHAPE.dtype))]) == [False]


def test_slots_are_page_aligned_in_preallocated_files(tmp_path):
    with DiskStore(tmp_path, 10, SHAPE.num_bytes, PLAN, file_bytes=4 * 4096) as store:
        assert store.slot_bytes % PAGE_BYTES == 0 and store.slot_bytes >= HEADER_BYTES + SHAPE.num_bytes
        files = sorted(p for p in tmp_path.iterdir() if p.name != LOCK_FILE)
        assert [p.stat().st_size for p in files] == [4 * store.slot_bytes] * 2 + [2 * store.slot_bytes]
        data = block(9)
        store.write(9, key(9), data)  # the last slot, in the third file
        store.flush()
        out = torch.empty_like(data)
        assert store.read([(9, key(9), out)]) == [True] and torch.equal(out, data)


def test_one_directory_serves_one_engine(tmp_path):
    with DiskStore(tmp_path, 4, SHAPE.num_bytes, PLAN):
        with pytest.raises(DiskStoreError, match="another running engine"):
            DiskStore(tmp_path, 4, SHAPE.num_bytes, PLAN)
    DiskStore(tmp_path, 4, SHAPE.num_bytes, PLAN).close()  # free again once closed


def test_count_present_counts_the_leading_keys_on_disk(store):
    for n in (0, 1, 3):
        store.write(n, key(n), block(n))
    assert store.count_present([key(0), key(1), key(2), key(3)]) == 2
