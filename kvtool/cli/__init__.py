"""The `kvtool` command line: thin typer commands over the library."""

from __future__ import annotations

import typer

from kvtool.cli.typer_options import normalize_option
from kvtool.version import __version__, git_revision

app = typer.Typer(
    name="kvtool",
    help="Build models into plans and benchmark KV-cache reuse with real model execution.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # --tokens-per-block is --tokens_per_block: one spelling in the help, both accepted.
    context_settings={"token_normalize_func": normalize_option},
)


@app.callback()
def _root() -> None:
    """Build models into plans and benchmark KV-cache reuse with real model execution."""


@app.command()
def version() -> None:
    """Print kvtool's version and git revision."""
    typer.echo(f"kvtool {__version__} ({git_revision()})")


def _register_commands() -> None:
    # Each command lives in its own module; importing it registers it on `app`.
    from kvtool.cli import bench, build, compare, dataset, generate, plans, serve, simulate  # noqa: F401


_register_commands()


def main() -> None:
    app()
