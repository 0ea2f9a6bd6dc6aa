"""Retention by token range (TensorRT-LLM's KvCacheRetentionConfig; docs/architecture.md#kv-cache-rules):
a request's (start, end, priority, duration) ranges decide which blocks are evicted first and which
tier keeps what; a priority reverts to 35 once its duration has run out on the manager's clock."""

import hashlib

import pytest

from kvtool._core import CacheConfig, KVCacheManager, PoolKind, RetentionRange, Scheduler, SchedulerConfig

T = 4  # tokens per block


def make(**kwargs):
    kwargs.setdefault("tokens_per_block", T)
    kwargs.setdefault("num_primary_blocks", 8)
    return KVCacheManager(CacheConfig(**kwargs))


def prompt(start, n):
    return list(range(start, start + n))


def run(m, seq_id, tokens, **kwargs):
    r = m.add_sequence(seq_id, tokens, len(tokens), **kwargs)
    m.mark_computed(seq_id, len(tokens))
    m.release(seq_id)
    assert m.check_invariants() == []
    return r


def cached_blocks(m, tokens):
    return m.match_prefix(tokens).num_matched_blocks


SYSTEM = prompt(0, 2 * T)  # a system prompt of two blocks
KEEP_SYSTEM = [(0, 2 * T, 90, 30_000)]  # priority 90 for 30 s


def ranges(spec):
    """RetentionRange objects, made per test (module-level ones would outlive the extension)."""
    return [RetentionRange(*fields) for fields in spec]


def push_out(m, first_id, count):
    """Requests of new tokens, each filling most of the primary pool: older blocks must go."""
    for k in range(first_id, first_id + count):
        run(m, k, prompt(5000 + 100 * k, 4 * T + 1))


def conversation(system, k):
    return system + prompt(1000 + 100 * k, 2 * T + 1)


def test_system_prompt_range_survives_the_conversations_blocks():
    m = make()
    run(m, 0, conversation(SYSTEM, 0), retention=ranges(KEEP_SYSTEM))
    push_out(m, 1, 3)
    assert cached_blocks(m, SYSTEM + [1]) == 2
    assert cached_blocks(m, conversation(SYSTEM, 0)) == 2  # its own blocks (priority 35) went first


def test_without_a_range_the_system_prompt_is_evicted_least_recently_used_first():
    m = make()
    run(m, 0, conversation(SYSTEM, 0))
    push_out(m, 1, 3)
    assert cached_blocks(m, SYSTEM + [1]) == 0


def test_priority_reverts_to_the_default_once_its_duration_ran_out():
    m = make()
    run(m, 0, conversation(SYSTEM, 0), retention=ranges(KEEP_SYSTEM))
    m.set_time(29_999)
    run(m, 1, prompt(5000, 4 * T + 1))
    assert cached_blocks(m, SYSTEM + [1]) == 2
    m.set_time(30_000)  # 30 s after its release: back to 35, and the least recently used now
    push_out(m, 2, 2)
    assert cached_blocks(m, SYSTEM + [1]) == 0


def test_duration_counts_from_the_last_release_and_stops_while_referenced():
    m = make()
    run(m, 0, conversation(SYSTEM, 0), retention=ranges(KEEP_SYSTEM))
    m.set_time(20_000)
    m.add_sequence(1, conversation(SYSTEM, 1), 4 * T + 1)  # reused (no range of its own): its clock stops
    m.set_time(40_000)
    m.mark_computed(1, 4 * T + 1)
    m.release(1)  # released at 40 s: priority 90 until 70 s
    m.set_time(69_999)
    push_out(m, 2, 2)
    assert cached_blocks(m, SYSTEM + [1]) == 2


def test_range_of_a_reusing_request_raises_a_shared_blocks_priority():
    m = make()
    run(m, 0, conversation(SYSTEM, 0))  # computed at 35
    run(m, 1, conversation(SYSTEM, 1), retention=ranges(KEEP_SYSTEM))  # reuses the system prompt at 90
    push_out(m, 2, 3)
    assert cached_blocks(m, SYSTEM + [1]) == 2


def test_reusing_request_without_a_range_keeps_a_blocks_priority():
    m = make()
    run(m, 0, conversation(SYSTEM, 0), retention=ranges(KEEP_SYSTEM))
    run(m, 1, conversation(SYSTEM, 1))  # no range: the system prompt stays at 90
    push_out(m, 2, 3)
    assert cached_blocks(m, SYSTEM + [1]) == 2


def test_a_block_takes_the_range_holding_its_first_token():
    m = make(num_primary_blocks=4)
    first_token_outside, first_token_inside = prompt(0, T + 1), prompt(500, T + 1)
    run(m, 0, first_token_outside, retention=[RetentionRange(2, None, 90)])  # tokens 2.. : block 0 stays 35
    run(m, 1, first_token_inside, retention=[RetentionRange(0, 2, 90)])  # tokens 0..1: block 0 is 90
    run(m, 2, prompt(900, 3 * T))  # needs 3 of 4 blocks: one of the two cached blocks goes
    assert cached_blocks(m, first_token_outside) == 0
    assert cached_blocks(m, first_token_inside) == 1


