"""The remote tier: third-tier blocks in a Redis or Valkey server that several engines share.

A block is stored under ``kvtool:kv:<hex of its 32-byte key>`` (the key chains the plan identity and
every block of the prefix with the LoRA task id, cache salt and extra ids: two models or two tenants
never share a key). The value is tier3_store's header (plan digest, the full key, size) and the
block's bytes; a value whose header is not the block asked for (a store key shortened or mistaken,
another plan's block) is refused.

The store's index is its own: a lookup (EXISTS, pipelined) finds blocks other engines stored, and
the server evicts what it likes. Every failure of the server (killed, restarting, slower than
``timeout_s``, refusing writes when full: maxmemory with noeviction) is a counted miss, never an
exception on the step path or a wrong token. After a connection failure the store is not asked again
for ``retry_after_s``, so a dead server costs one timeout, not one per block. Spills are copied into
a bytes value and sent by a writer thread in pipelined batches, off the step path; a fetch of a key
whose write is still queued is served from it.

Needs the ``redis`` package: ``pip install 'kvtool[remote]'``.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvtool._core import PoolKind
from kvtool.runtime.tier3_store import (HEADER_BYTES, StoreCounters, WriteQueue, block_bytes_view, header_problem,
                                        pack_header)

KEY_PREFIX = "kvtool:kv:"
TIMEOUT_S = 0.5
RETRY_AFTER_S = 1.0
MAX_PENDING_BYTES = 256 << 20  # queued writes beyond this make a spill wait for the writer
MAX_BATCH = 64  # commands per pipeline


class RemoteStoreError(ValueError):
    """The remote tier cannot be set up as given; the message names what and the fix."""


class RemoteStore:
    """A third-tier store in the Redis / Valkey server at ``url`` (redis://host:port[/db])."""

    pool = PoolKind.REMOTE

    def __init__(self, url: str, block_bytes: int, plan_digest: bytes, *, timeout_s: float = TIMEOUT_S,
                 retry_after_s: float = RETRY_AFTER_S, writer_thread: bool = True,
                 max_pending_bytes: int = MAX_PENDING_BYTES, key_prefix: str = KEY_PREFIX,
                 key_bytes: int = 32) -> None:
        """``key_bytes`` < 32 shortens the store keys (a test hook: blocks then collide in the store,
        and the header check must refuse the wrong ones)."""
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise RemoteStoreError("the remote tier needs the redis package: pip install 'kvtool[remote]'") from None
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise RemoteStoreError(f"remote cache URL {url!r} is not a Redis URL: use redis://host:port")
        if timeout_s <= 0:
            raise RemoteStoreError(f"timeout_s={timeout_s} must be positive")
        self.url = url
        self.block_bytes = block_bytes
        self.plan_digest = plan_digest
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.key_prefix = key_prefix.encode()
        self.key_bytes = key_bytes
        self.counters = StoreCounters()
        self._redis = redis
        try:  # no retries of its own: a failure is a miss at once, and the store rests (retry_after_s)
            self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                                retry=Retry(NoBackoff(), 0), health_check_interval=0)
        except ValueError as error:
            raise RemoteStoreError(f"remote cache URL {url!r}: {error}") from None
        self._down_until = 0.0
        self._closed = False
        self._queue = WriteQueue("kvtool-remote-tier", self._send,
                                 max_pending=max_pending_bytes // (HEADER_BYTES + block_bytes), max_batch=MAX_BATCH,
                                 thread=writer_thread)

    def store_key(self, key: bytes) -> bytes:
        return self.key_prefix + key[:self.key_bytes].hex().encode()

    # -- failures ---------------------------------------------------------------------------
    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, error: Exception) -> None:
        """A connection failure or timeout: the server is not asked again for retry_after_s."""
        if isinstance(error, self._redis.exceptions.TimeoutError):
            self.counters.num_timeouts += 1
        if isinstance(error, (self._redis.exceptions.ConnectionError, self._redis.exceptions.TimeoutError)):
            self._down_until = time.monotonic() + self.retry_after_s

    def ping(self) -> bool:
        """Whether the server answers now."""
        try:
            return bool(self._client.ping())
        except self._redis.exceptions.RedisError as error:
            self._failed(error)
            return False

    # -- lookups and fetches ----------------------------------------------------------------
    def count_present(self, keys: list[bytes]) -> int | None:
        self.counters.num_lookups += 1
        if not keys:
            return 0
        if not self._available():
            self.counters.num_lookup_failures += 1
            return None
        store_keys = [self.store_key(k) for k in keys]
        queued = [k in self._queue for k in store_keys]
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in store_keys:
                pipe.exists(k)
            found = pipe.execute()
        except self._redis.exceptions.RedisError as error:
            self._failed(error)
            self.counters.num_lookup_failures += 1
            return None
        return next((i for i, (f, q) in enumerate(zip(found, queued)) if not (f or q)), len(keys))

    def read(self, requests: list[tuple[int, bytes, torch.Tensor]]) -> list[bool]:
        results = [False] * len(requests)
        wanted = []
        for i, (_, key, out) in enumerate(requests):
            queued, ok = self._queue.read_pending(self.store_key(key), lambda value: self._take(value, key, out))
            if queued:  # its write is still queued
                results[i] = ok
            else:
                wanted.append(i)
        if wanted and self._available():
            try:
                values = self._client.mget([self.store_key(requests[i][1]) for i in wanted])
            except self._redis.exceptions.RedisError as error:
                self._failed(error)
                values = [None] * len(wanted)
            for i, value in zip(wanted, values):
                if value is not None:
                    results[i] = self._take(value, requests[i][1], requests[i][2])
        self.counters.num_reads += len(requests)
        self.counters.num_read_failures += results.count(False)
        self.counters.num_read_bytes += results.count(True) * self.block_bytes
        return results

    def _take(self, value: bytes, key: bytes, out: torch.Tensor) -> bool:
        if len(value) != HEADER_BYTES + self.block_bytes or header_problem(value, self.plan_digest, key,
                                                                          self.block_bytes) is not None:
            self.counters.num_verify_failures += 1
            return False
        block_bytes_view(out)[:] = np.frombuffer(value, np.uint8, self.block_bytes, HEADER_BYTES)
        return True

    # -- writes -----------------------------------------------------------------------------
    def write(self, slot: int, key: bytes, block: torch.Tensor) -> None:
        value = pack_header(self.plan_digest, key, self.block_bytes) + block_bytes_view(block).tobytes()
        self.counters.num_writes += 1
        self._queue.put(self.store_key(key), value)

    def _send(self, items: list[tuple[bytes, bytes]]) -> None:
        """SETs a batch in one pipeline; what the server refuses (full memory) or never gets is counted."""
        if not self._available():
            self.counters.num_write_failures += len(items)
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for store_key, value in items:
                pipe.set(store_key, value)
            replies = pipe.execute(raise_on_error=False)
        except self._redis.exceptions.RedisError as error:
            self._failed(error)
            self.counters.num_write_failures += len(items)
            return
        for (_, value), reply in zip(items, replies):
            if isinstance(reply, Exception):  # e.g. OOM command not allowed when used memory > 'maxmemory'
                self.counters.num_write_failures += 1
            else:
                self.counters.num_written_bytes += len(value) - HEADER_BYTES

    def flush(self) -> None:
        self._queue.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.close()
        self._client.close()

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
