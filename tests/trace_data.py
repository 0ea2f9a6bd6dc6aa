"""Slices of the public Mooncake conversation trace (shared/data beside the checkout, see its
README) for tests: copied into the test's directory, never committed."""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path

import pytest

TRACE_NAME = "mooncake_conversation_trace.jsonl"


ROOT = Path(__file__).resolve().parent.parent


def find_conversation_trace() -> Path | None:
    """The trace file: $KVTOOL_SHARED_DATA/NAME, or shared/data/NAME in a directory above the checkout
    (None: neither; the benchmarks under bench/ look for it here too)."""
    candidates = [Path(os.environ["KVTOOL_SHARED_DATA"]) / TRACE_NAME] if "KVTOOL_SHARED_DATA" in os.environ else []
    candidates += [directory / "shared" / "data" / TRACE_NAME for directory in (ROOT, *ROOT.parents)]
    return next((path for path in candidates if path.is_file()), None)


def benchmark_arguments(description: str) -> argparse.Namespace:
    """A trace benchmark's flags (bench/trace_*.py): --trace (default: the conversation trace), --repeat,
    --output."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    args.trace = args.trace or find_conversation_trace()
    if args.trace is None:
        parser.error(f"no shared/data/{TRACE_NAME} above {ROOT}: give --trace PATH")
    return args


def conversation_trace() -> Path:
    """The trace file, or the test is skipped."""
    found = find_conversation_trace()
    if found is None:
        pytest.skip(f"the Mooncake conversation trace ({TRACE_NAME}) is not in shared/data above {ROOT}")
    return found


def mooncake_slice(directory: Path, count: int, start: int = 0) -> Path:
    """Lines start .. start + count of the trace, as a file in ``directory``."""
    path = directory / f"mooncake_{start}_{count}.jsonl"
    with conversation_trace().open(encoding="utf-8") as source:
        path.write_text("".join(itertools.islice(source, start, start + count)), encoding="utf-8")
    return path
