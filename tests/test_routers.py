"""The fleet's routers (kvtool/fleet/routers.py): which replica each request goes to, from the router's own
record of what it sent where and what finished. prefix_aware is checked by hand on small cases and,
on random request streams, against a reference that scores replicas from the plain token lists sent."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.config import SamplingParams
from kvtool.fleet.prefix_record import PrefixRecord, block_keys
from kvtool.fleet.routers import LeastLoaded, PrefixAware, RoundRobin, RouterOptions, make_router
from kvtool.runtime.request import Request

B = 4  # tokens per block in these cases


def request(tokens, max_tokens=4, output=None, salt=None):
    r = Request(list(tokens), SamplingParams(max_tokens=max_tokens, cache_salt=salt))
    if output is not None:
        r.output_token_ids = list(output)
    return r


def test_round_robin_sends_requests_in_turn():
    router = RoundRobin(3, block_size=B)
    assert [router.route(request([1, 2])) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_sends_to_the_fewest_in_flight_and_equal_ones_take_turns():
    router = LeastLoaded(3, block_size=B)
    a, b, c = request([1]), request([2]), request([3])
    assert [router.route(a), router.route(b), router.route(c)] == [0, 1, 2]  # all idle: in turn
    router.finish(b)
    assert router.route(request([4])) == 1  # the only one with nothing in flight
    router.finish(a)
    router.finish(c)
    # 0 and 2 are idle, 1 holds one: the turn starts after the last chosen (1), so 2, then 0.
    assert router.route(request([5])) == 2
    assert router.route(request([6])) == 0
    assert router.num_in_flight == [1, 1, 1]


def test_a_sequential_replay_through_least_loaded_spreads_over_the_fleet():
    router = LeastLoaded(3, block_size=B)
    chosen = []
    for i in range(6):
        r = request([i])
        chosen.append(router.route(r))
        router.finish(r)
    assert chosen == [0, 1, 2, 0, 1, 2]


def test_prefix_aware_sends_a_prompt_where_its_prefix_was_sent():
    router = PrefixAware(3, block_size=B, capacity_tokens=[None] * 3)
    system = list(range(100, 112))  # 3 blocks
    first = request(system + [1, 2, 3, 4])
    assert router.route(first) == 0  # nothing cached anywhere: in turn
    router.finish(first)
    other = request([9] * 16)
    assert router.route(other) == 1
    router.finish(other)
    # The next shares 3 blocks with what went to replica 0: prefill 2 blocks there, 5 elsewhere.
    follower = request(system + [5, 6, 7, 8, 9, 10, 11, 12])
    assert router.costs(follower) == [2.0, 5.0, 5.0]
    assert router.route(follower) == 0


def test_prefix_aware_cost_is_the_prefill_blocks_plus_the_blocks_in_flight():
    router = PrefixAware(2, block_size=B, capacity_tokens=[None, None])
    system = list(range(100, 120))  # 5 blocks
    busy = request(system + [1, 2], max_tokens=6)  # in flight on 0 to the end: 22 + 6 tokens = 7 blocks
    assert router.route(busy) == 0
    assert router.active_blocks == [7, 0]
    prompt = system + [3, 4, 5, 6]  # 6 blocks, the first 5 sent to replica 0
    # 1 to prefill + 7 in flight on replica 0, 6 + 0 on the idle one: the load outweighs the prefix.
    assert router.costs(request(prompt)) == [8.0, 6.0]
    assert router.route(request([9] * 8, max_tokens=4)) == 1  # 2 + 7 against 2 + 0; 3 blocks in flight
    assert router.active_blocks == [7, 3]
    # Now 1 + 7 against 6 + 3: the prefix wins.
    assert router.costs(request(prompt)) == [8.0, 9.0]
    assert router.route(request(prompt)) == 0


def test_an_answer_is_recorded_so_that_the_next_turn_follows_it():
    router = PrefixAware(2, block_size=B, capacity_tokens=[None, None])
    turn0 = request([1, 2, 3, 4, 5, 6], output=[7, 8, 9, 10, 11])
    assert router.route(turn0) == 0
    router.finish(turn0)  # the KV of prompt + answer but its last token: 10 tokens, 2 full blocks
    assert len(router.records[0]) == 2
    turn1 = request([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert router.costs(turn1) == [2.0, 4.0]
    assert router.route(turn1) == 0


def test_the_cache_salt_separates_equal_prompts():
    assert block_keys([1, 2, 3, 4], B, "a") != block_keys([1, 2, 3, 4], B, "b")
    assert block_keys((1, 2, 3, 4, 5), B) == block_keys([1, 2, 3, 4, 6], B)  # the partial block is not a block


def test_the_record_forgets_the_least_recently_sent_blocks_beyond_its_capacity():
    record = PrefixRecord(4)
    a, b = block_keys(list(range(12)), B), block_keys(list(range(100, 108)), B)  # 3 and 2 blocks
    record.add(a)
    record.add(b)  # 5 blocks: a's first (least recently sent) goes
    assert len(record) == 4
    assert record.num_matched(a) == 0  # a prefix is matched from its first block
    assert record.num_matched(b) == 2
    record.add(a[:1])  # back, and the least recently sent (a's second) goes
    assert record.num_matched(a) == 1 and record.num_matched(b) == 2


def test_the_records_hold_what_the_replicas_kv_cache_holds():
    router = make_router(RouterOptions("prefix_aware"), 2, block_size=16, capacity_tokens=[1024, 1024])
    assert [record.capacity for record in router.records] == [64, 64]
    router = make_router(RouterOptions("prefix_aware", block_size=32), 2, block_size=16, capacity_tokens=[1024, None])
    assert router.block_size == 32 and [record.capacity for record in router.records] == [32, None]


@pytest.mark.parametrize("name, problem", [("fastest", "--router 'fastest' is unknown: use one of round_robin"),
                                           ("round_robin", None)])
def test_an_unknown_router_is_a_one_line_error_naming_the_flag(name, problem):
    if problem is None:
        RouterOptions(name)
        return
    with pytest.raises(ValueError, match=problem):
        RouterOptions(name)
    with pytest.raises(ValueError, match="--router_block_size must be a positive"):
        RouterOptions("prefix_aware", block_size=0)


# -- prefix_aware against a reference of plain token lists --------------------------------------------

def reference_choice(sent: list[list[list[int]]], in_flight: list[list[tuple[list[int], int]]], prompt: list[int],
                     max_tokens: int, last: int) -> int:
    """The replica of least cost: prompt blocks past the longest run of whole blocks some sequence sent to
    it shares with the prompt from the start, plus the blocks (prompt + output) of its requests in flight;
    ties to the first after ``last``."""
    def shared_blocks(a, b):
        n = 0
        while (n + 1) * B <= min(len(a), len(b)) and a[n * B:(n + 1) * B] == b[n * B:(n + 1) * B]:
            n += 1
        return n

    num_blocks = -(-len(prompt) // B)
    costs = []
    for replica, sequences in enumerate(sent):
        matched = max((shared_blocks(prompt, s) for s in sequences), default=0)
        active = sum(-(-(len(p) + m) // B) for p, m in in_flight[replica])
        costs.append(num_blocks - matched + active)
    n = len(sent)
    return next(r % n for r in range(last + 1, last + 1 + n) if costs[r % n] == min(costs))


tokens = st.lists(st.integers(1, 3), min_size=1, max_size=14)  # few symbols: prefixes are often shared


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(tokens, st.integers(1, 6), st.booleans()), min_size=1, max_size=25))
def test_prefix_aware_chooses_as_a_reference_over_token_lists(num_replicas, stream):
    router = PrefixAware(num_replicas, block_size=B, capacity_tokens=[None] * num_replicas)
    sent: list[list[list[int]]] = [[] for _ in range(num_replicas)]
    in_flight: list[list] = [[] for _ in range(num_replicas)]
    waiting: list[tuple[int, Request]] = []
    last = -1
    for prompt, max_tokens, finish_one in stream:
        expected = reference_choice(sent, in_flight, prompt, max_tokens, last)
        r = request(prompt, max_tokens=max_tokens, output=[5] * max_tokens)
        assert router.route(r) == expected
        last = expected
        sent[expected].append(prompt)
        in_flight[expected].append((prompt, max_tokens))
        waiting.append((expected, r))
        if finish_one:  # the oldest in flight finishes; its answer (5s) is cached with its prompt
            replica, done = waiting.pop(0)
            router.finish(done)
            in_flight[replica].remove((list(done.prompt_token_ids), done.sampling_params.max_tokens))
            sent[replica].append(list(done.prompt_token_ids) + done.output_token_ids[:-1])
