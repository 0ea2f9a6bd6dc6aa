"""Stop signals: SIGTERM ends a run the way Ctrl-C does.

Schedulers and supervisors stop a process with SIGTERM (timeout(1), Slurm, Kubernetes, CI cancels),
a user with Ctrl-C (SIGINT). Python turns only SIGINT into an exception (KeyboardInterrupt); SIGTERM
would kill the process on the spot, before it writes the summary of what finished. Inside
``stop_signals()`` SIGTERM raises ``Stopped``, a KeyboardInterrupt, so every path that keeps the
finished requests on Ctrl-C keeps them on SIGTERM too, and the process exits 128 + the signal's
number, as a shell reports a process the signal killed.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """A stop signal other than SIGINT, raised as Ctrl-C's KeyboardInterrupt is."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_name(stop: BaseException) -> str:
    """'SIGTERM' for a Stopped, 'SIGINT' for a plain KeyboardInterrupt (Ctrl-C)."""
    return signal.Signals(getattr(stop, "signum", signal.SIGINT)).name


@dataclass
class StopRecord:
    """The SIGTERM a command received (None: none, or only Ctrl-C's SIGINT, which Python raises itself)."""

    signum: int | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGINT).name

    @property
    def exit_code(self) -> int:
        """128 + the signal's number: 130 for Ctrl-C, 143 for SIGTERM."""
        return 128 + (self.signum or signal.SIGINT)


@contextlib.contextmanager
def stop_signals() -> Iterator[StopRecord]:
    """While the block runs, the first SIGTERM raises ``Stopped`` (a KeyboardInterrupt, as Ctrl-C raises)
    in the main thread, and the record says it came; a repeated one is ignored while the run stops and
    writes its summary. The previous handler is put back after. A SIGTERM the process was started
    ignoring stays ignored, and outside the main thread (where Python cannot set handlers) nothing
    changes."""
    record = StopRecord()
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) == signal.SIG_IGN):
        yield record
        return

    def handler(signum: int, frame) -> None:
        if record.signum is not None:
            return  # already stopping (a supervisor may repeat it): let the summary be written
        record.signum = signum
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield record
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Stop signals that arrive while the block runs are held back by the OS and delivered when it ends,
    so their KeyboardInterrupt cannot cut a file write in two (nothing changes where the platform
    cannot block signals)."""
    block = getattr(signal, "pthread_sigmask", None)
    if block is None:
        yield
        return
    previous = block(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        block(signal.SIG_SETMASK, previous)
