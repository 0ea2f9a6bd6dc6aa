"""Slices of the public Mooncake conversation trace (shared/data beside the checkout, see its
README) for tests: copied into the test's directory, never committed."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

TRACE_NAME = "mooncake_conversation_trace.jsonl"


def conversation_trace() -> Path:
    """The trace file: $KVTOOL_SHARED_DATA/NAME, or shared/data/NAME in a directory above the checkout."""
    candidates = [Path(os.environ["KVTOOL_SHARED_DATA"]) / TRACE_NAME] if "KVTOOL_SHARED_DATA" in os.environ else []
    root = Path(__file__).resolve().parent.parent
    candidates += [directory / "shared" / "data" / TRACE_NAME for directory in (root, *root.parents)]
    found = next((path for path in candidates if path.is_file()), None)
    if found is None:
        pytest.skip(f"the Mooncake conversation trace ({TRACE_NAME}) is not in shared/data above {root}")
    return found


def mooncake_slice(directory: Path, count: int, start: int = 0) -> Path:
    """Lines start .. start + count of the trace, as a file in ``directory``."""
    path = directory / f"mooncake_{start}_{count}.jsonl"
    with conversation_trace().open(encoding="utf-8") as source:
        path.write_text("".join(itertools.islice(source, start, start + count)), encoding="utf-8")
    return path
