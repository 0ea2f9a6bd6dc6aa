"""Pyflakes checks (through ruff) over every Python file: most GPU code paths never run on a CPU
machine, so an undefined name or a broken import there must be caught without executing it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str] | None:
    executable = Path(sys.executable).with_name("ruff")
    if executable.exists():
        return [str(executable)]
    found = shutil.which("ruff")
    return [found] if found else None


@pytest.mark.skipif(_ruff() is None, reason="ruff is not installed (pip install -e '.[test]')")
def test_no_undefined_names_unused_imports_or_redefinitions():
    result = subprocess.run([*_ruff(), "check", "--no-cache", "--select", "F", "--output-format", "concise",
                             "kvtool", "bench", "tests", "examples", "scripts"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
