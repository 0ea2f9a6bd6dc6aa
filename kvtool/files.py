"""Files kvtool writes whole: written beside the target, then renamed over it (atomic), with the
permissions the user's umask gives a new file (mkstemp / mkdtemp alone would leave 0600 / 0700,
which other users and tools cannot read)."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from kvtool.errors import KvtoolError

# What to do about a write that failed, by its errno.
_FIXES = {
    errno.ENOSPC: "free space on that file system, or give --output a directory on another one",
    getattr(errno, "EDQUOT", -1): "free space within your disk quota, or give --output a directory on another file system",
    errno.EFBIG: "the file grew past the size this process may write (ulimit -f) or its file system allows: "
                 "raise the limit, or give --output a directory on another file system",
    errno.EROFS: "give --output a directory on a writable file system",
    errno.EACCES: "give --output a directory you may write to",
    errno.EPERM: "give --output a directory you may write to",
    errno.EIO: "the disk reported an error: check it, or give --output a directory on another one",
}
_OTHER_FIX = "check the path, its permissions and its file system"


class FileWriteError(KvtoolError):
    """A file kvtool writes could not be written (a full disk, a quota, a read-only file system):
    the message names the file, what the OS said, what the file holds now, and the fix."""

    def __init__(self, path: str | os.PathLike, error: OSError, kept: str = "",
                 more: tuple[tuple[Path, str], ...] = ()) -> None:
        self.os_error = error
        self.files: tuple[tuple[Path, str], ...] = ((Path(path), kept), *more)  # (file, what it holds now)
        names = " nor ".join(f"{file}{f' ({held})' if held else ''}" for file, held in self.files)
        reason = (error.strerror or str(error)).lower()
        super().__init__(f"cannot write {names}: {reason}: {_FIXES.get(error.errno, _OTHER_FIX)}")

    @property
    def path(self) -> Path:
        return self.files[0][0]

    def joined(self, later: KvtoolError) -> KvtoolError:
        """This error and a later one in one message: one sentence when the later one is the same failure
        (the disk still full) on another file."""
        if isinstance(later, FileWriteError) and later.os_error.errno == self.os_error.errno:
            (path, kept), *more = self.files + later.files
            return FileWriteError(path, self.os_error, kept, tuple(more))
        return KvtoolError(f"{self}; {later}")


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
    previous file or the new one, never half of it. ``fsync``: flush to the disk before the rename.
    A write the OS refuses (a full disk, ...) is a FileWriteError naming ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        handle, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise FileWriteError(path, error, _kept(path)) from None
    try:
        os.fchmod(handle, new_file_mode())
        with os.fdopen(handle, "w", newline=newline, encoding="utf-8") as out:
            yield out
            out.flush()
            if fsync:
                os.fsync(out.fileno())
        os.replace(tmp_name, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            Path(tmp_name).unlink(missing_ok=True)
        if isinstance(error, OSError) and not error.filename:  # the write's own error: name the file
            raise FileWriteError(path, error, _kept(path)) from None
        raise


def _kept(path: Path) -> str:
    return "the previous file is kept" if path.exists() else "nothing written"


def staging_dir(target: Path, label: str) -> Path:
    """A new empty directory beside ``target`` (to build in, then rename over it), with the umask's
    permissions."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.{label}-", dir=target.parent))
    staging.chmod(new_dir_mode())
    return staging
