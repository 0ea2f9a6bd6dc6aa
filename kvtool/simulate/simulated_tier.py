"""The third KV tier of a simulated engine: an index-only store (block keys, no bytes) that the C++
cache manager drives exactly as it drives a real one (kvtool.runtime.tier3), and what each of its
calls costs on the engine's simulated clock (kvtool.simulate.tier_costs).

A disk tier is one engine's: ``--kv_disk_cache_bytes`` slots, the manager's index exact (no
directory: nothing is written). A remote tier is one store of ``--kv_remote_cache_bytes`` shared by
every replica of a simulated fleet (the same KeyIndex): a block one replica spilled is a hit for
another, and when full the store evicts its least recently used block, as Redis with
``maxmemory-policy allkeys-lru`` does, so a replica's index may name a block the store lost.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtool._core import PoolKind
from kvtool.runtime.tier3_store import StoreCounters
from kvtool.simulate.tier_costs import TierCost


class KeyIndex:
    """The keys a store holds, at most ``num_blocks`` of them, the least recently used dropped first.
    A disk tier's keys also name their slot (a new block in a slot replaces its key)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._keys: OrderedDict[bytes, int] = OrderedDict()  # key -> slot (-1: remote)
        self._slot_key: dict[int, bytes] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def put(self, slot: int, key: bytes) -> None:
        old = self._slot_key.pop(slot, None) if slot >= 0 else None
        if old is not None and self._keys.get(old) == slot:  # (a block fetched and spilled again has a new slot)
            del self._keys[old]
        self._keys[key] = slot
        self._keys.move_to_end(key)
        if slot >= 0:
            self._slot_key[slot] = key
        while len(self._keys) > self.num_blocks:
            self._keys.popitem(last=False)  # a remote store's (the disk tier's slots never overflow)

    def take(self, slot: int, key: bytes) -> bool:
        """Whether the key is held (in ``slot`` for a disk tier); a hit is the most recently used."""
        if key not in self._keys or (slot >= 0 and self._keys[key] != slot):
            return False
        self._keys.move_to_end(key)
        return True


class SimulatedStore:
    """One engine's view of a third tier (kvtool.runtime.tier3_store.Tier3Store): the calls of a real
    store on ``index``, each charging its cost (``cost``, blocks of ``block_bytes``) to ``charge``
    (the engine's clock)."""

    def __init__(self, pool: PoolKind, index: KeyIndex, cost: TierCost, block_bytes: int, plan_digest: bytes,
                 charge) -> None:
        self.pool = pool
        self.index = index
        self.cost = cost
        self.block_bytes = block_bytes
        self.plan_digest = plan_digest
        self.counters = StoreCounters()
        self._charge = charge

    @property
    def tier(self) -> str:
        """'disk' or 'remote', as reports name the tier."""
        return "disk" if self.pool == PoolKind.DISK else "remote"

    def count_present(self, keys: list[bytes]) -> int:
        self.counters.num_lookups += 1
        if self.pool == PoolKind.REMOTE and keys:
            self._charge(self.cost.lookup_s)
        return next((i for i, key in enumerate(keys) if key not in self.index), len(keys))

    def write(self, slot: int, key: bytes, block=None) -> None:
        self._charge(self.cost.spill.seconds(self.block_bytes))
        self.index.put(slot if self.pool == PoolKind.DISK else -1, key)
        self.counters.num_writes += 1
        self.counters.num_written_bytes += self.block_bytes

    def read(self, requests: list[tuple]) -> list[bool]:
        results = []
        for slot, key, _ in requests:
            self._charge(self.cost.fetch.seconds(self.block_bytes))
            ok = self.index.take(slot if self.pool == PoolKind.DISK else -1, key)
            results.append(ok)
            self.counters.num_reads += ok
            self.counters.num_read_bytes += self.block_bytes if ok else 0
            self.counters.num_read_failures += not ok
        return results

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
