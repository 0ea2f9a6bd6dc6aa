"""The disk tier: third-tier block slots in large preallocated files of one directory, private to
one engine (a lock file keeps a second engine out).

Each slot holds a header (tier3_store.HEADER: magic, plan digest, the block's key, its size) and the
block's bytes, padded to whole 4 KiB pages so every read and write is page-aligned (O_DIRECT when
the file system allows it: the tier is meant to outgrow host memory, and going through the page
cache would spend the host memory the host tier wants). A spill copies the block into a page-aligned
staging buffer and returns; a writer thread writes the queued slots in offset order, adjacent slots
in one pwritev, off the step path (results/tiers.md has what it saves). A fetch of a slot whose
write is still queued is served from its buffer. Fetches of a staging are read in offset order,
adjacent slots in one preadv.

Blocks do not survive a restart: the files are truncated and preallocated anew when the store opens.
The disk tier's index is the cache manager's prefix tree (which blocks are in which slot, with their
tokens), and it lives in the process; a file of an earlier run could only be trusted with that tree
rebuilt from it and checked against the plan. Every slot keeps its key and the plan digest, so that
is possible later; meanwhile a stale file is never read, because it is emptied first.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from pathlib import Path

import numpy as np
import torch

from kvtool._core import PoolKind
from kvtool.runtime.tier3_store import (HEADER_BYTES, StoreCounters, WriteQueue, block_bytes_view,
                                        header_problem, pack_header)

PAGE_BYTES = 4096
FILE_BYTES = 1 << 30  # slots are spread over files of about this size
MAX_PENDING_BYTES = 256 << 20  # queued writes beyond this make a spill wait for the writer
MAX_IO_SLOTS = 64  # adjacent slots per pwritev / preadv
LOCK_FILE = "kv-tier3.lock"


class DiskStoreError(ValueError):
    """The directory cannot hold the disk tier; the message names it and the fix."""


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class DiskStore:
    """``num_blocks`` slots of ``block_bytes`` bytes under ``directory`` (created if missing)."""

    pool = PoolKind.DISK

    def __init__(self, directory: str | os.PathLike, num_blocks: int, block_bytes: int, plan_digest: bytes, *,
                 file_bytes: int = FILE_BYTES, direct_io: bool = True, writer_thread: bool = True,
                 max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        if num_blocks <= 0 or block_bytes <= 0:
            raise DiskStoreError(f"a disk tier of {num_blocks} blocks of {block_bytes} bytes holds nothing: "
                                 "give it at least one block")
        self.directory = Path(directory)
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.plan_digest = plan_digest
        self.slot_bytes = round_up(HEADER_BYTES + block_bytes, PAGE_BYTES)
        self.slots_per_file = max(1, file_bytes // self.slot_bytes)
        self.counters = StoreCounters()
        self._open_directory()
        num_files = -(-num_blocks // self.slots_per_file)
        self.direct_io = direct_io
        self._fds = [self._open_file(f, min(self.slots_per_file, num_blocks - f * self.slots_per_file))
                     for f in range(num_files)]
        self._lock = threading.Lock()  # the slots' state below
        self._free_buffers: list[mmap.mmap] = []
        self._bad_slots: set[int] = set()  # slots whose last write failed
        self._slot_key: dict[int, bytes] = {}
        self._key_slot: dict[bytes, int] = {}
        self._read_lock = threading.Lock()
        self._read_buffer: mmap.mmap | None = None  # reused: a fresh mapping page-faults on every read
        self._closed = False
        self._queue = WriteQueue("kvtool-disk-tier", self._write_batch, max_pending=max_pending_bytes // self.slot_bytes,
                                 max_batch=4 * MAX_IO_SLOTS, thread=writer_thread, release=self._free_buffer)

    # -- files ------------------------------------------------------------------------------
    def _open_directory(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise DiskStoreError(f"cannot use {self.directory} for the disk tier: {error.strerror}; "
                                 "give a writable directory") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise DiskStoreError(f"{self.directory} holds the disk tier of another running engine: give each "
                                 "engine a directory of its own") from None

    def _open_file(self, index: int, num_slots: int) -> int:
        """Truncates and preallocates one file (a stale file of an earlier run is emptied first)."""
        path = self.directory / f"kv-tier3-{index:04d}.bin"
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        fd = None
        if self.direct_io and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as error:
                if error.errno != errno.EINVAL:  # EINVAL: the file system has no direct I/O (tmpfs)
                    raise
                self.direct_io = False
        if fd is None:
            self.direct_io = False
            fd = os.open(path, flags, 0o644)
        try:
            os.posix_fallocate(fd, 0, num_slots * self.slot_bytes)
        except OSError as error:
            os.close(fd)
            raise DiskStoreError(f"cannot preallocate {num_slots * self.slot_bytes} bytes in {path}: "
                                 f"{error.strerror}; free disk space or give a smaller disk tier") from None
        return fd

    def _place(self, slot: int) -> tuple[int, int]:
        file, index = divmod(slot, self.slots_per_file)
        return self._fds[file], index * self.slot_bytes

    # -- writes -----------------------------------------------------------------------------
    def _buffer(self) -> mmap.mmap:
        """A page-aligned staging buffer of one slot (anonymous mappings start on a page), reused."""
        with self._lock:
            if self._free_buffers:
                return self._free_buffers.pop()
        return mmap.mmap(-1, self.slot_bytes)

    def _free_buffer(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._free_buffers.append(buf)

    def write(self, slot: int, key: bytes, block: torch.Tensor) -> None:
        buf = self._buffer()
        buf[:HEADER_BYTES] = pack_header(self.plan_digest, key, self.block_bytes)
        np.frombuffer(buf, np.uint8, self.block_bytes, HEADER_BYTES)[:] = block_bytes_view(block)
        with self._lock:
            self._remember(slot, key)
            self.counters.num_writes += 1
        self._queue.put(slot, buf)

    def _remember(self, slot: int, key: bytes) -> None:
        old = self._slot_key.pop(slot, None)
        if old is not None and self._key_slot.get(old) == slot:
            del self._key_slot[old]
        self._slot_key[slot] = key
        self._key_slot[key] = slot

    def _write_batch(self, batch: list[tuple[int, mmap.mmap]]) -> None:
        """Writes slots in offset order, each run of adjacent slots in one pwritev."""
        for run in self._runs(sorted(batch, key=lambda item: item[0])):
            fd, offset = self._place(run[0][0])
            try:
                ok = os.pwritev(fd, [buf for _, buf in run], offset) == len(run) * self.slot_bytes
            except OSError:
                ok = False
            with self._lock:
                for slot, _ in run:
                    if ok:
                        self._bad_slots.discard(slot)
                    else:
                        self._bad_slots.add(slot)  # read back as a miss
                if ok:
                    self.counters.num_written_bytes += len(run) * self.block_bytes
                else:
                    self.counters.num_write_failures += len(run)

    def _runs(self, items):
        """Runs of adjacent slots of one file, in offset order, at most MAX_IO_SLOTS long."""
        run = []
        for slot, buf in items:
            if run and (slot != run[-1][0] + 1 or slot % self.slots_per_file == 0 or len(run) == MAX_IO_SLOTS):
                yield run
                run = []
            run.append((slot, buf))
        if run:
            yield run

    def flush(self) -> None:
        self._queue.flush()

    # -- reads ------------------------------------------------------------------------------
    def count_present(self, keys: list[bytes]) -> int:
        self.counters.num_lookups += 1
        with self._lock:
            for i, key in enumerate(keys):
                slot = self._key_slot.get(key)
                if slot is None or slot in self._bad_slots:
                    return i
        return len(keys)

    def read(self, requests: list[tuple[int, bytes, torch.Tensor]]) -> list[bool]:
        results = [False] * len(requests)
        from_disk = []
        for i, (slot, key, out) in enumerate(requests):
            queued, ok = self._queue.read_pending(slot, lambda buf: self._take(buf, key, out))
            if queued:  # its write is still queued: the buffer is the slot
                results[i] = ok
            elif 0 <= slot < self.num_blocks and slot not in self._bad_slots:
                from_disk.append((slot, i))
        with self._read_lock:
            for run in self._runs(sorted(from_disk)):
                fd, offset = self._place(run[0][0])
                run_bytes = len(run) * self.slot_bytes
                if self._read_buffer is None:
                    self._read_buffer = mmap.mmap(-1, MAX_IO_SLOTS * self.slot_bytes)
                with memoryview(self._read_buffer)[:run_bytes] as buf:
                    try:
                        num_read = os.preadv(fd, [buf], offset)
                    except OSError:
                        num_read = 0
                    for k, (slot, i) in enumerate(run):
                        if num_read >= (k + 1) * self.slot_bytes:
                            with buf[k * self.slot_bytes:(k + 1) * self.slot_bytes] as view:
                                results[i] = self._take(view, requests[i][1], requests[i][2])
        with self._lock:
            self.counters.num_reads += len(requests)
            self.counters.num_read_failures += results.count(False)
            self.counters.num_read_bytes += results.count(True) * self.block_bytes
        return results

    def _take(self, slot_bytes, key: bytes, out: torch.Tensor) -> bool:
        """Copies a slot's block into a host block when its header says it is the block asked for."""
        if header_problem(slot_bytes[:HEADER_BYTES], self.plan_digest, key, self.block_bytes) is not None:
            self.counters.num_verify_failures += 1
            return False
        block_bytes_view(out)[:] = np.frombuffer(slot_bytes, np.uint8, self.block_bytes, HEADER_BYTES)
        return True

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.close()
        for fd in self._fds:
            os.close(fd)
        if self._read_buffer is not None:
            self._read_buffer.close()
        os.close(self._lock_fd)  # releases the directory's lock
        self._fds = []

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
