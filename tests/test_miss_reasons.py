"""Why a full prompt block was missed (docs/architecture.md#kv-cache-rules): one reason per missed
block, in hand-built scenarios where the reason is known, then through the scheduler and a bench run.

Every add_sequence here goes through `add`, which checks what holds for every request: the
reasons sum to the missed blocks (full prompt blocks less the shared ones), and the totals in
stats() are the sums of the requests'.
"""

from __future__ import annotations

import csv

import numpy as np
from reference_kv_cache import MISS_REASONS as REFERENCE_REASONS
from rich.console import Console
from step_limit import StepLimit
from typer.testing import CliRunner

from kvtool._core import CacheConfig, KVCacheManager, MissReasons, Scheduler, SchedulerConfig
from kvtool.workloads.datasets import write_jsonl
from kvtool.reports.metrics import CSV_COLUMNS, MISS_COLUMNS
from kvtool.reports.summary_table import _MISS_NAMES, summary_table
from kvtool.cli import app
from kvtool.runtime.request import MISS_REASONS

T = 4  # tokens per block


class Manager(KVCacheManager):
    """A KVCacheManager that also adds up the reasons its requests got (see `add`)."""

    def __init__(self, config):
        super().__init__(config)
        self.totals = dict.fromkeys(MISS_REASONS, 0)


def make(**kwargs):
    kwargs.setdefault("tokens_per_block", T)
    kwargs.setdefault("num_primary_blocks", 16)
    return Manager(CacheConfig(**kwargs))


def add(manager, seq_id, tokens, *, compute=True, release=True, **kwargs):
    """A request's context phase; returns its reasons as {reason: blocks}, zeros left out."""
    r = manager.add_sequence(seq_id, np.asarray(tokens, dtype=np.int32), len(tokens), **kwargs)
    reasons = r.missed.to_dict()
    assert list(reasons) == list(MISS_REASONS)
    assert r.missed.total == sum(reasons.values()) == len(tokens) // T - r.num_reused_blocks
    for reason, count in reasons.items():
        manager.totals[reason] += count
    stats = manager.stats()
    assert stats.missed.to_dict() == manager.totals
    assert stats.missed.total == stats.missed_blocks
    assert manager.check_invariants() == []
    if compute:
        manager.mark_computed(seq_id, len(tokens))
    if release:
        manager.release(seq_id)
    return {reason: count for reason, count in reasons.items() if count}


def prompt(start, n):
    return list(range(start, start + n))


# ---- one reason at a time ---------------------------------------------------------------------

def test_a_first_prompt_was_never_seen():
    m = make()
    assert add(m, 1, prompt(0, 3 * T + 1)) == {"never_seen": 3}
    # Keys chain: after a block never seen, every later block is new too, shared prefix or not.
    assert add(m, 2, prompt(0, T) + prompt(500, 2 * T + 1)) == {"never_seen": 2}


def test_blocks_dropped_from_the_primary_pool_without_a_host_tier_were_evicted_primary():
    m = make(num_primary_blocks=4)
    a = prompt(0, 2 * T + 1)
    add(m, 1, a)
    add(m, 2, prompt(50, 4 * T))  # needs every block: a's two cached blocks are dropped
    assert m.stats().evicted_blocks == 2
    assert add(m, 3, a) == {"evicted_primary": 2}


def test_blocks_below_the_offload_priority_are_dropped_so_evicted_primary():
    m = make(num_primary_blocks=4, num_secondary_blocks=8, secondary_offload_min_priority=50)
    a = prompt(0, 2 * T + 1)
    add(m, 1, a, priority=10)  # below 50: never offloaded
    add(m, 2, prompt(50, 4 * T), priority=60)
    assert (m.stats().offloaded_blocks, m.stats().evicted_blocks) == (0, 2)
    assert add(m, 3, a) == {"evicted_primary": 2}


def test_blocks_offloaded_then_dropped_from_the_host_tier_were_evicted_host():
    m = make(num_primary_blocks=3, num_secondary_blocks=2)
    a = prompt(0, 2 * T + 1)
    add(m, 1, a)
    add(m, 2, prompt(50, 3 * T))   # a's two blocks go to the host tier
    assert (m.stats().offloaded_blocks, m.stats().evicted_blocks) == (2, 0)
    add(m, 3, prompt(100, 3 * T))  # the host tier makes room for the next offloads: a's blocks are dropped
    assert m.match_prefix(a).num_matched_blocks == 0
    assert add(m, 4, a) == {"evicted_host": 2}


