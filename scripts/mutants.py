"""Mutation check: breaks one rule of csrc/ or kvtool/ at a time and runs the tests that should catch it.

    python scripts/mutants.py [--only NAME ...] [--mutants tests/mutants.toml] [--report results/mutants.md]

Each mutant of the list (tests/mutants.toml) is a precise textual edit of one file (``find``, which
must occur exactly once, becomes ``replace``) that breaks one rule, with the tests that must fail
because of it. The edits are applied to a copy of the tree (--work_dir, default build/mutants: the
working tree's tracked and unignored files), never to the tree itself. The C++ extension of the copy
is built once with CMake and Ninja in a build directory that is kept between runs, so a C++ mutant
recompiles its one source file and relinks. The copy's tests import the copy's kvtool (a
sitecustomize.py on PYTHONPATH sets an editable install of the real tree aside). A mutant of kernels
only some CPUs run names them (``needs = "amx"``: a kvtool CPU kernel build): on a CPU without them its
tests would skip and pass, so it is reported as not run here instead.

First the tests of every mutant run on the unchanged copy (the baseline: they must pass). Then each
mutant is applied, built and tested: killed when a test fails, survived when they all pass. A
mutant whose ``find`` no longer occurs exactly once (the code moved) is stale; one that does not
build was no rule break but a syntax error. The table goes to stdout and to --report; the exit
status is 1 unless every mutant run was killed, 2 for a bad mutant list.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvtool.config import CPU_KERNEL_ISAS

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser before it joined the standard library (kvtool[test] installs it)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
# Files of the copy that are the copy's own, not the tree's: never deleted when the copy is synced.
OWN_FILES = re.compile(r"(^|/)(__pycache__|\.hypothesis|\.pytest_cache)(/|$)|^kvtool/_core\..*\.so$|^kvtool/cpu_kernels/_kernels\..*\.so$|^_mutants_site/")
SITECUSTOMIZE = '''# Written by scripts/mutants.py: tests of the mutated copy import the copy's kvtool, so an editable
# install's import hook (which maps kvtool to the real tree) is set aside.
import sys

sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
'''


class MutantListError(ValueError):
    """The mutant list is malformed; the message names the file and the entry."""


@dataclass(frozen=True)
class Mutant:
    """One rule break: ``find`` (exactly once in ``file``) becomes ``replace``; ``tests`` must fail."""

    name: str
    rule: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]
    needs: str = ""     # the kvtool CPU kernel build its tests run on, where only some CPUs have it

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", self.name):
            raise ValueError(f"name {self.name!r} is not lowercase words joined by '-'")
        if not self.find or self.find == self.replace:
            raise ValueError(f"{self.name}: find is empty or equals replace: the mutant changes nothing")
        if not self.tests:
            raise ValueError(f"{self.name}: tests is empty: name the tests that must catch it")
        if Path(self.file).is_absolute() or not self.file.startswith(("csrc/", "kvtool/")):
            raise ValueError(f"{self.name}: file {self.file!r} is not under csrc/ or kvtool/")
        if self.needs and self.needs not in CPU_KERNEL_ISAS:
            raise ValueError(f"{self.name}: needs {self.needs!r} is not a CPU kernel build: one of "
                             f"{', '.join(CPU_KERNEL_ISAS)}")

    @property
    def is_cpp(self) -> bool:
        return self.file.startswith("csrc/")


class Outcome(NamedTuple):
    mutant: Mutant
    result: str         # killed | survived | stale | does not build | test error | not run here
    detail: str         # the failing test, or what went wrong
    seconds: float


def load_mutants(path: Path) -> list[Mutant]:
    """The mutants of a TOML list of [[mutant]] tables; MutantListError names the file and entry."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise MutantListError(f"{path}: {error}") from None
    entries = data.get("mutant")
    if not isinstance(entries, list) or not entries:
        raise MutantListError(f"{path}: no [[mutant]] entries")
    mutants, names = [], set()
    fields = ("name", "rule", "file", "find", "replace", "tests")
    optional = ("needs",)
    for index, entry in enumerate(entries, 1):
        where = f"{path}: mutant {index} ({entry.get('name', 'unnamed')})"
        unknown = set(entry) - set(fields) - set(optional)
        missing = [f for f in fields if f not in entry]
        if unknown or missing:
            problems = ([f"unknown keys {', '.join(sorted(unknown))}"] if unknown else []) + \
                       ([f"missing {', '.join(missing)}"] if missing else [])
            raise MutantListError(f"{where}: {'; '.join(problems)}: give exactly {', '.join(fields)} "
                                  f"(and optionally {', '.join(optional)})")
        try:
            mutant = Mutant(**{**entry, "tests": tuple(entry["tests"])})
        except (TypeError, ValueError) as error:
            raise MutantListError(f"{where}: {error}") from None
        if mutant.name in names:
            raise MutantListError(f"{where}: the name {mutant.name} is used twice")
        names.add(mutant.name)
        mutants.append(mutant)
    return mutants


