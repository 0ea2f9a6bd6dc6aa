"""What a bench needs of an LLM and its engine: kvtool.LLM and kvtool.runtime.engine.Engine provide it
(so do the deterministic fakes of tests/bench_fakes.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from kvtool.models.tokenizer import Tokenizer
from kvtool.runtime.pool_sizes import PoolSizes
from kvtool.runtime.request import Request


class BenchEngine(Protocol):
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


class BenchPlan(Protocol):
    path: Path
    model_config: Any   # a dataclass: its scalar fields become model_* summary columns
    build_options: Any  # a dataclass: plan_* columns


class BenchLLM(Protocol):
    """An LLM may also carry ``clock`` (an object with ``now()`` and ``sleep(seconds)``), ``engine_name``
    and ``report_columns``: kvtool.simulate's SimulatedLLM does, and the bench then times the run on
    that clock and marks every row with them."""

    engine: BenchEngine
    tokenizer: Tokenizer
    plan: BenchPlan | None              # None: a server's, unknown here (kvtool.bench.endpoint)
    pool_sizes: PoolSizes | None
    device_description: str  # '<device>: <what it is>'

    def shutdown(self) -> None: ...
