"""Parallel::run_shares (the row products' and the streaming read's split across threads) takes each
item once, in and out of a team, and a thread done early takes ranges from a slow thread's share.
Built here with the C++ compiler and OpenMP (skipped without them): the threads' speeds must be set
by the test, which a Python caller cannot do."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("g++") or shutil.which("c++")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_run_shares_takes_each_item_once_and_finishes_a_slow_threads_share(tmp_path):
    binary = tmp_path / "parallel_shares"
    sources = [str(ROOT / "tests" / "cpp" / "parallel_shares.cpp"), str(ROOT / "csrc" / "cpu" / "parallel.cpp")]
    build = subprocess.run([CXX, "-std=c++17", "-O1", "-fopenmp", f"-I{ROOT / 'csrc' / 'cpu'}", *sources,
                            "-o", str(binary)], capture_output=True, text=True)
    if build.returncode != 0 and "fopenmp" in build.stderr:
        pytest.skip("the compiler has no OpenMP")
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True, env={"OMP_NUM_THREADS": "2"}, timeout=120)
    if run.returncode == 77:
        pytest.skip("OpenMP gave one thread")
    assert run.returncode == 0, run.stdout + run.stderr
