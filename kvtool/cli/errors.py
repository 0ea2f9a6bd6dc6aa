"""Turns user mistakes into a one-line message and exit code 2, never a traceback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer
from rich.console import Console
from rich.markup import escape

from kvtool.errors import KvtoolError

# What a user can cause by a bad flag, file or value. Anything else is our bug and keeps its traceback.
USER_ERRORS = (KvtoolError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
               PermissionError)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    try:
        yield
    except USER_ERRORS as error:
        # escape: a message may hold brackets (pip install 'kvtool[gguf]') that are not rich markup.
        Console(stderr=True).print(f"[bold red]Error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from None
