"""What times a run: the engine's token times, and a replay's waits for timed arrivals."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class WallClock:
    """time.perf_counter seconds; waiting sleeps."""

    now = staticmethod(time.perf_counter)
    sleep = staticmethod(time.sleep)


WALL_CLOCK = WallClock()
