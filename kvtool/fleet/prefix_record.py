"""What a router remembers of the prompts it sent to one replica: the blocks of their token ids, least
recently sent first, as many as the replica's KV cache holds.

A router in front of servers cannot see their caches (SGLang's router keeps an approximate radix tree of
the text it routed, Dynamo's KV router without KV events an approximation from its own routing
decisions): it records what it sent where and guesses that the replica still caches it. kvtool's
record does the same in blocks: a block is named by its tokens chained to its parent (and the cache
salt), as kvtool's cache manager names blocks, so two prompts share their record's blocks exactly as
far as they share a token prefix. Only full blocks are recorded; extra ids (p-tuning) are not looked at.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_keys(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """The names of the full blocks of ``token_ids``: each a hash of its tokens and its parent's name.
    Within one process, equal prefixes give equal names and different ones (all but surely) different."""
    keys = []
    parent = hash(("cache_salt", cache_salt))
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = token_ids[start:start + block_size]
        parent = hash((parent, tokens if type(tokens) is tuple else tuple(tokens)))
        keys.append(parent)
    return keys


class PrefixRecord:
    """The blocks a router sent to one replica, at most ``capacity`` (None: no limit), the least recently
    sent forgotten first, as an LRU cache evicts them."""

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"a prefix record holds at least one block, got a capacity of {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def num_matched(self, keys: Sequence[int]) -> int:
        """How many leading blocks of ``keys`` the record holds (a prefix: it stops at the first missing)."""
        blocks = self._blocks
        for count, key in enumerate(keys):
            if key not in blocks:
                return count
        return len(keys)

    def add(self, keys: Sequence[int]) -> None:
        """Records ``keys`` as the most recently sent, forgetting the least recently sent beyond capacity."""
        blocks = self._blocks
        for key in keys:
            if key in blocks:
                blocks.move_to_end(key)
            else:
                blocks[key] = None
        if self.capacity is not None:
            while len(blocks) > self.capacity:
                blocks.popitem(last=False)
