"""A cache manager with real KV pools and a real third-tier store, driven as an engine drives them:
each computed token's KV is a tensor made from its identity (the prompt up to it), every copy runs
through tier3_store.run_copies, and every position a request reads is checked against what it
should hold. Shared by tests/test_disk_store.py and tests/test_remote_store.py."""

from __future__ import annotations

import hashlib

import torch

from kvtool._core import CacheConfig, KVCacheManager
from kvtool.runtime.kv_pool import BlockShape, KvCachePools
from kvtool.runtime.tier3_store import plan_digest, run_copies

T = 4  # tokens per block
SHAPE = BlockShape(num_layers=2, tokens_per_block=T, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
PLAN = plan_digest(weights_digest="sha256:tiny-test-model", kv_dtype=SHAPE.dtype, tokens_per_block=T,
                   num_layers=SHAPE.num_layers, num_kv_heads=SHAPE.num_kv_heads, head_dim=SHAPE.head_dim)


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def token_kv(tokens: list[int], j: int) -> torch.Tensor:
    """The KV of token j: [num_layers, 2, num_kv_heads, head_dim], a function of tokens[:j + 1]."""
    seed = int.from_bytes(hashlib.sha256(repr(tokens[:j + 1]).encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((SHAPE.num_layers, 2, SHAPE.num_kv_heads, SHAPE.head_dim), generator=generator).to(SHAPE.dtype)


class TieredEngine:
    def __init__(self, store, *, num_primary_blocks=4, num_secondary_blocks=2, num_tier3_blocks=16,
                 plan=PLAN) -> None:
        self.store = store
        self.manager = KVCacheManager(CacheConfig(
            tokens_per_block=T, num_primary_blocks=num_primary_blocks, num_secondary_blocks=num_secondary_blocks,
            num_tier3_blocks=num_tier3_blocks, tier3_pool=store.pool, plan_digest=plan))
        self.pools = KvCachePools(SHAPE, num_primary_blocks, num_secondary_blocks, torch.device("cpu"))
        self.next_id = 0

    def copies(self) -> list[int]:
        return run_copies(self.manager.take_copy_ops(), self.pools, self.store)

    def stage(self, tokens: list[int]):
        m = self.manager
        lookup = m.tier3_lookup(tokens)
        present = self.store.count_present(lookup.keys)
        if present is None:  # the store cannot be asked now: the request goes unstaged
            return None
        result = m.stage_tier3(tokens, present)
        m.complete_staging(self.copies())
        return result

    def run(self, tokens: list[int], *, stage: bool = True, release: bool = True):
        """Stages, adds, computes and (by default) releases a prompt; returns add_sequence's result."""
        if stage:
            self.stage(tokens)
        seq_id, self.next_id = self.next_id, self.next_id + 1
        r = self.manager.add_sequence(seq_id, tokens, len(tokens))
        assert self.copies() == []
        table = self.manager.block_ids(seq_id)
        primary = self.pools.primary  # [num_blocks, num_layers, 2, tokens_per_block, kv_heads, head_dim]
        for j in range(len(tokens)):
            block, offset = int(table[j // T]), j % T
            if j >= r.num_reused_tokens:  # the forward writes the KV of the tokens it computes
                primary[block, :, :, offset] = token_kv(tokens, j)
            assert torch.equal(primary[block, :, :, offset], token_kv(tokens, j)), f"token {j} holds wrong KV"
        self.manager.mark_computed(seq_id, len(tokens))
        if release:
            self.manager.release(seq_id)
        assert self.manager.check_invariants() == []
        return r

    def fill(self, start: int, num_prompts: int = 3) -> None:
        """Prompts of new tokens that push older blocks down to the third tier."""
        for k in range(num_prompts):
            self.run(prompt(start + 100 * k, 4 * T))
