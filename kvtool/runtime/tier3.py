"""The third KV tier in an engine: its store opened as the configuration asks (--kv_disk_cache_dir,
--kv_remote_cache), a request's blocks staged from it before the scheduler admits the request, and
what it cost.

The C++ cache manager decides every move (docs/architecture.md#kv-cache-rules). Spills (host tier ->
third tier) come with a step's copy operations and the store writes them off the step path
(tier3_store.WriteQueue). A hit needs a staging first: the blocks of a prompt that sit in the third
tier are fetched into the host tier before add_sequence shares them, because a fetch can fail or be
slow and must be confirmed before a forward reads it. The engine stages the requests it is about to
schedule (Engine.step); a request admitted unstaged computes what the third tier held
(``not_staged``), and a failed fetch is a miss (``fetch_failed``), never a wrong token.

Restart: the disk tier's files are emptied when the engine starts (kvtool.runtime.disk_store: its
index is the manager's tree, which lives in the process). The remote tier survives any engine's
restart: a new engine finds the blocks by key (another engine's blocks too).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from kvtool import _core
from kvtool.config import DEFAULT_PRIORITY, KvCacheConfig
from kvtool.errors import KvtoolError
from kvtool.runtime.disk_store import PAGE_BYTES, DiskStore, DiskStoreError, round_up
from kvtool.runtime.remote_store import RemoteStore, RemoteStoreError
from kvtool.runtime.tier3_store import HEADER_BYTES, StoreCounters, Tier3Store, plan_digest

# The tiers by the names reports give them, with the manager's pool of each.
TIERS = (("primary", _core.PoolKind.PRIMARY), ("host", _core.PoolKind.SECONDARY), ("disk", _core.PoolKind.DISK),
         ("remote", _core.PoolKind.REMOTE))


class OpenedTier(NamedTuple):
    """A third-tier store and the number of blocks the manager may keep in it."""

    store: Tier3Store
    num_blocks: int


def plan_identity(plan, kv_cache_dtype, tokens_per_block: int) -> bytes:
    """The 32-byte identity of a plan's KV in every third-tier key: its weights' checksum, KV dtype and shapes."""
    config = plan.model_config
    weights = getattr(plan, "manifest", {}).get("weights")
    # A simulation of a model's shapes (kvtool.simulate.shapes) has no weights: its name stands for them.
    return plan_digest(weights_digest=weights["checksum"] if weights else f"shapes of {plan.name}",
                       kv_dtype=kv_cache_dtype,
                       tokens_per_block=tokens_per_block, num_layers=config.num_layers,
                       num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)


def open_tier(kv: KvCacheConfig, block_bytes: int, plan: bytes) -> OpenedTier | None:
    """The store the configuration asks for (None: no third tier). KvtoolError naming the flag when the
    directory cannot hold the tier, the size holds no block, or no server answers at the URL."""
    if kv.disk_cache_size and kv.disk_cache_dir is None:
        raise KvtoolError(f"--kv_disk_cache_bytes {kv.disk_cache_size}: a disk tier writes its files to "
                          "--kv_disk_cache_dir DIR: give it (only kvtool simulate models a disk tier from its size "
                          "alone)")
    if kv.remote_cache_size:
        raise KvtoolError(f"--kv_remote_cache_bytes {kv.remote_cache_size} sizes a simulated store (kvtool "
                          "simulate); a real one holds what its server's maxmemory allows: drop the flag")
    if kv.disk_cache_dir is not None:
        slot_bytes = round_up(HEADER_BYTES + block_bytes, PAGE_BYTES)
        num_blocks = kv.disk_cache_size // slot_bytes
        if num_blocks == 0:
            raise KvtoolError(f"--kv_disk_cache_bytes {kv.disk_cache_size} holds no KV block: a block takes "
                              f"{slot_bytes} bytes on disk; give at least that (a few GiB to matter)")
        try:
            return OpenedTier(DiskStore(kv.disk_cache_dir, num_blocks, block_bytes, plan), num_blocks)
        except DiskStoreError as error:  # its message names the directory and the fix
            raise KvtoolError(f"--kv_disk_cache_dir {error}") from None
        except OSError as error:
            raise KvtoolError(f"--kv_disk_cache_dir {kv.disk_cache_dir}: {error.strerror or error}: give a "
                              "writable directory on a file system with room") from None
    if kv.remote_cache_url is not None:
        url = kv.remote_cache_url
        try:
            store = RemoteStore(url, block_bytes, plan)
        except RemoteStoreError as error:
            raise KvtoolError(f"--kv_remote_cache {url}: {error}") from None
        if not store.ping():
            store.close()
            raise KvtoolError(f"--kv_remote_cache {url}: no Redis server answers there: start one "
                              "(redis-server --port PORT) or fix the host and port")
        return OpenedTier(store, kv.remote_cache_index_blocks)
    return None


class StagingCost(NamedTuple):
    """What staging one request did: blocks fetched into the host tier, and the time it took."""

    num_staged_blocks: int
    seconds: float


class Tier3:
    """The third tier of one engine: stages requests' blocks from ``store`` into the host tier of
    ``manager``, the copies run by ``run_copies`` (the executor's: a step's copy operations, the third
    tier's on the store; returns the host blocks whose fetch failed), timed on ``clock`` (the engine's: a
    simulation's store advances its simulated clock by what the staging costs)."""

    def __init__(self, manager, store: Tier3Store, run_copies: Callable[[object], list[int]], *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.manager = manager
        self.store = store
        self._run_copies = run_copies
        self._clock = clock
        self.staging_seconds = 0.0  # lookups and fetches, on the step path

    def stage(self, token_ids, *, extra_ids=None, lora_task_id: int = 0, cache_salt: int = 0,
              priority: int = DEFAULT_PRIORITY, retention=None) -> StagingCost:
        """Fetches the prompt's leading blocks the store holds (after those in the primary and host tiers)
        into the host tier; a store that cannot be asked stages nothing."""
        start = self._clock()
        m = self.manager
        identity = {"extra_ids": extra_ids, "lora_task_id": lora_task_id, "cache_salt": cache_salt}
        lookup = m.tier3_lookup(token_ids, **identity)
        num_staged = 0
        # The disk tier's index is the manager's: nothing to ask the store when it knows of no block.
        if lookup.keys and (lookup.num_known_blocks or self.store.pool != _core.PoolKind.DISK):
            present = self.store.count_present(lookup.keys)
            if present is not None:
                result = m.stage_tier3(token_ids, present, priority=priority, retention=retention, **identity)
                num_staged = result.num_staged_blocks
                failed = self._run_copies(m.take_copy_ops()) if num_staged else []
                m.complete_staging(failed)
                num_staged -= len(failed)
        seconds = self._clock() - start
        self.staging_seconds += seconds
        return StagingCost(num_staged, seconds)

    def stats(self, cache_stats) -> dict[str, int | float]:
        """The third tier's counters for Engine.get_stats: its traffic, its store's failures and the
        time stagings took on the step path."""
        traffic = cache_stats.tier3_traffic
        counters = self.store.counters
        return {
            "tier3_spilled_blocks": traffic.spilled_blocks,
            "tier3_staged_blocks": traffic.staged_blocks,
            "tier3_fetch_failed_blocks": traffic.fetch_failed_blocks,
            "tier3_lost_blocks": traffic.lost_blocks,
            "tier3_discovered_blocks": traffic.discovered_blocks,
            "tier3_write_failures": counters.num_write_failures,
            "tier3_read_failures": counters.num_read_failures,
            "tier3_lookup_failures": counters.num_lookup_failures,
            "tier3_timeouts": counters.num_timeouts,
            "tier3_staging_s": self.staging_seconds,
        }

    def reset_stats(self) -> None:
        """Zeroes the staging time and the store's counters (the blocks it holds stay)."""
        self.staging_seconds = 0.0
        self.store.counters = StoreCounters()

    def close(self) -> None:
        """Waits for the queued spills, then releases the files or the connection."""
        self.store.close()
