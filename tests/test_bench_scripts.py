"""Every script under bench/ still imports: a module it names that moved or was renamed (a rename, a
merge of two branches) fails here, in the suite, not in the next benchmark run on a GPU or a quiet
machine. Importing runs a script's module level only (a script keeps its work under `main()`; the
others are the scripts' shared modules). Every standalone C++ program there still compiles."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "bench").rglob("*.py"))
PROGRAMS = sorted((ROOT / "bench").rglob("*.cpp"))
# Packages a script may need that kvtool's tests do not install: the script is skipped without them.
OPTIONAL = {"cupy", "vllm", "matplotlib"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_a_bench_script_imports(script: Path, monkeypatch):
    monkeypatch.syspath_prepend(str(script.parent))  # its sibling modules, as `python bench/x.py` has them
    spec = importlib.util.spec_from_file_location(f"bench_script_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # as a script is: dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] in OPTIONAL:
            pytest.skip(f"{script.name} needs {error.name}")
        raise


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda path: str(path.relative_to(ROOT)))
def test_a_bench_program_compiles(program: Path):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ on this machine")
    # Syntax and types only, for the instruction sets the programs name (whatever this CPU runs).
    isa = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"]
    result = subprocess.run([compiler, "-std=c++17", "-fopenmp", "-fsyntax-only", *isa, str(program)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
