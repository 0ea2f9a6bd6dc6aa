"""How kvtool's flags are declared: TensorRT-LLM's underscore spelling is the one listed in --help;
the dash spelling (--tokens-per-block) is accepted too, by normalizing option names while parsing
(``normalize_option``), so the help never lists a flag twice. On/off pairs are two flags, each on
its own line, so no column of the help is cut at 80 characters.

The flags of the table (kvtool.flags) reach a command through ``with_flags``: a parameter whose
default is ``flags_of(names)`` becomes those typer options, and the command gets them back as one
kvtool.flags.FlagValues.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated

import typer

from kvtool.cli.user_errors import user_errors
from kvtool.flags import FLAG_BY_NAME, Flag, FlagValues, either  # noqa: F401 - either: the commands' own pairs


def normalize_option(name: str) -> str:
    """Click calls this on every option name, declared or typed (without its leading dashes)."""
    return name.replace("-", "_")


def flag(name: str, help: str, panel: str | None = None, **kwargs):
    """A typer option --name (the dash spelling is accepted as well), shown under ``panel`` in --help."""
    return typer.Option(f"--{name}", help=help, rich_help_panel=panel, **kwargs)


def toggle(name: str, help: str, panel: str | None = None):
    """A boolean flag that takes no value (None when not given)."""
    return typer.Option(f"--{name}", help=help, rich_help_panel=panel, metavar="", show_default=False)


class FlagGroup(typing.NamedTuple):
    """The default of a command parameter that stands for these flags of the table (see with_flags)."""

    names: tuple[str, ...]


def flags_of(names: tuple[str, ...]) -> typing.Any:
    return FlagGroup(tuple(names))


def _options(entry: Flag) -> list[inspect.Parameter]:
    """The typer parameters of one flag of the table (two for an on/off pair)."""
    if entry.toggle:
        pairs = [(entry.name, entry.help)] + ([(entry.off, entry.off_help)] if entry.off else [])
        return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                  annotation=Annotated[bool | None, toggle(name, help, entry.panel)])
                for name, help in pairs]
    kind = list[entry.type] if entry.repeatable else entry.type
    return [inspect.Parameter(entry.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                              annotation=Annotated[kind | None, flag(entry.name, entry.help, entry.panel)])]


def with_flags(command: Callable) -> Callable:
    """Replaces each parameter of ``command`` whose default is ``flags_of(names)`` by those flags' typer
    options (in place: --help lists them there), and calls ``command`` with their values as one
    FlagValues in that parameter. Two flags of a pair given together are a one-line error."""
    hints = typing.get_type_hints(command, include_extras=True)
    parameters, groups = [], {}
    for parameter in inspect.signature(command).parameters.values():
        if isinstance(parameter.default, FlagGroup):
            options = [option for name in parameter.default.names for option in _options(FLAG_BY_NAME[name])]
            groups[parameter.name] = (parameter.default.names, [option.name for option in options])
            parameters += options
        else:
            parameters.append(parameter.replace(annotation=hints.get(parameter.name, parameter.annotation),
                                                kind=inspect.Parameter.KEYWORD_ONLY))

    @functools.wraps(command)
    def run(**kwargs):
        with user_errors():
            for group, (names, options) in groups.items():
                kwargs[group] = FlagValues.of_options({option: kwargs.pop(option) for option in options}, names)
        return command(**kwargs)

    run.__signature__ = inspect.Signature(parameters)
    run.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
    return run
