"""The README says what the code does: the torch pin and how to choose its build match the Makefile,
and every `kvtool` command it shows names a real command and real flags."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import typer

from kvtool.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()


def test_the_torch_pin_and_the_build_choice_are_the_makefiles():
    pin = re.search(r"^TORCH \?= (\S+)$", MAKEFILE, re.M).group(1)
    assert f"pip install {pin}" in README
    assert "the CPU wheel" not in README  # the pin fixes a version, not a build
    for variable in re.findall(r"make \w+ (\w+)=", README):
        assert re.search(rf"^{variable} \?=", MAKEFILE, re.M), f"README uses make {variable}=, the Makefile has none"
        assert f"$({variable})" in MAKEFILE


def readme_commands():
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("kvtool "):
                yield shlex.split(line)[1:]


def test_every_kvtool_command_in_the_readme_exists_with_its_flags():
    root = typer.main.get_command(app)
    commands = list(readme_commands())
    assert len(commands) >= 10
    for argv in commands:
        command, rest = root, list(argv)
        while hasattr(command, "commands") and rest and rest[0] in command.commands:
            command = command.commands[rest.pop(0)]
        options = {opt for param in command.params for opt in getattr(param, "opts", [])}
        for word in rest:
            if word.startswith("--"):
                assert word.replace("-", "_").replace("__", "--", 1) in options, f"{' '.join(argv)}: {word}"


def _slug(heading: str) -> str:
    """The anchor a Markdown heading gets (GitHub's rule: lower case, punctuation dropped, spaces to -)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_pointer_into_the_architecture_doc_names_a_section():
    sections = {_slug(h) for h in re.findall(r"^#+ (.+)$", (ROOT / "docs" / "architecture.md").read_text(), re.M)}
    pointers = {(path.relative_to(ROOT), anchor)
                for folder in ("kvtool", "csrc", "bench", "tests", "examples", "scripts")
                for path in (ROOT / folder).rglob("*") if path.suffix in (".py", ".h", ".cpp", ".cu", ".cuh", ".md")
                for anchor in re.findall(r"docs/architecture\.md#([\w-]+)", path.read_text(errors="replace"))}
    assert pointers, "the code points into docs/architecture.md"
    assert {p for p in pointers if p[1] not in sections} == set()
