"""The third KV tier's data plane: what a stored block carries, the plan identity in every key, the
interface of the two stores (kvtool.runtime.disk_store, kvtool.runtime.remote_store) and running a
step's copies into and out of them.

The C++ cache manager decides every move (docs/architecture.md#kv-cache-rules): a copy from the host
tier into the third tier (a spill) or back (a staging fetch) comes as a CopyOp whose pool is
PoolKind.DISK or PoolKind.REMOTE, with its block's 32-byte key in CopyOpArrays.tier3_keys. A store
keeps the key and the plan identity beside the value, so a value that is not the block asked for (a
truncated or colliding store key, a file of another run, another model's block) is never used: the
fetch fails, and a failed fetch is a miss, never a wrong token.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, fields
from typing import Any, Protocol

import numpy as np
import torch

from kvtool._core import PoolKind

# A stored block: header, then the block's bytes ([num_layers, 2, tokens_per_block, kv_heads, head_dim]).
HEADER_MAGIC = b"KVTIER3\x01"
HEADER = struct.Struct("<8s32s32sQ")  # magic, plan digest, block key, payload bytes
HEADER_BYTES = HEADER.size  # 80
KEY_FORMAT = "kvtool-kv-block-key-v1"  # bump when the key derivation or the block layout changes


def plan_digest(*, weights_digest: str, kv_dtype: torch.dtype | str, tokens_per_block: int, num_layers: int,
                num_kv_heads: int, head_dim: int) -> bytes:
    """The 32-byte identity of a plan's KV, mixed into every third-tier key (CacheConfig.plan_digest).

    Two plans share blocks only when everything that makes their KV identical is equal: the weights
    (their sha256: the same architecture with other weights gives other KV), the KV dtype, the block
    size and the KV shape. A tenant's cache salt, the LoRA task and extra ids are in each block's key.
    """
    identity = {"format": KEY_FORMAT, "weights": weights_digest, "kv_dtype": str(kv_dtype).removeprefix("torch."),
                "tokens_per_block": tokens_per_block, "num_layers": num_layers, "num_kv_heads": num_kv_heads,
                "head_dim": head_dim}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()


def pack_header(plan: bytes, key: bytes, payload_bytes: int) -> bytes:
    return HEADER.pack(HEADER_MAGIC, plan, key, payload_bytes)


def header_problem(header: bytes | memoryview, plan: bytes, key: bytes, payload_bytes: int) -> str | None:
    """Why a stored block is not the one asked for (None: it is)."""
    if len(header) < HEADER_BYTES:
        return "short"
    magic, stored_plan, stored_key, stored_bytes = HEADER.unpack_from(header)
    if magic != HEADER_MAGIC:
        return "not a kvtool block"
    if stored_plan != plan:
        return "another plan's block"
    if stored_key != key:
        return "another block's key"
    if stored_bytes != payload_bytes:
        return "another block size"
    return None


def block_bytes_view(block: torch.Tensor) -> np.ndarray:
    """The bytes of a host block (any dtype, bfloat16 too) as a uint8 array sharing its memory."""
    return block.reshape(-1).view(torch.uint8).numpy()


@dataclass
class StoreCounters:
    """What a store did since it was opened; failures are misses, never errors."""

    num_writes: int = 0            # blocks handed to the store (spills)
    num_written_bytes: int = 0     # of them, bytes that reached it
    num_write_failures: int = 0    # refused or lost writes (a full store, a server down, a disk error)
    num_reads: int = 0             # blocks fetched back into the host tier
    num_read_bytes: int = 0
    num_read_failures: int = 0     # fetches that found nothing usable: a miss
    num_verify_failures: int = 0   # of those, values that were not the block asked for
    num_lookups: int = 0           # count_present calls
    num_lookup_failures: int = 0   # lookups that could not ask the store (nothing staged)
    num_timeouts: int = 0          # calls cut by the store's timeout

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Tier3Store(Protocol):
    """A third-tier store (DiskStore or RemoteStore). ``slot`` is the manager's block id (a disk
    slot; a remote index entry, or -1); ``key`` the block's 32-byte key."""

    pool: PoolKind
    block_bytes: int
    counters: StoreCounters

    def count_present(self, keys: list[bytes]) -> int | None:
        """How many of the leading keys the store holds; None when it cannot be asked now (then
        nothing is staged: a failed lookup must not make the manager forget blocks)."""

    def write(self, slot: int, key: bytes, block: torch.Tensor) -> None:
        """Stores a host block: its bytes are copied before this returns; the write may finish later."""

    def read(self, requests: list[tuple[int, bytes, torch.Tensor]]) -> list[bool]:
        """Fetches (slot, key, host block) requests in one batch; False where the fetch failed."""

    def flush(self) -> None:
        """Waits for every write handed over so far."""

    def close(self) -> None:
        """Flushes, then releases the files or the connection."""