class MutantTree:
    """The copy of the tree the mutants are applied to, its CMake build and its test runs."""

    def __init__(self, work_dir: Path, test_timeout_s: int) -> None:
        self.tree = work_dir / "tree"
        self.build_dir = work_dir / "cmake-build"
        self.site = self.tree / "_mutants_site"
        self.test_timeout_s = test_timeout_s

    def sync(self) -> None:
        """Copies the working tree's tracked and unignored files; unchanged files keep their times."""
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                check=True, capture_output=True).stdout.decode().split("\0")
        files = {name for name in listed if name and (ROOT / name).is_file()}
        for name in sorted(files):
            source, target = ROOT / name, self.tree / name
            data = source.read_bytes()
            if not target.is_file() or target.read_bytes() != data:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)  # a new mtime: Ninja rebuilds what changed
        for path in sorted(self.tree.rglob("*")):
            name = path.relative_to(self.tree).as_posix()
            if path.is_file() and name not in files and not OWN_FILES.search(name):
                path.unlink()
        self.site.mkdir(exist_ok=True)
        (self.site / "sitecustomize.py").write_text(SITECUSTOMIZE)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.site), str(self.tree)])
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        return env

    def build(self) -> subprocess.CompletedProcess:
        """Builds the copy's extension (only what changed) into the copy's kvtool/."""
        if not (self.build_dir / "build.ninja").is_file():
            import nanobind  # noqa: PLC0415 - the build backend, present wherever the extension builds

            configure = ["cmake", "-S", str(self.tree), "-B", str(self.build_dir), "-G", "Ninja",
                         "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}",
                         f"-Dnanobind_DIR={nanobind.cmake_dir()}"]
            done = subprocess.run(configure, env=self.env(), capture_output=True, text=True)
            if done.returncode != 0:
                return done
        done = subprocess.run(["cmake", "--build", str(self.build_dir)], env=self.env(), capture_output=True, text=True)
        if done.returncode == 0:
            # The core beside kvtool/__init__.py, the CPU kernels in their package (CMakeLists' install rules).
            libraries = [(library, self.tree / "kvtool" / library.name) for library in self.build_dir.glob("_core*.so")]
            libraries += [(library, self.tree / "kvtool" / "cpu_kernels" / library.name)
                          for library in self.build_dir.glob("_kernels*.so")]
            for library, target in libraries:
                if not target.is_file() or target.read_bytes() != library.read_bytes():
                    shutil.copyfile(library, target)
        return done

    def check_imports(self) -> None:
        """Raises RuntimeError unless the copy's tests would import the copy's kvtool and extension."""
        code = "import kvtool, kvtool._core as c; print(kvtool.__file__); print(c.__file__)"
        done = subprocess.run([sys.executable, "-c", code], cwd=self.tree, env=self.env(), capture_output=True,
                              text=True)
        paths = done.stdout.split()
        if done.returncode != 0 or len(paths) != 2 or not all(Path(p).is_relative_to(self.tree) for p in paths):
            raise RuntimeError(f"the copy in {self.tree} does not import its own kvtool: {done.stdout}{done.stderr}")

    def supported_isas(self) -> list[str]:
        """The CPU kernel builds this CPU runs, as the copy's kvtool says."""
        code = "from kvtool.cpu_kernels import supported_isas; print(' '.join(supported_isas()))"
        done = subprocess.run([sys.executable, "-c", code], cwd=self.tree, env=self.env(), capture_output=True,
                              text=True, check=True)
        return done.stdout.split()

    def run_tests(self, tests: list[str]) -> tuple[int, str]:
        """(pytest's exit code, its output) for the tests in the copy, stopping at the first failure."""
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "--no-header", "-p", "no:cacheprovider",
                   "-o", f"timeout={self.test_timeout_s}", *tests]
        done = subprocess.run(command, cwd=self.tree, env=self.env(), capture_output=True, text=True)
        return done.returncode, done.stdout + done.stderr


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ", 1)[0]
    return "?"


def run_mutant(tree: MutantTree, mutant: Mutant, pristine: str) -> Outcome:
    started = time.perf_counter()
    path = tree.tree / mutant.file
    count = pristine.count(mutant.find)
    if count != 1:
        return Outcome(mutant, "stale", f"find occurs {count} times in {mutant.file}: update the mutant", 0.0)
    path.write_text(pristine.replace(mutant.find, mutant.replace))
    try:
        if mutant.is_cpp:
            built = tree.build()
            if built.returncode != 0:
                error = next((line for line in built.stdout.splitlines() if "error" in line), "see the build log")
                return Outcome(mutant, "does not build", error.strip()[:200], time.perf_counter() - started)
        code, output = tree.run_tests(list(mutant.tests))
    finally:
        path.write_text(pristine)
    seconds = time.perf_counter() - started
    if code == 0:
        return Outcome(mutant, "survived", "every test passed: write the test that catches it", seconds)
    if code == 1:
        return Outcome(mutant, "killed", first_failure(output), seconds)
    tail = output.strip().splitlines()[-1:] or ["no output"]
    return Outcome(mutant, "test error", f"pytest exit {code}: {tail[0][:200]}", seconds)