def test_a_block_dropped_from_primary_takes_its_host_children_along_each_counted_by_its_pool():
    m = make(num_primary_blocks=3, num_secondary_blocks=4, secondary_offload_min_priority=50)
    a = prompt(0, 2 * T + 1)
    add(m, 1, a[:T + 1], priority=10)  # a's first block, of a priority that is never offloaded
    add(m, 2, a, priority=60)          # shares it and computes a's second block, which may be offloaded
    # Three new blocks: the free one, a's second block (the leaf; offloaded), then a's first block
    # (now a leaf of the primary pool; dropped, and its host child with it).
    add(m, 3, prompt(50, 3 * T))
    assert (m.stats().offloaded_blocks, m.stats().evicted_blocks) == (1, 2)
    assert add(m, 4, a) == {"evicted_primary": 1, "evicted_host": 1}


def test_the_same_tokens_under_another_identity_were_missed_for_identity():
    tokens = prompt(0, 3 * T + 1)
    for stored, asked in [(dict(cache_salt=1), dict(cache_salt=2)), (dict(cache_salt=1), {}),
                          ({}, dict(cache_salt=1)), (dict(lora_task_id=3), dict(lora_task_id=4)),
                          ({}, dict(lora_task_id=3)), (dict(extra_ids=[7] * len(tokens)), {}),
                          ({}, dict(extra_ids=[7] * len(tokens)))]:
        m = make()
        add(m, 1, tokens, **stored)
        assert add(m, 2, tokens, **asked) == {"identity": 3}, (stored, asked)


def test_identity_covers_the_shared_tokens_only():
    m = make()
    add(m, 1, prompt(0, 2 * T + 1), cache_salt=1)
    assert add(m, 2, prompt(0, 2 * T) + prompt(500, T + 1), cache_salt=2) == {"identity": 2, "never_seen": 1}


def test_extra_ids_in_a_later_block_leave_the_earlier_blocks_plain():
    m = make()
    tokens = prompt(0, 3 * T + 1)
    extras = [0] * (2 * T) + [9] * (T + 1)  # only the third block has extra ids
    add(m, 1, tokens, extra_ids=extras)
    r = add(m, 2, tokens)  # the first two blocks are the same keys: shared
    assert r == {"identity": 1}


def test_the_block_that_got_a_partial_copy_was_partial():
    m = make()
    add(m, 1, prompt(0, 2 * T + 1))
    b = prompt(0, T) + [T, T + 1, 99, 98] + prompt(300, T + 1)  # block 1 shares its first 2 tokens
    r = m.match_prefix(b)
    assert (r.num_matched_blocks, r.num_partial_tokens) == (1, 2)
    assert add(m, 2, b) == {"partial": 1, "never_seen": 1}


def test_a_prompt_of_whole_blocks_repeated_misses_its_last_block_for_the_last_token():
    for partial in (True, False):
        m = make(enable_partial_reuse=partial)
        tokens = prompt(0, 3 * T)
        assert add(m, 1, tokens) == {"never_seen": 3}
        # Cached in full, but it holds the last token, which is always computed; a partial copy
        # may take its first tokens: the reason is still the last token.
        assert add(m, 2, tokens) == {"last_token": 1}, partial


def test_with_reuse_off_every_block_is_missed_for_reuse_off():
    m = make(enable_block_reuse=False)
    tokens = prompt(0, 3 * T + 1)
    assert add(m, 1, tokens) == {"reuse_off": 3}
    assert add(m, 2, tokens) == {"reuse_off": 3}


def test_a_prompt_shorter_than_a_block_misses_nothing():
    m = make()
    assert add(m, 1, prompt(0, T - 1)) == {}
    assert m.stats().missed == MissReasons()


# ---- when and how long ------------------------------------------------------------------------

def test_reasons_describe_the_cache_before_the_request_evicts_anything():
    m = make(num_primary_blocks=2)
    tokens = prompt(0, 2 * T)
    add(m, 1, tokens)
    # Sharing block 0 and computing block 1 takes the only other block: the cached copy of block 1,
    # which is dropped by this very request. It was cached when the request came: last_token.
    assert add(m, 2, tokens) == {"last_token": 1}
    assert m.stats().evicted_blocks == 1


def test_a_request_with_several_reasons():
    m = make(num_primary_blocks=4)
    a = prompt(0, 2 * T + 1)
    add(m, 1, a)
    add(m, 2, prompt(50, 4 * T))  # drops a's blocks
    add(m, 3, prompt(0, 2 * T) + prompt(200, T + 1), cache_salt=5)  # a's tokens again, under a salt
    # a's first two blocks: their keys were dropped (that wins over the salted copy stored since); a new block.
    assert add(m, 4, a[:2 * T] + prompt(700, T + 1)) == {"evicted_primary": 2, "never_seen": 1}


def test_the_history_is_bounded_a_long_forgotten_drop_reads_never_seen():
    # 2 primary blocks: the key history remembers a dropped key for at least 2 x 2 later drops.
    def after_drops(num_later_requests):
        m = make(num_primary_blocks=2)
        a = prompt(0, T + 1)
        add(m, 1, a)
        for k in range(num_later_requests):  # each drops the block the request before it stored
            add(m, 10 + k, prompt(1000 * (k + 1), T + 1))
        return add(m, 99, a)

    assert after_drops(1 + 4) == {"evicted_primary": 1}
    assert after_drops(1 + 40) == {"never_seen": 1}


