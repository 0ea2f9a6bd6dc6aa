"""A simulated fleet: N SimulatedLLMs (each its own engine, KV pools and host cache, assembled by
assemble_engine) behind a router, on one simulated clock, replayed by the bench's Replayer like any target.

The replicas' steps and the replay's arrivals are events in time order (a discrete-event simulation):
a replica starts a step when it has work, runs it at once through ``Engine.step`` (the batch is what its
scheduler holds at the step's start) and is busy until the step's end, which the cost model sets.
What finished in the step is released at that end, before arrivals due at the same moment, as a single
simulated engine's replay sees it. A request routed to a busy replica waits for its current step to end,
as it would on a server; one routed to an idle replica starts a step at its arrival. The router is asked
at the arrival time, and sees in flight exactly the requests not released by then.

The replay (kvtool.bench.replay.Replayer) calls ``advance(due)``, as it calls a single engine's: run events
before ``due``, the next request's arrival, and return once requests finish (or when ``due`` comes, with
none). Steps that finish nothing never return to the replay.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from kvtool.fleet.routers import Router
from kvtool.runtime.request import Request
from kvtool.simulate.executor import SimulatedClock
from kvtool.simulate.simulated_llm import SimulatedLLM

_RELEASE, _START = 0, 1  # at one moment: finished requests first, then arrivals (the replay's), then step starts


class FleetEngine:
    """The TargetEngine of a simulated fleet (kvtool.bench.target): requests go to the replica the router
    chooses; ``advance`` runs the replicas in time order (see the module docstring)."""

    def __init__(self, replicas: Sequence[SimulatedLLM], router: Router, clock: SimulatedClock) -> None:
        self.replicas = list(replicas)
        # The replay keys requests in flight by request_id, which each engine numbers from 0: the replicas
        # number theirs in turn (replica r: r, r + N, r + 2N, ...), so that ids are unique in the fleet.
        for replica, llm in enumerate(self.replicas):
            llm.engine._request_ids = itertools.count(replica, len(self.replicas))
        self.router = router
        self.clock = clock
        # (time, _RELEASE or _START, replica): each replica with work has exactly one event.
        self._events: list[tuple[float, int, int]] = []
        self._scheduled = [False] * len(self.replicas)
        self._released: list[list[Request]] = [[] for _ in self.replicas]  # finished, to release at the event
        self.busy_seconds = [0.0] * len(self.replicas)
        self.num_steps = [0] * len(self.replicas)
        # Told of every finished request as it is released: an SLO search's early stop, which raises to end
        # the run (kvtool.fleet.slo_early_stop). None: nothing is.
        self.early_stop = None

    def request_problem(self, request: Request) -> str | None:
        return self.replicas[0].engine.request_problem(request)  # the replicas are configured alike

    def add_request(self, request: Request) -> None:
        """Routes the request at the fleet's current time and queues it on its replica (ValueError when
        that replica's engine refuses it; the router then forgets it)."""
        replica = self.router.route(request)
        try:
            self.replicas[replica].engine.add_request(request)
        except ValueError:
            self.router.finish(request)
            raise
        request.replica = replica
        if not self._scheduled[replica]:  # idle until now: its next step starts at this arrival
            self._schedule(self.clock.seconds, _START, replica)

    def has_unfinished_requests(self) -> bool:
        return bool(self._events)

    def step(self) -> list[Request]:
        return self.step_until(None)

    def step_until(self, until: float | None) -> list[Request]:
        """Runs the fleet's events before ``until`` (None: no arrival is waiting) until some release
        finished requests, which it returns, with the clock at their finish; or, when none finish
        before ``until``, returns none with the clock at ``until``."""
        events, clock = self._events, self.clock
        while events:
            moment, kind, replica = events[0]
            if until is not None and (moment > until or (moment == until and kind == _START)):
                break
            heapq.heappop(events)
            clock.seconds = max(clock.seconds, moment)
            if kind == _START:
                self._run_step(replica, moment)
                continue
            finished = self._release(replica)
            while events and events[0][0] == moment and events[0][1] == _RELEASE:  # every release of this moment
                finished += self._release(heapq.heappop(events)[2])
            return finished
        if until is not None:
            clock.seconds = max(clock.seconds, until)
        return []

    def _run_step(self, replica: int, start: float) -> None:
        self._scheduled[replica] = False
        llm = self.replicas[replica]
        llm.clock.seconds = start  # an idle replica's clock catches up with the fleet's
        stepped = llm.engine.step()
        end = llm.clock.seconds
        self.busy_seconds[replica] += end - start
        self.num_steps[replica] += 1
        finished = [request for request in stepped if request.finished]
        if finished:
            self._released[replica] = finished
            self._schedule(end, _RELEASE, replica)
        elif llm.engine.has_unfinished_requests():
            self._schedule(end, _START, replica)

    def _release(self, replica: int) -> list[Request]:
        self._scheduled[replica] = False
        finished, self._released[replica] = self._released[replica], []
        for request in finished:
            self.router.finish(request)
        if self.early_stop is not None:
            for request in finished:
                self.early_stop.finished(request)
        if self.replicas[replica].engine.has_unfinished_requests():
            self._schedule(self.clock.seconds, _START, replica)
        return finished

    def _schedule(self, moment: float, kind: int, replica: int) -> None:
        self._scheduled[replica] = True
        heapq.heappush(self._events, (moment, kind, replica))

    # -- cache counters -----------------------------------------------------------------------
    def replica_stats(self, replica: int) -> dict[str, int | float]:
        return self.replicas[replica].engine.get_stats()

    def get_stats(self) -> dict[str, int | float]:
        """Every replica's counters summed (the pools' block counts too: the fleet's); the hit rate of the sums."""
        return sum_stats([self.replica_stats(r) for r in range(len(self.replicas))])

    def reset_stats(self) -> None:
        for llm in self.replicas:
            llm.engine.reset_stats()
        if self.early_stop is not None:
            self.early_stop.reset()