def table(outcomes: list[Outcome]) -> str:
    lines = ["| mutant | rule it breaks | file | result | caught by | s |", "|---|---|---|---|---|---:|"]
    for o in outcomes:
        detail = f"`{o.detail}`" if o.result == "killed" else o.detail
        lines.append(f"| {o.mutant.name} | {o.mutant.rule} | {o.mutant.file} | {o.result} | {detail} | "
                     f"{o.seconds:.0f} |")
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def report(outcomes: list[Outcome], baseline_s: float, total_s: float, mutant_list: Path) -> str:
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    killed = sum(o.result == "killed" for o in outcomes)
    not_run = [o for o in outcomes if o.result == "not run here"]
    skipped = f" ({len(not_run)} not run here: this CPU lacks the kernels their tests need)" if not_run else ""
    return "\n".join([
        "# Mutation check",
        "",
        f"`make mutants` (scripts/mutants.py): each mutant of {os.path.relpath(mutant_list, ROOT)} breaks one rule "
        "of csrc/ or kvtool/ in a copy of the tree; the tests named for it must then fail.",
        "",
        f"{killed} of {len(outcomes) - len(not_run)} mutants run killed{skipped}. "
        f"Revision {revision}{' (with local changes)' if dirty else ''}, "
        f"{time.strftime('%Y-%m-%d')}, {cpu_name()}, {os.cpu_count()} cores: {total_s:.0f} s in all, of which "
        f"{baseline_s:.0f} s for the baseline (every mutant's tests on the unchanged copy) and the build.",
        "",
        table(outcomes),
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mutants", type=Path, default=ROOT / "tests" / "mutants.toml", help="the mutant list")
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="run only this mutant (repeatable)")
    parser.add_argument("--work_dir", type=Path, default=ROOT / "build" / "mutants",
                        help="the copy and its build directory, kept between runs")
    parser.add_argument("--report", type=Path, default=ROOT / "results" / "mutants.md",
                        help="where the table is written (not written with --only)")
    parser.add_argument("--test_timeout", type=int, default=120, help="seconds a test may take under a mutant")
    args = parser.parse_args(argv)

    try:
        mutants = load_mutants(args.mutants)
    except MutantListError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    unknown = sorted(set(args.only) - {m.name for m in mutants})
    if unknown:
        print(f"error: --only {', '.join(unknown)}: no such mutant in {args.mutants}", file=sys.stderr)
        return 2
    if args.only:
        mutants = [m for m in mutants if m.name in args.only]

    started = time.perf_counter()
    tree = MutantTree(args.work_dir.resolve(), args.test_timeout)
    tree.sync()
    built = tree.build()
    if built.returncode != 0:
        print(f"error: the unchanged copy does not build:\n{built.stdout[-3000:]}{built.stderr[-3000:]}", file=sys.stderr)
        return 1
    tree.check_imports()
    isas = tree.supported_isas()
    not_run = {m.name for m in mutants if m.needs and m.needs not in isas}
    baseline_tests = list(dict.fromkeys(t for m in mutants if m.name not in not_run for t in m.tests))
    print(f"baseline: {len(baseline_tests)} test selections on the unchanged copy", flush=True)
    code, output = tree.run_tests(baseline_tests)
    if code != 0:
        print(f"error: the mutants' tests fail without any mutant (pytest exit {code}):\n{output[-4000:]}",
              file=sys.stderr)
        return 1
    baseline_s = time.perf_counter() - started

    # One file at a time: its extension sources recompile once more when it is restored.
    order = sorted(range(len(mutants)), key=lambda i: (mutants[i].file, i))
    outcomes: dict[int, Outcome] = {}
    for i in order:
        mutant = mutants[i]
        pristine = (tree.tree / mutant.file).read_text()
        if mutant.name in not_run:
            outcomes[i] = Outcome(mutant, "not run here", f"needs the {mutant.needs} kernels; this CPU runs "
                                  f"{', '.join(isas)}: run it on a CPU with them", 0.0)
        else:
            outcomes[i] = run_mutant(tree, mutant, pristine)
        o = outcomes[i]
        print(f"{mutant.name:40} {o.result:15} {o.seconds:4.0f} s  {o.detail}", flush=True)
    if any(m.is_cpp for m in mutants) and tree.build().returncode != 0:  # leave the build as the copy's sources
        print("warning: rebuilding the unchanged copy failed", file=sys.stderr)
    results = [outcomes[i] for i in range(len(mutants))]
    total_s = time.perf_counter() - started

    print()
    print(table(results))
    ran = [o for o in results if o.result != "not run here"]
    survivors = [o for o in ran if o.result != "killed"]
    print(f"\n{len(ran) - len(survivors)} of {len(ran)} mutants run killed in {total_s:.0f} s"
          + (f"; {len(results) - len(ran)} not run here (this CPU lacks their kernels)" if len(ran) < len(results)
             else ""))
    if not args.only:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(report(results, baseline_s, total_s, args.mutants.resolve()))
        print(f"report: {args.report}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
