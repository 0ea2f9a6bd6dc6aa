"""docs/architecture.md says only what the code is: every file it names exists, every name it quotes
is a name of kvtool's code, the request-path diagram names real modules and types, and its package
table lists every package of kvtool/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
FENCED = re.compile(r"^```.*?^```", re.S | re.M)
# Paths a plan or a server has, not the repository: a plan directory's parts, HTTP routes.
NOT_REPOSITORY_PATHS = ("PLAN/", "kernels/", "tokenizer/", "/metrics", "/health", "/v1/")


def _code_words() -> set[str]:
    files = [path for top in ("kvtool", "csrc") for path in (ROOT / top).rglob("*")
             if path.suffix in (".py", ".pyi", ".h", ".cpp", ".cu", ".cuh")]
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", "\n".join(p.read_text(errors="replace") for p in files)))


WORDS = _code_words()
PROSE = FENCED.sub("", DOC)
QUOTED = sorted(set(re.findall(r"`([^`\n]+)`", PROSE)))


def _is_path(text: str) -> bool:
    return "/" in text and " " not in text and not text.startswith("-")


@pytest.mark.parametrize("path", [q for q in QUOTED if _is_path(q) and not q.startswith(NOT_REPOSITORY_PATHS)])
def test_every_file_the_document_names_exists(path):
    assert (ROOT / path.split("#")[0]).exists(), f"docs/architecture.md names {path}, which does not exist"


@pytest.mark.parametrize("quoted", [q for q in QUOTED if not _is_path(q)])
def test_every_name_the_document_quotes_is_in_the_code(quoted):
    # `Engine.step`, `--enforce_eager`, `missed_<reason>_blocks`: each identifier in it must be a word
    # of kvtool's Python or C++ (a function, type, field, flag, column or value the code spells).
    names = re.findall(r"(?<![\w<-])[A-Za-z_][A-Za-z0-9_]*(?![\w>])", quoted)
    unknown = [name for name in names if name not in WORDS]
    assert not unknown, f"docs/architecture.md quotes `{quoted}`: {unknown} not found in kvtool/ or csrc/"


def test_the_request_path_diagram_names_real_modules_and_types():
    diagram = next(block for block in FENCED.findall(DOC) if "Engine.step" in block)
    for module in re.findall(r"\b([a-z_]+/[a-z_]+\.py)\b", diagram):
        assert (ROOT / "kvtool" / module).is_file(), f"the diagram names kvtool/{module}, which does not exist"
    for name in re.findall(r"\b[A-Z][A-Za-z]+[a-z][A-Z][A-Za-z]*\b", diagram):  # CamelCase: types
        assert name in WORDS, f"the diagram names {name}, which is not in the code"
    for step in ("dataset", "Scheduler", "KVCacheManager", "ModelRunner", "RequestMetrics"):
        assert step in diagram, f"the request path should show {step}"


def test_the_package_table_lists_every_package():
    packages = sorted(p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "kvtool").glob("*/__init__.py"))
    table = {row.split("`")[1].rstrip("/") for row in DOC.splitlines() if row.startswith("| `kvtool/")}
    missing = [package for package in packages if package not in table]
    assert not missing, f"docs/architecture.md's package table leaves out {missing}"
