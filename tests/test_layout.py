"""The package layout's dependency rules (docs/architecture.md), read from every module's imports, so that
they cannot silently come back: a request flows dataset (workloads) -> engine (runtime, plan) -> report
(reports); bench and simulate drive engines, serve serves one, and none of the lower packages reaches up."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

KVTOOL = Path(__file__).resolve().parents[1] / "kvtool"


def module_name(path: Path) -> str:
    parts = path.relative_to(KVTOOL.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The imports under ``if TYPE_CHECKING:``: annotations only, never loaded."""
    return {node for block in ast.walk(tree) if isinstance(block, ast.If) and isinstance(block.test, ast.Name)
            and block.test.id == "TYPE_CHECKING" for statement in block.body for node in ast.walk(statement)}


def imports(path: Path, *, module_level_only: bool = False) -> set[str]:
    """Every module ``path`` imports (``from a.b import c`` counts as a.b and a.b.c), in functions too
    unless ``module_level_only``; not those for type annotations only."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _type_checking_only(tree)
    nodes = [node for node in (tree.body if module_level_only else ast.walk(tree)) if node not in skipped]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def files_of(package: str) -> list[Path]:
    path = KVTOOL.joinpath(*package.split(".")[1:])
    return sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


def reaches(importer: str, forbidden: tuple[str, ...]) -> list[str]:
    """'module imports name' for every import of ``importer``'s files that falls under ``forbidden``."""
    return [f"{module_name(path)} imports {name}" for path in files_of(importer) for name in sorted(imports(path))
            if any(name == package or name.startswith(package + ".") for package in forbidden)]


# (who, what it must not import): each row a rule of the layout.
RULES = [
    # The server serves one LLM: it neither benchmarks nor simulates, and its command builds the LLM itself.
    ("kvtool.serve", ("kvtool.bench", "kvtool.simulate", "kvtool.cli")),
    ("kvtool.cli.serve", ("kvtool.bench", "kvtool.simulate")),
    # A simulation is an engine with another executor: it uses runtime, workloads, reports and plan, and
    # what drives it (bench, the CLI) sits above it.
    ("kvtool.simulate", ("kvtool.bench", "kvtool.cli", "kvtool.serve")),
    # A bench drives any target over the protocol it declares; the names it shares with a server are in reports.
    ("kvtool.bench", ("kvtool.serve", "kvtool.cli")),
    # Reports are made from rows and requests; datasets (whose statistics are reports' figures) and the
    # engine know nothing of who drives them.
    ("kvtool.reports", ("kvtool.bench", "kvtool.simulate", "kvtool.serve", "kvtool.cli", "kvtool.llm",
                        "kvtool.workloads")),
    ("kvtool.workloads", ("kvtool.bench", "kvtool.simulate", "kvtool.serve", "kvtool.cli", "kvtool.llm")),
    ("kvtool.runtime", ("kvtool.bench", "kvtool.simulate", "kvtool.serve", "kvtool.cli", "kvtool.reports",
                        "kvtool.workloads", "kvtool.llm")),
    ("kvtool.plan", ("kvtool.bench", "kvtool.simulate", "kvtool.serve", "kvtool.cli", "kvtool.reports",
                     "kvtool.workloads", "kvtool.llm")),
    # The LLM API wires plan, runtime, models and layers together; whatever drives it is above it.
    ("kvtool.llm", ("kvtool.bench", "kvtool.simulate", "kvtool.serve", "kvtool.cli", "kvtool.reports",
                    "kvtool.workloads")),
    ("kvtool.config", ("kvtool.bench", "kvtool.simulate", "kvtool.serve", "kvtool.cli", "kvtool.runtime",
                       "kvtool.llm")),
    ("kvtool.flags", ("kvtool.bench", "kvtool.simulate", "kvtool.serve", "kvtool.cli", "kvtool.runtime",
                      "kvtool.llm")),
]


@pytest.mark.parametrize("importer, forbidden", RULES, ids=[rule[0] for rule in RULES])
def test_no_package_reaches_where_the_layout_forbids(importer, forbidden):
    assert reaches(importer, forbidden) == []


def test_the_rules_would_catch_an_import_that_breaks_them(tmp_path, monkeypatch):
    # The serve package importing the bench runner, as it once did through create_llm.
    package = tmp_path / "kvtool" / "serve"
    package.mkdir(parents=True)
    (package / "app.py").write_text("def create():\n    from kvtool.bench.runner import create_llm\n")
    monkeypatch.setattr(__import__(__name__), "KVTOOL", tmp_path / "kvtool")
    assert reaches("kvtool.serve", ("kvtool.bench",)) == ["kvtool.serve.app imports kvtool.bench.runner",
                                                          "kvtool.serve.app imports kvtool.bench.runner.create_llm"]


def test_the_flag_table_loads_neither_torch_nor_typer():
    """kvtool/flags.py is read by scenarios and reports and by `kvtool --help`, which must stay fast."""
    loaded = imports(KVTOOL / "flags.py", module_level_only=True)
    assert not {name for name in loaded if name.split(".")[0] in ("torch", "typer")}


def test_no_two_modules_share_a_name():
    """A file's name says its one job: no two config.py, metrics.py, engine.py, ..."""
    names = Counter(path.name for path in KVTOOL.rglob("*.py") if path.name != "__init__.py")
    assert [name for name, count in names.items() if count > 1] == []
