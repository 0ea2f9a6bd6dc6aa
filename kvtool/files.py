"""Files kvtool writes whole: written beside the target, then renamed over it (atomic), with the
permissions the user's umask gives a new file (mkstemp / mkdtemp alone would leave 0600 / 0700,
which other users and tools cannot read)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """What open() gives a new file under the current umask (0644 for the usual 022)."""
    return 0o666 & ~current_umask()


def new_dir_mode() -> int:
    """What mkdir() gives a new directory under the current umask (0755 for the usual 022)."""
    return 0o777 & ~current_umask()


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, *, newline: str | None = None, fsync: bool = False) -> Iterator[IO[str]]:
    """A text file handle whose content replaces ``path`` only when the block completes: readers see the
    previous file or the new one, never half of it. ``fsync``: flush to the disk before the rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(handle, new_file_mode())
        with os.fdopen(handle, "w", newline=newline, encoding="utf-8") as out:
            yield out
            out.flush()
            if fsync:
                os.fsync(out.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def staging_dir(target: Path, label: str) -> Path:
    """A new empty directory beside ``target`` (to build in, then rename over it), with the umask's
    permissions."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.{label}-", dir=target.parent))
    staging.chmod(new_dir_mode())
    return staging
