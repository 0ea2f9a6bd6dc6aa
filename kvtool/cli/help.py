"""`--help` of a command: panels of two columns (the flag with its value type, what it does). Flag
names are never cut: typer's own table gives empty columns room and shortens TensorRT-LLM's long
names (--kv_cache_free_gpu_mem_fraction) at 80 characters."""

from __future__ import annotations

import enum

from rich.console import Console, Group
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand

DEFAULT_PANEL = "Options"
OUTPUT_PANEL = "Output"  # listed last, as commands take their output last
DASHES_NOTE = "Every flag also takes dashes: --tokens-per-block is --tokens_per_block."

# Duck-typed: typer's parameters are click's (typer < 0.20) or typer's own copy of them.


def _is_argument(param) -> bool:
    return getattr(param, "param_type_name", "") == "argument"


def _is_flag(param) -> bool:
    return bool(getattr(param, "is_flag", False))


def _argument_name(param) -> str:
    return param.name.upper() + ("..." if param.nargs != 1 else "")


def _value_type(param, ctx) -> str:
    """'<int>', '<enable|disable>', ... ('' for a flag)."""
    if _is_flag(param):
        return ""
    if hasattr(param, "display_type_rich"):
        return param.display_type_rich(ctx=ctx) or ""
    kind = getattr(param, "type", None)
    choices = getattr(kind, "choices", None)
    return f"<{'|'.join(map(str, choices)) if choices else getattr(kind, 'name', 'value')}>"


def _default_text(param) -> str:
    default = getattr(param, "default", None)
    if (_is_argument(param) or _is_flag(param) or getattr(param, "show_default", True) is False
            or default is None or callable(default)):
        return ""
    text = f"(default: {default.value if isinstance(default, enum.Enum) else default})"
    return f" {text}" if getattr(param, "help", None) else text


def _row(param, ctx) -> tuple[Text, Text]:
    if _is_argument(param):
        name = Text(_argument_name(param), style="bold cyan")
    else:
        name = Text(", ".join(param.opts), style="bold cyan")
    value_type = "" if _is_argument(param) else _value_type(param, ctx)
    if value_type:
        name.append(f" {value_type}", style="yellow")
    help_text = Text(getattr(param, "help", None) or "")
    if param.required:
        help_text.append(" (required)", style="red")
    help_text.append(_default_text(param), style="dim")
    return name, help_text


def _panel(title: str, params: list, ctx) -> Panel:
    table = Table.grid(padding=(0, 2), expand=True)
    table.add_column(no_wrap=True)
    table.add_column(ratio=1)
    for param in params:
        table.add_row(*_row(param, ctx))
    return Panel(table, title=title, title_align="left", border_style="dim")


def render_help(command, ctx) -> Group:
    """Usage, the command's description, one panel per rich_help_panel (unnamed ones first), a note that
    dashes work too."""
    panels: dict[str, list] = {}
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        panel = getattr(param, "rich_help_panel", None) or ("Arguments" if _is_argument(param) else DEFAULT_PANEL)
        panels.setdefault(panel, []).append(param)
    if len(panels) > 1 and panels.get(DEFAULT_PANEL, [None])[0] is ctx.command.get_help_option(ctx):
        panels[DEFAULT_PANEL] = panels.pop(DEFAULT_PANEL)  # only --help: after the named panels
    for last in (OUTPUT_PANEL, DEFAULT_PANEL):
        if last in panels and len(panels) > 1:
            panels[last] = panels.pop(last)
    arguments = [_argument_name(p) for p in command.get_params(ctx) if _is_argument(p)]
    usage = " ".join(["Usage:", ctx.command_path, "[OPTIONS]", *arguments])
    parts = [Padding(Text(usage, style="bold"), (1, 1, 0, 1))]
    if command.help:
        parts.append(Padding(Text(command.help.strip().split("\n\n")[0].replace("\n", " ")), (1, 1)))
    parts += [_panel(title, params, ctx) for title, params in panels.items()]
    epilog = command.epilog or ""
    if any("_" in opt for param in command.get_params(ctx) for opt in getattr(param, "opts", ())):
        epilog = f"{epilog} {DASHES_NOTE}".strip()
    if epilog:
        parts.append(Padding(Text(epilog, style="dim"), (0, 1)))
    return Group(*parts)


class KvtoolCommand(TyperCommand):
    """A typer command whose --help is :func:`render_help`."""

    def format_help(self, ctx, formatter) -> None:
        Console(highlight=False).print(render_help(self, ctx))
