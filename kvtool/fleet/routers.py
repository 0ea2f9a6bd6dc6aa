"""Routers: which replica of a fleet serves a request, decided when it arrives, from the router's own
record of what it sent where and what finished. The same routers drive simulated replicas
(kvtool.fleet.simulated_fleet) and real servers (`kvtool bench --endpoint URL --endpoint URL`), so a
simulation routes a replay exactly as the servers' replay is routed when the record evolves alike.

- ``round_robin``: replica 0, 1, ..., N-1, 0, ... in arrival order.
- ``least_loaded``: the fewest requests in flight (sent and not finished), SGLang's shortest queue.
- ``prefix_aware``: Dynamo's KV router cost, in blocks, with its approximation of the caches from its
  own routing decisions (its mode without KV events, as SGLang's router keeps an approximate tree):
  ``cost = overlap_weight * prefill blocks + active blocks``, the least wins. Prefill blocks are the
  prompt's blocks the replica would compute (its blocks past the longest prefix the router's record of
  that replica holds, kvtool.fleet.prefix_record); active blocks the blocks its requests in flight hold
  when they end (prompt + output tokens). Both terms count blocks of work, so the rule needs no
  threshold: a cached prefix draws a request until the replica holds that many more blocks of work than
  another (SGLang's router instead switches between cache affinity and shortest queue at two balance
  thresholds, and to the smallest tree below a match ratio). The record holds as many blocks as the
  replica's KV cache (primary and host pools), forgetting the least recently sent first.

Ties (equal cost, or every replica alike for round_robin) go to the first replica at or after the one
after the last chosen, so equal replicas take turns: a sequential replay through least_loaded spreads
over the fleet instead of always choosing replica 0. Nothing is random: a replay routed twice with the
same finishes in the same order is routed alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtool.fleet.prefix_record import PrefixRecord, block_keys
from kvtool.runtime.request import Request

ROUTERS = ("round_robin", "least_loaded", "prefix_aware")
DEFAULT_OVERLAP_WEIGHT = 1.0  # Dynamo's default kv-overlap-score-weight: a prefill block weighs one active block


@dataclass(frozen=True)
class RouterOptions:
    """How a fleet routes (the flags --router and --router_block_size). ``block_size``: tokens per block of
    prefix_aware's record (None: the replicas' block size where it is known)."""

    name: str = "round_robin"
    block_size: int | None = None
    overlap_weight: float = DEFAULT_OVERLAP_WEIGHT

    def __post_init__(self) -> None:
        if self.name not in ROUTERS:
            raise ValueError(f"--router {self.name!r} is unknown: use one of {', '.join(ROUTERS)}")
        if self.block_size is not None and (isinstance(self.block_size, bool) or self.block_size < 1):
            raise ValueError(f"--router_block_size must be a positive number of tokens, got {self.block_size!r}")
        if not self.overlap_weight >= 0:
            raise ValueError(f"the overlap weight must be >= 0, got {self.overlap_weight}")


class _InFlight:
    """One request the router sent: where, the blocks it holds at its end, the prompt it was routed by."""

    __slots__ = ("replica", "num_blocks", "prompt_token_ids")

    def __init__(self, replica: int, num_blocks: int, prompt_token_ids: Sequence[int]) -> None:
        self.replica = replica
        self.num_blocks = num_blocks
        self.prompt_token_ids = prompt_token_ids


class Router:
    """Chooses a replica per request (``route``) and is told when each ends (``finish``); subclasses
    give the cost of each replica for a request (``costs``), the least wins."""

    name = ""

    def __init__(self, num_replicas: int, *, block_size: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.num_in_flight = [0] * num_replicas  # requests sent and not finished
        self.active_blocks = [0] * num_replicas  # the blocks those requests hold when they end
        self.num_routed = [0] * num_replicas
        self._next = 0  # ties go to the first replica at or after this one
        self._sent: dict[int, _InFlight] = {}  # id(request) -> where it went

    def route(self, request: Request) -> int:
        """The replica that serves ``request``, recorded as in flight there until ``finish``."""
        costs = self.costs(request)
        replica = self._least(costs)
        prompt = request.prompt_token_ids
        num_blocks = -(-(len(prompt) + request.sampling_params.max_tokens) // self.block_size)
        self._sent[id(request)] = _InFlight(replica, num_blocks, prompt)
        self.num_in_flight[replica] += 1
        self.active_blocks[replica] += num_blocks
        self.num_routed[replica] += 1
        self._next = (replica + 1) % self.num_replicas
        self.sent(replica, request)
        return replica

    def finish(self, request: Request) -> None:
        """``request`` ended (finished, failed or aborted): it no longer loads its replica."""
        sent = self._sent.pop(id(request), None)
        if sent is None:
            return
        self.num_in_flight[sent.replica] -= 1
        self.active_blocks[sent.replica] -= sent.num_blocks
        self.finished(sent, request)

    def costs(self, request: Request) -> list[float]:
        return [0.0] * self.num_replicas

    def sent(self, replica: int, request: Request) -> None:
        """Called once ``request`` is routed to ``replica``."""

    def finished(self, sent: _InFlight, request: Request) -> None:
        """Called once ``request``, sent as ``sent`` says, ended."""

    def _least(self, costs: Sequence[float]) -> int:
        best = min(costs)
        n = self.num_replicas
        return next(r % n for r in range(self._next, self._next + n) if costs[r % n] == best)


class RoundRobin(Router):
    name = "round_robin"


class LeastLoaded(Router):
    name = "least_loaded"

    def costs(self, request: Request) -> list[float]:
        return list(self.num_in_flight)


class PrefixAware(Router):
    name = "prefix_aware"

    def __init__(self, num_replicas: int, *, block_size: int, capacity_tokens: Sequence[int | None],
                 overlap_weight: float = DEFAULT_OVERLAP_WEIGHT) -> None:
        super().__init__(num_replicas, block_size=block_size)
        if len(capacity_tokens) != num_replicas:
            raise ValueError(f"{len(capacity_tokens)} capacities for {num_replicas} replicas")
        self.overlap_weight = overlap_weight
        self.records = [PrefixRecord(None if tokens is None else max(1, tokens // block_size))
                        for tokens in capacity_tokens]
        self._keys: list[int] = []  # the blocks of the request being routed

    def costs(self, request: Request) -> list[float]:
        prompt = request.prompt_token_ids
        self._keys = keys = block_keys(prompt, self.block_size, request.sampling_params.cache_salt)
        num_blocks = -(-len(prompt) // self.block_size)
        weight = self.overlap_weight
        return [weight * (num_blocks - record.num_matched(keys)) + active
                for record, active in zip(self.records, self.active_blocks)]

    def sent(self, replica: int, request: Request) -> None:
        self.records[replica].add(self._keys)

    def finished(self, sent: _InFlight, request: Request) -> None:
        # The answer's KV is cached too (all but its last token's): a session's next turn, which resends
        # it, finds it there. An answer whose token ids a server did not send (-1) is not recorded.
        output = request.output_token_ids
        if request.error is not None or not output or min(output) < 0:
            return
        sequence = [*sent.prompt_token_ids, *output[:-1]]
        self.records[sent.replica].add(block_keys(sequence, self.block_size, request.sampling_params.cache_salt))


def make_router(options: RouterOptions, num_replicas: int, *, block_size: int,
                capacity_tokens: Sequence[int | None] | None = None) -> Router:
    """The router ``options`` names over ``num_replicas`` replicas; ``block_size``: the replicas' block
    size (options.block_size overrides it); ``capacity_tokens``: the tokens each replica's KV cache holds
    (None: unknown, the record is not bounded)."""
    size = options.block_size or block_size
    if options.name == "round_robin":
        return RoundRobin(num_replicas, block_size=size)
    if options.name == "least_loaded":
        return LeastLoaded(num_replicas, block_size=size)
    return PrefixAware(num_replicas, block_size=size, overlap_weight=options.overlap_weight,
                       capacity_tokens=list(capacity_tokens) if capacity_tokens is not None else [None] * num_replicas)