def test_blocks_outside_every_range_take_the_requests_priority():
    m = make(num_primary_blocks=6)
    run(m, 0, prompt(0, 2 * T + 1), priority=10, retention=[RetentionRange(100, None, 90)])
    run(m, 1, prompt(500, 2 * T + 1), priority=35)
    run(m, 2, prompt(900, 4 * T), priority=35)  # evicts two blocks: the priority-10 ones
    assert cached_blocks(m, prompt(0, 2 * T + 1)) == 0
    assert cached_blocks(m, prompt(500, 2 * T + 1)) == 2


def test_a_range_whose_priority_expired_in_the_host_tier_is_dropped_not_spilled():
    """Which tier keeps what: a block reaches the host tier at 60, reverts to 35 there, and is then
    below secondary_offload_min_priority=50, so it is dropped instead of spilled to disk."""
    m = make(num_primary_blocks=4, num_secondary_blocks=2, num_tier3_blocks=8, tier3_pool=PoolKind.DISK,
             secondary_offload_min_priority=50)
    kept = [RetentionRange(0, None, 60, 1_000)]
    run(m, 0, prompt(0, 2 * T + 1), retention=kept)  # released at 0: 60 until 1 s
    m.set_time(500)
    run(m, 1, prompt(500, 4 * T), retention=kept)  # pushes the first prompt into the host tier
    assert m.match_prefix(prompt(0, 2 * T + 1)).num_secondary_blocks == 2
    m.set_time(1_000)  # the first prompt's blocks revert to 35 in the host tier
    run(m, 2, prompt(900, 4 * T), retention=kept)  # offloads the second one's: the host tier makes room
    assert m.tier3_lookup(prompt(0, 2 * T + 1)).num_known_blocks == 0
    assert m.stats().tier(PoolKind.SECONDARY).evicted_blocks == 2


def test_clock_never_goes_back():
    m = make()
    m.set_time(10)
    assert m.time() == 10
    with pytest.raises(ValueError, match="never goes back"):
        m.set_time(9)


@pytest.mark.parametrize("spec, message", [
    ([(4, 4, 90)], "token_end must be past token_start"),
    ([(-1, 4, 90)], "token_start is negative"),
    ([(0, 4, 101)], "outside 0..100"),
    ([(0, 4, 90, 0)], "duration_ms=0 must be positive"),
    ([(0, 8, 90), (4, 12, 10)], "range 1 .*overlaps"),
    ([(0, None, 90), (8, 12, 10)], "overlaps"),
])
def test_bad_ranges_are_refused_naming_the_range(spec, message):
    m = make()
    with pytest.raises(ValueError, match=message):
        m.add_sequence(0, prompt(0, 9), 9, retention=ranges(spec))
    assert not m.has_sequence(0)


def test_scheduler_refuses_a_bad_range_when_the_request_is_added():
    s = Scheduler(CacheConfig(tokens_per_block=T, num_primary_blocks=8), SchedulerConfig())
    with pytest.raises(ValueError, match=r"request 7: retention range 1 .*overlaps"):
        s.add_request(7, prompt(0, 9), 1, retention=[RetentionRange(0, 8, 90), RetentionRange(4, 12, 10)])


def test_scheduler_passes_the_ranges_to_the_cache_manager():
    s = Scheduler(CacheConfig(tokens_per_block=T, num_primary_blocks=8), SchedulerConfig(max_batch_size=1))
    requests = [(conversation(SYSTEM, 0), KEEP_SYSTEM)] + [(prompt(5000 + 100 * k, 4 * T + 1), []) for k in range(3)]
    for k, (tokens, spec) in enumerate(requests):
        s.add_request(k, tokens, 1, retention=ranges(spec))
        while s.has_unfinished_requests():
            batch = s.schedule()
            s.complete_step([r.request_id for r in batch.requests if r.samples],
                            [1] * sum(r.samples for r in batch.requests))
    assert s.cache_manager.match_prefix(SYSTEM + [1]).num_matched_blocks == 2


def test_retention_range_reads_like_tensorrt_llms():
    r = RetentionRange(0, None, 90)
    assert (r.token_start, r.token_end, r.priority, r.duration_ms) == (0, None, 90, None)
    assert repr(RetentionRange(0, 8, 90, 30_000)) == \
        "RetentionRange(token_start=0, token_end=8, priority=90, duration_ms=30000)"


def test_plan_digest_is_kept_in_the_config():
    digest = hashlib.sha256(b"p").digest()
    config = CacheConfig(tokens_per_block=T, num_primary_blocks=4, plan_digest=digest)
    assert config.plan_digest == digest
