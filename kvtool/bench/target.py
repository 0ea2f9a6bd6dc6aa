"""What a bench replays a dataset through: a Target, and the engine it drives. kvtool.LLM is one (the
model on this machine), kvtool.simulate's SimulatedLLM another (the same engine, steps costed by a
model on a simulated clock), kvtool.bench.endpoint's EndpointLLM a third (a server, over HTTP); the
deterministic fakes of tests/bench_fakes.py are too."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from kvtool.config import EngineConfig
from kvtool.models.tokenizer import Tokenizer
from kvtool.runtime.clock import Clock
from kvtool.runtime.pool_sizes import PoolSizes
from kvtool.runtime.request import Request


class TargetEngine(Protocol):
    def request_problem(self, request: Request) -> str | None:
        """Why add_request would refuse the request (None: it would not), without queuing it."""

    def add_request(self, request: Request) -> None:
        """Queues the request under a new request_id; ValueError when it cannot be served."""

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[Request]:
        """Runs one step; the requests that produced a token in it."""

    def get_stats(self) -> dict[str, int | float]:
        """Cache counters, by their summary column names."""

    def reset_stats(self) -> None: ...


class TargetPlan(Protocol):
    path: Path
    model_config: Any   # a dataclass: its scalar fields become model_* summary columns
    build_options: Any  # a dataclass: plan_* columns


class Target(Protocol):
    """The engine a replay drives, the tokenizer of its text prompts, the clock it is timed on, and what
    every report row says about it."""

    engine: TargetEngine
    tokenizer: Tokenizer
    clock: Clock                  # now() and sleep(seconds): the wall clock's, or a simulation's
    config: EngineConfig | None   # None: a server's, configured where it runs
    plan: TargetPlan | None       # None: a server's, unknown here
    pool_sizes: PoolSizes | None  # None: a server's
    device_description: str       # '<device>: <what it is>'
    engine_name: str              # what served the requests ('kvtool', 'kvtool simulate (...)', 'vllm@endpoint')
    endpoint: str | None          # the server's /v1 URL
    report_columns: Mapping[str, Any]  # more columns of every summary row (a simulation's cost profile)

    def shutdown(self) -> None: ...
