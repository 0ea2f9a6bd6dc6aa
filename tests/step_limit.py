"""A bound for every loop that steps a scheduler or engine until its requests finish.

A broken rule (say, a last prompt token that counts as cached) can leave a request that never
finishes; the loop must then fail, naming the situation, instead of hanging the suite:

    limit = StepLimit(100, "one request of 3 blocks, alone")
    while scheduler.has_unfinished_requests():
        limit.step()
        ...
"""

from __future__ import annotations


class StepLimitExceeded(AssertionError):
    """A scheduler loop ran past its step limit: its requests never finished."""


class StepLimit:
    """Counts the steps of one loop; ``step()`` raises StepLimitExceeded after ``max_steps``."""

    def __init__(self, max_steps: int, situation: str) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps={max_steps}: give at least 1")
        self.max_steps = max_steps
        self.situation = situation
        self.num_steps = 0

    def step(self) -> int:
        """Counts one more step; returns how many were taken so far (this one included)."""
        if self.num_steps >= self.max_steps:
            raise StepLimitExceeded(f"{self.situation}: requests still unfinished after {self.max_steps} steps")
        self.num_steps += 1
        return self.num_steps