def test_reset_stats_zeroes_the_totals_but_keeps_the_history():
    m = make(num_primary_blocks=4)
    a = prompt(0, 2 * T + 1)
    add(m, 1, a)
    add(m, 2, prompt(50, 4 * T))
    m.reset_stats()
    m.totals = dict.fromkeys(MISS_REASONS, 0)
    assert m.stats().missed == MissReasons() and m.stats().missed_blocks == 0
    assert add(m, 3, a) == {"evicted_primary": 2}
    assert m.stats().to_dict()["missed_evicted_primary_blocks"] == 2


def test_stats_dict_has_every_reason_as_missed_reason_blocks():
    d = make().stats().to_dict()
    assert [k for k in d if k.startswith("missed_") and k != "missed_blocks"] == [
        f"missed_{reason}_blocks" for reason in MISS_REASONS]
    assert list(MissReasons().to_dict()) == list(MISS_REASONS)


# ---- the scheduler, and a bench run -----------------------------------------------------------

def test_request_stats_keep_the_reasons_of_the_first_admission():
    scheduler = Scheduler(CacheConfig(tokens_per_block=T, num_primary_blocks=32),
                          SchedulerConfig(max_batch_size=1, max_num_tokens=64, max_seq_len=64))
    tokens = prompt(0, 3 * T)

    def run(request_id, **kwargs):
        scheduler.add_request(request_id, tokens, 1, **kwargs)
        limit = StepLimit(10, f"request {request_id} (3 blocks, 1 new token) running alone")
        while scheduler.has_unfinished_requests():
            limit.step()
            batch = scheduler.schedule()
            sampling = [r.request_id for r in batch.requests if r.samples]
            scheduler.complete_step(sampling, [0] * len(sampling))
        return scheduler.request_stats(request_id).missed.to_dict()

    assert run(1)["never_seen"] == 3
    assert run(2)["last_token"] == 1
    assert run(3, cache_salt=9)["identity"] == 3
    assert scheduler.cache_manager.stats().missed.to_dict() == {**dict.fromkeys(MISS_REASONS, 0), "never_seen": 3,
                                                               "last_token": 1, "identity": 3}


def test_python_and_report_names_follow_the_cores_reasons():
    assert list(MissReasons().to_dict()) == list(MISS_REASONS) == list(REFERENCE_REASONS) == list(_MISS_NAMES)
    assert MISS_COLUMNS == ("missed_blocks", *(f"missed_{reason}_blocks" for reason in MISS_REASONS))
    assert set(MISS_COLUMNS) <= set(CSV_COLUMNS)


def test_a_bench_run_reports_the_reasons_per_request_and_in_the_summary(tmp_path, tiny_llama_plan):
    prefix = list(range(300, 348))  # 3 blocks of 16
    data = write_jsonl(tmp_path / "reasons.jsonl", [
        {"input_ids": prefix + [20] * 5, "output_tokens": 2},                        # 3 never seen
        {"input_ids": prefix + [21] * 5, "output_tokens": 2},                        # 3 shared
        {"input_ids": prefix + [22] * 5, "output_tokens": 2, "cache_salt": "user-b"},  # 3 other identity
        {"input_ids": prefix, "output_tokens": 2},                                   # 2 shared, 1 last token
    ])
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["bench", "--plan", str(tiny_llama_plan), "--dataset", str(data), "--output",
                                      str(out), "--mode", "sequential", "--max_tokens_in_paged_kv_cache", "1024",
                                      "--tokens_per_block", "16"])
    assert result.exit_code == 0, result.output
    with open(out / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    columns = ["missed_blocks", "missed_never_seen_blocks", "missed_identity_blocks", "missed_last_token_blocks"]
    assert [[int(row[c]) for c in columns] for row in rows] == [[3, 3, 0, 0], [0, 0, 0, 0], [3, 0, 3, 0],
                                                                 [1, 0, 0, 1]]
    for row in rows:
        assert int(row["missed_blocks"]) == sum(int(row[c]) for c in MISS_COLUMNS[1:])
    with open(out / "summary.csv", newline="") as f:
        summary, = csv.DictReader(f)
    assert {c: int(summary[c]) for c in MISS_COLUMNS} == {
        "missed_blocks": 7, "missed_never_seen_blocks": 3, "missed_evicted_primary_blocks": 0,
        "missed_evicted_host_blocks": 0, "missed_identity_blocks": 3, "missed_partial_blocks": 0,
        "missed_last_token_blocks": 1, "missed_reuse_off_blocks": 0}
    console = Console(width=200, record=True)
    console.print(summary_table([{c: int(summary[c]) for c in MISS_COLUMNS}]))
    text = console.export_text()
    assert "missed blocks by reason" in text and "3 new, 3 other identity, 1 last token" in text
