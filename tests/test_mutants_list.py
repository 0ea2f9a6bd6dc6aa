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
