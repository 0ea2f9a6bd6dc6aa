"""Running kvtool serve: where it listens, and how it stops.

uvicorn serves the app. On Ctrl-C or SIGTERM it stops accepting connections and lets running
requests finish for ``drain_timeout_s`` seconds; then it closes the connections left, which aborts
their requests, and the engine task stops (the app's lifespan). A second Ctrl-C stops at once.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from kvtool.config import check


@dataclass(frozen=True)
class ServeConfig:
    """Where the server listens and what it calls its model."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the plan's directory name
    drain_timeout_s: float = 5.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        check(bool(self.host), self, "host", "is empty: give an address to listen on, e.g. 127.0.0.1 or 0.0.0.0")
        check(0 <= self.port <= 65535, self, "port", f"must be in 0..65535, got {self.port}")
        check(self.served_model_name is None or bool(self.served_model_name.strip()), self, "served_model_name",
              "is empty: give the name clients send as `model`, or leave it out")
        check(self.drain_timeout_s >= 0, self, "drain_timeout_s", f"must be >= 0 seconds, got {self.drain_timeout_s}")
        levels = ("critical", "error", "warning", "info", "debug")
        check(self.log_level in levels, self, "log_level", f"{self.log_level!r} is unknown: use one of {list(levels)}")


def uvicorn_server(app, config: ServeConfig):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                         timeout_graceful_shutdown=config.drain_timeout_s, access_log=False))


def run_server(app, config: ServeConfig) -> None:
    """Serves until Ctrl-C or SIGTERM, then drains and returns."""
    server = uvicorn_server(app, config)
    # uvicorn raises the signal it caught again once it has shut down; by then there is nothing left to do.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
