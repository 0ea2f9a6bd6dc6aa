"""`kvtool bench --endpoint URL --endpoint URL ... --router NAME`: several OpenAI-compatible servers behind
one of kvtool's routers (kvtool.fleet.routers), replayed like one target.

Each server is an EndpointLLM (kvtool.bench.endpoint); they share one queue of finished calls, one
numbering of requests and one text history (a session's turns may go to different servers), so the
fleet's ``step`` waits on that queue as one server's does. A request is routed when the replay hands it
over, at its arrival, by the same router code a simulated fleet uses; the router is told of each finish
when the replay collects it. prefix_aware's record of a kvtool serve holds as many tokens as its primary
and host pools (read from its /metrics at the start, with its block size), as a simulated replica's does;
another server's cache size is not known here, so its record is not bounded: it guesses that the server
still caches all it was sent.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtool.bench.endpoint import EndpointLLM, EndpointOptions
from kvtool.fleet.routers import Router, RouterOptions, make_router
from kvtool.fleet.simulated_fleet import sum_stats
from kvtool.runtime.request import Request

DEFAULT_BLOCK_SIZE = 32  # servers that do not say theirs (not kvtool serve): give --router_block_size for them


class EndpointFleetEngine:
    """A TargetEngine (kvtool.bench.target) over several servers: ``add_request`` routes, ``step`` returns
    the requests any server finished."""

    def __init__(self, servers: Sequence[EndpointLLM], router: Router) -> None:
        self.servers = list(servers)
        self.router = router

    def request_problem(self, request: Request) -> str | None:
        return self.servers[0].engine.request_problem(request)  # one API and model for all

    def add_request(self, request: Request) -> None:
        replica = self.router.route(request)
        try:
            self.servers[replica].engine.add_request(request)
        except ValueError:
            self.router.finish(request)
            raise
        request.replica = replica

    def has_unfinished_requests(self) -> bool:
        return any(server.engine.has_unfinished_requests() for server in self.servers)

    def step(self) -> list[Request]:
        finished = self.servers[0].engine.step()  # the shared queue: every server's finished calls
        for request in finished:
            self.router.finish(request)
        return finished

    def replica_stats(self, replica: int) -> dict:
        return self.servers[replica].engine.get_stats()

    def get_stats(self) -> dict:
        """Every server's counters summed (kvtool serve's; none for other servers)."""
        stats = [self.replica_stats(r) for r in range(len(self.servers))]
        return sum_stats(stats) if any(stats) else {}

    def reset_stats(self) -> None:
        for server in self.servers:
            server.engine.reset_stats()


class EndpointFleet:
    """A bench target of several servers serving one model behind a router (the first server's model and
    API name the run)."""

    config = None
    plan = None
    pool_sizes = None

    def __init__(self, options: Sequence[EndpointOptions], router: RouterOptions, *, timed: bool) -> None:
        servers: list[EndpointLLM] = []
        try:
            for one in options:
                servers.append(EndpointLLM(one, timed=timed, fleet=servers[0] if servers else None))
        except BaseException:
            for server in servers:
                server.shutdown()
            raise
        models = {server.served_model for server in servers}
        if len(models) > 1:
            for server in servers:
                server.shutdown()
            raise ValueError(f"--endpoint: the servers serve different models ({', '.join(sorted(models))}): a fleet "
                             "serves one; give --served_model NAME or endpoints of one model")
        first = servers[0]
        self.servers = servers
        sizes = [server.engine.cache_size() for server in servers]
        block_sizes = {size.tokens_per_block for size in sizes if size is not None}
        block_size = block_sizes.pop() if len(block_sizes) == 1 else DEFAULT_BLOCK_SIZE
        self.router = make_router(router, len(servers), block_size=block_size,
                                  capacity_tokens=[None if size is None else size.capacity_tokens for size in sizes])
        self.engine = EndpointFleetEngine(servers, self.router)
        self.served_model = first.served_model
        self.tokenizer, self.clock = first.tokenizer, first.clock
        self.endpoint = ", ".join(server.endpoint for server in servers)
        self.engine_name = first.engine_name
        self.device_description = f"endpoints: {len(servers)} servers ({first.engine_name}) routed by {router.name}"
        self.report_columns = {"num_replicas": len(servers), "router": router.name}

    def describe(self) -> str:
        return self.device_description

    def shutdown(self) -> None:
        for server in reversed(self.servers):
            server.shutdown()


def endpoint_fleet_rows(result, fleet: EndpointFleet, summary) -> list[dict]:
    """The fleet's summary row and each server's (kvtool.fleet.fleet_rows), each with its URL."""
    from kvtool.fleet.fleet_rows import fleet_rows

    stats = [fleet.engine.replica_stats(r) for r in range(len(fleet.servers))]
    columns = [{"endpoint": server.endpoint} for server in fleet.servers]
    return fleet_rows(result.row, result.requests, stats, summary, replica_columns=columns)
