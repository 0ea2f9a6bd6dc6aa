"""The requests of a finished bench that failed: how many, and their distinct errors with counts, for
the lines `kvtool bench` ends with when it exits 3 (``--allow_errors``: 0).

Errors that differ only in their numbers ("the prompt has 300 tokens" / "... 412 tokens", a port)
are one error: the first request's message stands for them, with the count of all.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtool.reports.csv_report import read_csv

NO_MESSAGE = "unfinished, no error given"  # a row that is not ok and holds no error (cannot happen today)
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


@dataclass(frozen=True)
class ErrorGroup:
    """Requests that failed alike: the first one's message, how many, and whether their messages differ."""

    message: str
    count: int
    varies: bool = False  # the count covers messages with other numbers in them


@dataclass(frozen=True)
class FailedRequests:
    """``num_failed`` of ``num_requests`` measured requests failed; their errors, most frequent first."""

    num_failed: int
    num_requests: int
    groups: tuple[ErrorGroup, ...]

    def lines(self, limit: int = 5) -> list[str]:
        """The report: the count, then up to ``limit`` distinct errors."""
        noun = "request" if self.num_requests == 1 else "requests"
        lines = [f"{self.num_failed:,} of {self.num_requests:,} {noun} failed; "
                 f"{'their error' if len(self.groups) == 1 else 'the most frequent errors'}:"]
        width = len(f"{self.groups[0].count:,}") if self.groups else 1
        for group in self.groups[:limit]:
            alike = " (and alike, with other numbers)" if group.varies else ""
            lines.append(f"  {group.count:>{width},} × {group.message}{alike}")
        if len(self.groups) > limit:
            lines.append(f"  ... and {len(self.groups) - limit} other distinct errors (the error column of the "
                         "requests CSV)")
        return lines


def group_errors(messages: Iterable[str | None]) -> tuple[ErrorGroup, ...]:
    """Messages grouped when they differ only in numbers; most frequent first, then first seen."""
    groups: dict[str, list] = {}  # key -> [first message, count, varies]
    for message in messages:
        message = message or NO_MESSAGE
        group = groups.setdefault(_NUMBER.sub("#", message), [message, 0, False])
        group[1] += 1
        group[2] = group[2] or message != group[0]
    ordered = sorted(groups.values(), key=lambda group: -group[1])  # stable: ties stay in order of appearance
    return tuple(ErrorGroup(message, count, varies) for message, count, varies in ordered)


def failed_requests(rows: Sequence[Mapping], requests_csvs: Sequence[Path]) -> FailedRequests | None:
    """The failures of a run from its summary rows (``num_errors``) and per-request CSVs (their
    ``error`` column); None when no request failed."""
    num_failed = sum(int(row.get("num_errors") or 0) for row in rows)
    if not num_failed:
        return None
    num_requests = num_failed + sum(int(row.get("num_requests") or 0) for row in rows)
    messages = [row.get("error") for path in requests_csvs if Path(path).is_file() for row in read_csv(path)
                if row.get("error") or not row.get("finish_s")]
    return FailedRequests(num_failed, num_requests, group_errors(messages))