class WriteQueue:
    """Writes a store hands over on the step path, done in batches by one background thread (or at
    once, without one). An entry stays readable (``get``) until written, so a fetch of a block whose
    write is still queued is served from it; a newer write of the same key replaces a queued one.

    ``write_batch([(key, value), ...])`` does the writes; ``release(value)`` is called for every value
    once it is written or replaced (a disk store reuses its staging buffers)."""

    def __init__(self, name: str, write_batch: Callable[[list[tuple[Hashable, Any]]], None], *, max_pending: int,
                 max_batch: int, thread: bool = True, release: Callable[[Any], None] = lambda value: None) -> None:
        self._write_batch = write_batch
        self._release = release
        self._max_pending = max(2, max_pending)
        self._max_batch = max_batch
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pending: dict[Hashable, Any] = {}  # key -> value not written yet
        self._queued: dict[Hashable, None] = {}  # keys of pending values not taken by the writer (in order)
        self._in_flight = 0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True) if thread else None
        if self._thread is not None:
            self._thread.start()

    def put(self, key: Hashable, value: Any) -> None:
        if self._thread is None:
            self._write_batch([(key, value)])
            self._release(value)
            return
        with self._lock:
            while len(self._pending) + self._in_flight >= self._max_pending:
                self._changed.wait()  # the writer is behind: the step waits rather than grow memory
            old = self._pending.get(key)
            if old is not None and key in self._queued:
                self._release(old)  # never taken: replaced before it was written
            self._pending[key] = value
            self._queued[key] = None
            self._changed.notify_all()

    def read_pending(self, key: Hashable, read: Callable[[Any], Any]) -> tuple[bool, Any]:
        """(True, read(value)) when the key's write is still queued (read under the queue's lock: the
        value is neither written nor reused meanwhile), else (False, None)."""
        with self._lock:
            value = self._pending.get(key)
            return (False, None) if value is None else (True, read(value))

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._pending

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._queued and not self._closed:
                    self._changed.wait()
                if not self._queued:
                    return
                keys = list(self._queued)[:self._max_batch]
                for key in keys:
                    del self._queued[key]
                batch = [(key, self._pending[key]) for key in keys]
                self._in_flight = len(batch)
            self._write_batch(batch)
            with self._lock:
                for key, value in batch:
                    if self._pending.get(key) is value:
                        del self._pending[key]
                    self._release(value)  # written (a newer value of the key stays queued)
                self._in_flight = 0
                self._changed.notify_all()

    def flush(self) -> None:
        with self._lock:
            while self._queued or self._in_flight:
                self._changed.wait()

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._closed = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join()


def run_copies(ops, pools, store: Tier3Store | None) -> list[int]:
    """Runs a step's copy operations in their order: those of the primary and host tiers on the
    KvCachePools, those into and out of the third tier on the store. Consecutive fetches go to the
    store as one batch. Returns the host blocks whose fetch failed, for complete_staging."""
    src_pool, dst_pool = ops.src_pool, ops.dst_pool
    third = [int(p) in (PoolKind.DISK.value, PoolKind.REMOTE.value) for p in src_pool] if len(ops) else []
    third = [t or int(d) in (PoolKind.DISK.value, PoolKind.REMOTE.value) for t, d in zip(third, dst_pool)]
    if not any(third):
        pools.execute_copies(src_pool, ops.src_block_ids, dst_pool, ops.dst_block_ids, ops.num_tokens)
        return []
    if store is None:
        raise RuntimeError("copy operations into or out of the third tier, but no third-tier store is open")
    keys = iter(ops.tier3_keys)
    failed: list[int] = []
    fetches: list[tuple[int, bytes, torch.Tensor, int]] = []

    def fetch_batch() -> None:
        if fetches:
            synchronize_host(pools)  # earlier copies that read these host blocks are done
            results = store.read([(slot, key, block) for slot, key, block, _ in fetches])
            failed.extend(host for (_, _, _, host), ok in zip(fetches, results) if not ok)
            fetches.clear()

    i, n = 0, len(ops)
    while i < n:
        if not third[i]:
            j = i
            while j < n and not third[j]:
                j += 1
            fetch_batch()
            pools.execute_copies(src_pool[i:j], ops.src_block_ids[i:j], dst_pool[i:j], ops.dst_block_ids[i:j],
                                 ops.num_tokens[i:j])
            i = j
            continue
        key = next(keys)
        if int(dst_pool[i]) == PoolKind.SECONDARY.value:  # a fetch into the host tier
            host = int(ops.dst_block_ids[i])
            fetches.append((int(ops.src_block_ids[i]), key, pools.host.block(host), host))
        else:  # a spill: the host block's bytes are read now, before a later copy overwrites it
            fetch_batch()
            synchronize_host(pools)
            store.write(int(ops.dst_block_ids[i]), key, pools.host.block(int(ops.src_block_ids[i])))
        i += 1
    fetch_batch()
    return failed


def synchronize_host(pools) -> None:
    """Waits until the host blocks hold what the copies issued so far wrote (GPU offloads are
    asynchronous); a store reads them on the host."""
    pools.wait_for_all_copies()
    if pools.device.type == "cuda":
        torch.cuda.current_stream(pools.device).synchronize()
