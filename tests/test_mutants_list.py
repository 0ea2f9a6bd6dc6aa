"""The mutant list of `make mutants` stays usable: every edit still applies to the tree exactly once
and names tests that exist, so a moved line is caught by `make test`, not first by `make mutants`."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mutants_module():
    spec = importlib.util.spec_from_file_location("kvtool_mutants_script", ROOT / "scripts" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


mutants_script = _mutants_module()
MUTANTS = mutants_script.load_mutants(ROOT / "tests" / "mutants.toml")


def test_the_list_breaks_at_least_fifteen_rules_in_both_layers():
    assert len(MUTANTS) >= 15
    assert any(m.is_cpp for m in MUTANTS) and any(m.file.startswith("kvtool/") for m in MUTANTS)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_every_mutant_applies_exactly_once_and_names_existing_tests(mutant):
    source = (ROOT / mutant.file).read_text()
    assert source.count(mutant.find) == 1, f"{mutant.name}: the code moved; update tests/mutants.toml"
    for test in mutant.tests:
        path, _, name = test.partition("::")
        assert (ROOT / path).is_file(), f"{mutant.name}: {path} does not exist"
        if name:
            function = name.split("::")[0].split("[")[0]
            assert re.search(rf"^(def {function}\(|{function} = )", (ROOT / path).read_text(), re.MULTILINE), \
                f"{mutant.name}: {path} has no test {function}"


def test_a_malformed_entry_is_refused_naming_the_file_and_entry(tmp_path):
    listing = tmp_path / "mutants.toml"
    listing.write_text('[[mutant]]\nname = "salt"\nfile = "csrc/core/x.cpp"\n')
    with pytest.raises(mutants_script.MutantListError,
                       match=r"mutants.toml: mutant 1 \(salt\): missing rule, find, replace, tests"):
        mutants_script.load_mutants(listing)


def test_an_edit_outside_csrc_and_kvtool_is_refused(tmp_path):
    listing = tmp_path / "mutants.toml"
    listing.write_text('[[mutant]]\nname = "x"\nrule = "r"\nfile = "tests/conftest.py"\nfind = "a"\nreplace = "b"\n'
                       'tests = ["tests/test_x.py"]\n')
    with pytest.raises(mutants_script.MutantListError, match="not under csrc/ or kvtool/"):
        mutants_script.load_mutants(listing)


def test_a_mutant_names_the_kernels_it_needs_and_the_report_counts_those_not_run_here(tmp_path):
    listing = tmp_path / "mutants.toml"
    entry = ('[[mutant]]\nname = "x"\nrule = "r"\nfile = "csrc/cpu/x.h"\nfind = "a"\nreplace = "b"\n'
             'tests = ["tests/test_x.py"]\nneeds = "{}"\n')
    listing.write_text(entry.format("amx"))
    assert mutants_script.load_mutants(listing)[0].needs == "amx"
    listing.write_text(entry.format("neon"))
    with pytest.raises(mutants_script.MutantListError, match="needs 'neon' is not a CPU kernel build"):
        mutants_script.load_mutants(listing)
    mutant = mutants_script.Mutant("x", "r", "csrc/cpu/x.h", "a", "b", ("t",), needs="amx")
    outcomes = [mutants_script.Outcome(mutant, "killed", "t", 1.0),
                mutants_script.Outcome(mutant, "not run here", "needs the amx kernels", 0.0)]
    header = mutants_script.report(outcomes, 1.0, 2.0, ROOT / "tests" / "mutants.toml")
    assert "1 of 1 mutants run killed (1 not run here: this CPU lacks the kernels their tests need)" in header
