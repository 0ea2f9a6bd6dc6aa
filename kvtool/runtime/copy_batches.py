"""Groups a step's copy operations into batches, each executable as one launch.

The cache manager emits copies in the order its decisions were made: an onboard that needs a
primary block evicts (offloads) one first, so the list alternates offload, onboard, offload, ...
Run in that order, every copy is its own launch. Yet most of them are independent: only an op
that reads a block an earlier op writes, or writes a block an earlier op reads or writes, must
wait for it. Each op goes into the first wave after every op it conflicts with; a wave's ops are
independent, so each (direction, tokens copied) group of a wave is one batch. The result equals
running the ops one by one (tests/test_copy_batches.py checks it against that reference).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvtool._core import PoolKind


class CopyBatch(NamedTuple):
    """Copies of ``num_tokens`` leading token slots of block ``src_block_ids[i]`` of pool
    ``src_pool`` into block ``dst_block_ids[i]`` of pool ``dst_pool``; independent of each other.
    ``wave``: batches of a wave run after every batch of the waves before it."""

    src_pool: PoolKind
    dst_pool: PoolKind
    num_tokens: int
    src_block_ids: list[int]
    dst_block_ids: list[int]
    wave: int = 0


def copy_batches(src_pool: np.ndarray, src_block_ids: np.ndarray, dst_pool: np.ndarray,
                 dst_block_ids: np.ndarray, num_tokens: np.ndarray) -> list[CopyBatch]:
    """Batches of the copy ops (the manager's arrays, one entry per op; pools as PoolKind values), in an
    order to run them."""
    last_write: dict[tuple[int, int], int] = {}  # (pool, block) -> latest wave writing it
    last_read: dict[tuple[int, int], int] = {}   # (pool, block) -> latest wave reading it
    batches: dict[tuple[int, int, int, int], CopyBatch] = {}  # (wave, src pool, dst pool, tokens)
    ops = zip(src_pool.tolist(), src_block_ids.tolist(), dst_pool.tolist(), dst_block_ids.tolist(),
              num_tokens.tolist())
    for src_p, src_b, dst_p, dst_b, count in ops:
        src, dst = (src_p, src_b), (dst_p, dst_b)
        wave = 1 + max(last_write.get(src, -1), last_write.get(dst, -1), last_read.get(dst, -1))
        last_write[dst] = max(wave, last_write.get(dst, -1))
        last_read[src] = max(wave, last_read.get(src, -1))
        key = (wave, src_p, dst_p, count)
        batch = batches.get(key)
        if batch is None:
            batch = batches[key] = CopyBatch(PoolKind(src_p), PoolKind(dst_p), count, [], [], wave)
        batch.src_block_ids.append(src_b)
        batch.dst_block_ids.append(dst_b)
    return [batches[key] for key in sorted(batches, key=lambda k: k[0])]
