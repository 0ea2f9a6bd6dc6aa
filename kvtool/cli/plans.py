"""`kvtool plans`: list the plans built on the fly (from --model) and remove them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvtool.cli import app
from kvtool.cli.user_errors import user_errors
from kvtool.cli.help import KvtoolCommand
from kvtool.cli.typer_options import flag, toggle
from kvtool.units import format_bytes

plans_app = typer.Typer(help="List (alone: `kvtool plans`) and remove the plans built on the fly (bench --model, "
                        "LLM(model=...)).",
                        invoke_without_command=True)
app.add_typer(plans_app, name="plans")

CacheDir = Annotated[Path | None, flag("plan_cache_dir", "The plan cache (default $KVTOOL_CACHE_DIR or "
                                       "~/.cache/kvtool/plans).")]


ID_CHARS = 12  # shown; any unique prefix is accepted


@plans_app.callback()
def _plans(ctx: typer.Context) -> None:
    """List and remove the plans built on the fly (bench --model, LLM(model=...)); alone: list them."""
    if ctx.invoked_subcommand is None:
        list_plans(None)


@plans_app.command("list", cls=KvtoolCommand)
def list_plans(plan_cache_dir: CacheDir = None) -> None:
    """Every cached plan with its source, block size, dtype, size and creation time."""
    with user_errors():
        from kvtool.plan.cache import cached_plans, default_cache_dir

        cache_dir = plan_cache_dir or default_cache_dir()
        entries = cached_plans(cache_dir)
        console = Console()
        if not entries:
            console.print(f"no cached plans in {cache_dir}", highlight=False)
            return
        table = Table(title=f"cached plans in {cache_dir}", title_justify="left")
        table.add_column("id", no_wrap=True)
        table.add_column("source", overflow="fold")
        for column in ("block", "dtype", "size", "created"):
            table.add_column(column, no_wrap=True)
        for entry in entries:
            table.add_row(entry.plan_id[:ID_CHARS], entry.source, str(entry.tokens_per_block or "-"),
                          entry.dtype or "-",
                          format_bytes(entry.size_bytes), entry.created_at[:16].replace("T", " ") or "-")
        console.print(table)
        console.print(f"{len(entries)} plan{'s' if len(entries) != 1 else ''}, {format_bytes(sum(e.size_bytes for e in entries))}; remove with "
                      "`kvtool plans remove ID...` or `kvtool plans remove --all`", highlight=False)


@plans_app.command("remove", cls=KvtoolCommand)
def remove_plans(
    plan_ids: Annotated[list[str] | None, typer.Argument(help="Ids (or unique prefixes) from `kvtool plans list`.",
                                                         show_default=False)] = None,
    all_: Annotated[bool, toggle("all", "Remove every cached plan.")] = False,
    plan_cache_dir: CacheDir = None,
) -> None:
    """Remove cached plans (they are rebuilt when next used)."""
    with user_errors():
        from kvtool.plan.cache import cached_plans, default_cache_dir, remove_cached_plan, select_cached_plans

        cache_dir = plan_cache_dir or default_cache_dir()
        if all_ == bool(plan_ids):
            raise ValueError("give the ids of the plans to remove (see `kvtool plans list`) or --all"
                             + (", not both" if all_ else ""))
        entries = cached_plans(cache_dir) if all_ else select_cached_plans(cache_dir, plan_ids)
        for entry in entries:
            remove_cached_plan(entry)
            typer.echo(f"removed {entry.plan_id} ({entry.source}, {format_bytes(entry.size_bytes)})")
        typer.echo(f"freed {format_bytes(sum(e.size_bytes for e in entries))} in {cache_dir}")
