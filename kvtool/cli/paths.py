"""Checks, before any work starts, that the paths a user gives can be written: a bench that runs
for an hour must not fail at the end on a read-only directory."""

from __future__ import annotations

import tempfile
from pathlib import Path

from kvtool.errors import KvtoolError


def _nearest_existing(path: Path) -> Path:
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


def _can_create_files_in(directory: Path, flag: str, path: Path) -> None:
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        reason = (error.strerror or str(error)).lower()
        raise KvtoolError(f"{flag} {path}: cannot write in {directory} ({reason}): choose a directory you can "
                          "write to") from None


def _check_dir_can_hold(directory: Path, flag: str, path: Path) -> None:
    """``directory`` exists or can be created, and accepts new files (errors name the user's ``path``)."""
    existing = _nearest_existing(directory)
    if not existing.is_dir():
        raise KvtoolError(f"{flag} {path}: {existing} is a file, so no directory can be made under it: "
                          "choose another path")
    _can_create_files_in(existing, flag, path)


def check_writable_dir(path: str | Path, flag: str) -> Path:
    """``path`` is a directory kvtool can write files in, or one it can create."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise KvtoolError(f"{flag} {path} is a file, not a directory: give a directory path")
    _check_dir_can_hold(path, flag, path)
    return path


def check_writable_file(path: str | Path, flag: str, example: str = "out") -> Path:
    """``path`` names a file kvtool can create or replace (its directory may not exist yet)."""
    path = Path(path)
    if path.is_dir():
        raise KvtoolError(f"{flag} {path} is a directory: give a file path, e.g. {path / example}")
    _check_dir_can_hold(path.parent, flag, path)
    return path


def check_replaceable_dir(path: str | Path, flag: str) -> Path:
    """``path`` is a directory kvtool builds beside and then renames into place (a plan): not a file,
    and its parent accepts new entries."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise KvtoolError(f"{flag} {path} is a file, not a directory: give a directory path")
    _check_dir_can_hold(path.parent, flag, path)
    return path
