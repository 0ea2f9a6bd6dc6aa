"""The committed type stubs of kvtool._core match the compiled extension (regenerate: `make stubs`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

STUB = Path(__file__).resolve().parent.parent / "kvtool" / "_core.pyi"


def test_committed_stub_matches_the_extension(tmp_path):
    pytest.importorskip("nanobind.stubgen")
    generated = tmp_path / "_core.pyi"
    subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-m", "kvtool._core", "-o", str(generated)],
                   check=True, capture_output=True)
    assert generated.read_text() == STUB.read_text(), "kvtool/_core.pyi is stale: run `make stubs`"
