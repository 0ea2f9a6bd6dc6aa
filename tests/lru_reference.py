"""An independent reference of how many prompt tokens kvtool's cache reuses when requests run one at
a time (`--mode sequential`), restated from the rules of docs/architecture.md#kv-cache-rules in
plain Python (tests/reference_kv_cache.py models the whole manager; this models one replay, fast
enough for a few hundred long prompts).

- Blocks of ``tokens_per_block`` tokens are identified by their tokens and their parent's
  identity (prefix-chained). A request's full blocks are cached once their KV is computed: its
  prompt, and its generated tokens but the last (whose KV is never computed).
- A prompt reuses its longest chain of cached blocks, never its last token; then (partial reuse)
  the first tokens of its next block that a cached child of the chain's last block shares, capped
  before the last token, if a spare block is left for the copy's pinned source.
- The pool holds ``num_blocks`` blocks. A request takes blocks for its prompt at admission, then
  one block whenever a generated token starts a new one. A block is taken from the free ones,
  else from the least recently released cached block that no other cached block continues (the
  copy's source is pinned while the prompt's blocks are taken). A computed block that is already
  cached takes the cached one's place, whose block is freed.
- A finished request releases its blocks last block first: cached ones become the most recently
  used in that order, the others free.
- Generated tokens are the same for the same prompt (greedy decoding, and `kvtool simulate`'s
  engine) and match no prompt token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple


class SequentialReuse(NamedTuple):
    reused_tokens: list[int]      # per request
    num_evicted_blocks: int
    num_cached_blocks: int        # at the end
    num_free_blocks: int | None   # at the end (None: an unbounded pool)


def _blocks_for(num_tokens: int, tokens_per_block: int) -> int:
    return -(-num_tokens // tokens_per_block)


class _Cache:
    def __init__(self, tokens_per_block: int, num_blocks: int | None) -> None:
        self.tpb = tokens_per_block
        self.num_blocks = num_blocks
        self.ids: dict[tuple, int] = {}                    # (parent id, block tokens) -> block id
        self.tokens: dict[int, tuple] = {}                 # cached block id -> its tokens
        self.parent: dict[int, int | None] = {}
        self.children: dict[int | None, set[int]] = {}     # cached children of a block (None: the start)
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: least recently released first
        self.cached: set[int] = set()
        self.num_free = num_blocks
        self.num_evicted = 0

    def block_id(self, parent: int | None, tokens: tuple) -> int:
        return self.ids.setdefault((parent, tokens), len(self.ids))

    def take_block(self, pinned: int | None) -> None:
        """A block for the running request: a free one, else the least recently released leaf."""
        if self.num_blocks is None:
            return
        if self.num_free > 0:
            self.num_free -= 1
            return
        victim = next((b for b in self.idle if b != pinned and not self.children.get(b)), None)
        if victim is None:
            raise ValueError("the reference's pool is too small for one request: give it more blocks")
        del self.idle[victim]
        self.cached.discard(victim)
        self.children[self.parent.pop(victim)].discard(victim)
        del self.tokens[victim]
        self.num_evicted += 1

    def store(self, block: int, parent: int | None, tokens: tuple) -> None:
        """A computed full block of the running request: cached (referenced) from now on."""
        if block in self.cached:  # takes the cached copy's place: that copy's block is freed
            del self.idle[block]
            if self.num_blocks is not None:
                self.num_free += 1
            return
        self.cached.add(block)
        self.tokens[block], self.parent[block] = tokens, parent
        self.children.setdefault(parent, set()).add(block)


def sequential_reuse(requests: Iterable[tuple[Sequence, int]], *, tokens_per_block: int,
                     num_blocks: int | None = None) -> SequentialReuse:
    """Reused prompt tokens of each (prompt token ids, output tokens) request, replayed one at a time
    through a pool of ``num_blocks`` blocks (None: unbounded, no eviction), and the pool afterwards."""
    cache = _Cache(tokens_per_block, num_blocks)
    tpb = tokens_per_block
    generated: dict[tuple, int] = {}  # prompt -> an id for its generated tokens
    reused = []
    for prompt, num_output in requests:
        prompt = tuple(prompt)
        length = len(prompt)
        answer = generated.setdefault(prompt, len(generated))
        tokens = prompt + tuple(("generated", answer, j) for j in range(num_output - 1))
        # The chain of cached blocks, never the last prompt token.
        chain, parent = [], None
        while (len(chain) + 1) * tpb <= length - 1:
            block = cache.ids.get((parent, prompt[len(chain) * tpb:(len(chain) + 1) * tpb]))
            if block is None or block not in cache.cached:
                break
            chain.append(block)
            parent = block
        # Partial reuse of the next block, from the cached child sharing the most leading tokens
        # (ties: the most recently released).
        source, num_partial = None, 0
        limit = min(tpb, length - 1 - len(chain) * tpb)
        if limit > 0:
            want = prompt[len(chain) * tpb:len(chain) * tpb + limit]
            shares = {child: next((j for j in range(limit) if cache.tokens[child][j] != want[j]), limit)
                      for child in cache.children.get(parent, ())}
            num_partial = max(shares.values(), default=0)
            if num_partial:
                best = {child for child, shared in shares.items() if shared == num_partial}
                source = next(block for block in reversed(cache.idle) if block in best)
            needed = max(_blocks_for(length, tpb), len(chain) + 1)
            if source is not None and num_blocks is not None and needed + 1 > num_blocks:
                source, num_partial = None, 0  # no spare block for the pinned source: computed instead
        reused.append(len(chain) * tpb + num_partial)
        for block in chain:
            del cache.idle[block]
        for _ in range(_blocks_for(length, tpb) - len(chain)):
            cache.take_block(pinned=source)
        held = list(chain)  # the request's cached blocks, in order

        def store_full_blocks(num_computed: int) -> None:
            while len(held) < num_computed // tpb:
                start = len(held) * tpb
                block_tokens = tokens[start:start + tpb]
                parent_block = held[-1] if held else None
                block = cache.block_id(parent_block, block_tokens)
                cache.store(block, parent_block, block_tokens)
                held.append(block)

        store_full_blocks(length)
        num_allocated = _blocks_for(length, tpb)
        for num_generated in range(1, num_output):
            if _blocks_for(length + num_generated, tpb) > num_allocated:
                cache.take_block(pinned=None)
                num_allocated += 1
            store_full_blocks(length + num_generated)
        # Release, last block first: cached ones become the most recently used, the rest free.
        for block in reversed(held):
            cache.idle[block] = None
        if num_blocks is not None:
            cache.num_free += num_allocated - len(held)
    return SequentialReuse(reused, cache.num_evicted, len(cache.cached), cache.num_free)