def sum_stats(stats: Sequence[dict[str, int | float | None]]) -> dict[str, int | float | None]:
    """Replicas' cache counters as the fleet's: each summed (None where a replica does not say), and
    cache_hit_rate = reused / (reused + missed) of the sums."""
    total: dict[str, int | float | None] = {}
    for key in stats[0]:
        values = [s.get(key) for s in stats]
        total[key] = None if any(v is None for v in values) else sum(values)
    reused, missed = total.get("reused_blocks"), total.get("missed_blocks")
    if "cache_hit_rate" in total and reused is not None and missed is not None:
        total["cache_hit_rate"] = reused / (reused + missed) if reused + missed else 0.0
    return total


class SimulatedFleet:
    """A bench target (kvtool.bench.target.Target) of ``replicas`` behind ``router``: what each report row
    says of one replica (plan, configuration, pools per replica, device, cost profile), with the fleet's
    size and router."""

    endpoint = None

    def __init__(self, replicas: Sequence[SimulatedLLM], router: Router) -> None:
        first = replicas[0]
        self.replicas = list(replicas)
        self.router = router
        self.plan, self.config, self.tokenizer, self.pool_sizes = first.plan, first.config, first.tokenizer, first.pool_sizes
        self.clock = SimulatedClock()  # the fleet's: the moment of its last event
        self.engine = FleetEngine(self.replicas, router, self.clock)
        self.device_description = first.device_description
        self.engine_name = first.engine_name
        self.report_columns = {**first.report_columns, "num_replicas": len(self.replicas), "router": router.name}

    def describe(self) -> str:
        return f"{len(self.replicas)} replicas routed by {self.router.name}, each {self.replicas[0].describe()}"

    def shutdown(self) -> None:
        for llm in self.replicas:
            llm.shutdown()
