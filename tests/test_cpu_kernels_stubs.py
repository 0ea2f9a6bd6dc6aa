"""The committed type stubs of kvtool.cpu_kernels._kernels match the compiled extension (`make stubs`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

STUB = Path(__file__).resolve().parent.parent / "kvtool" / "cpu_kernels" / "_kernels.pyi"


def test_committed_stub_matches_the_extension(tmp_path):
    pytest.importorskip("nanobind.stubgen")
    generated = tmp_path / "_kernels.pyi"
    subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-m", "kvtool.cpu_kernels._kernels", "-o",
                    str(generated)], check=True, capture_output=True)
    assert generated.read_text() == STUB.read_text(), "kvtool/cpu_kernels/_kernels.pyi is stale: run `make stubs`"
