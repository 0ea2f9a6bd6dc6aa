"""How kvtool's flags are declared: TensorRT-LLM's underscore spelling is the one listed in --help;
the dash spelling (--tokens-per-block) is accepted too, by normalizing option names while parsing
(``normalize_option``), so the help never lists a flag twice. On/off pairs are two flags, each on
its own line, so no column of the help is cut at 80 characters."""

from __future__ import annotations

import typer


def normalize_option(name: str) -> str:
    """Click calls this on every option name, declared or typed (without its leading dashes)."""
    return name.replace("-", "_")


def flag(name: str, help: str, panel: str | None = None, **kwargs):
    """A typer option --name (the dash spelling is accepted as well), shown under ``panel`` in --help."""
    return typer.Option(f"--{name}", help=help, rich_help_panel=panel, **kwargs)


def toggle(name: str, help: str, panel: str | None = None):
    """A boolean flag that takes no value (None when not given)."""
    return typer.Option(f"--{name}", help=help, rich_help_panel=panel, metavar="", show_default=False)


def either(on: bool | None, off: bool | None, on_name: str, off_name: str) -> bool | None:
    """The value of an on/off flag pair: True, False, or None when neither was given."""
    if on and off:
        raise ValueError(f"--{on_name} and --{off_name} contradict each other: give one of them")
    return True if on else False if off else None
