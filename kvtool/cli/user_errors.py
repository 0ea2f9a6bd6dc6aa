"""Turns user mistakes into a one-line message and exit code 2, never a traceback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer
from rich.console import Console
from rich.markup import escape

from kvtool.errors import KvtoolError

# What a user can cause by a bad flag, file or value; an OSError (permission denied, read-only file
# system, no space left) is about a path the user gave or the machine. Anything else is our bug
# and keeps its traceback.
USER_ERRORS = (KvtoolError, ValueError, OSError)


def error_message(error: BaseException) -> str:
    """One line: an OS error names its path and the reason (a read-only file system, a full disk, ...);
    a bad build option names its flag, not the Python field."""
    if isinstance(error, OSError) and error.strerror and error.filename:
        return f"{error.filename}: {error.strerror.lower()}: check the path and its permissions"
    if isinstance(error, ValueError):
        from kvtool.config import ConfigError  # the C++ extension loads only when an error needs it

        if isinstance(error, ConfigError) and error.owner == "BuildOptions":
            # Each BuildOptions field is the `kvtool build` flag of its name, and the same flag of bench,
            # simulate and serve where they build --model on the fly.
            return f"--{error.field} {error.problem}"
    return str(error)


def print_error(error: BaseException) -> None:
    # escape: a message may hold brackets (pip install 'kvtool[gguf]') that are not rich markup.
    Console(stderr=True).print(f"[bold red]Error:[/] {escape(error_message(error))}", highlight=False,
                               soft_wrap=True)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    try:
        yield
    except USER_ERRORS as error:
        print_error(error)
        raise typer.Exit(code=2) from None
