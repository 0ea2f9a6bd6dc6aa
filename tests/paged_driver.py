"""A minimal paged-KV driver for tests: assigns blocks, builds AttentionMetadata, runs a model.

It plays the runtime's part in the smallest honest way, so model and attention tests (and
runtime tests that want a reference) can run steps such as "seq A: context chunk of 16 tokens,
seq B: one decode token" without the C++ cache manager::

    driver = PagedDriver(model, tokens_per_block=8, num_blocks=64)
    seq = driver.add_sequence(prompt_ids)
    logits = driver.step(context=[(seq, len(prompt_ids))])[0]   # [num_new_tokens, vocab]
    seq.append(int(logits[-1].argmax()))
    logits = driver.step(decode=[seq])[0]                        # [1, vocab]

Blocks come from a shuffled free list, so a sequence's blocks are not contiguous in the pool.
The pool is filled with NaN: reading a slot that was never written poisons the output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from kvtool.layers.attention_metadata import AttentionMetadata


@dataclass
class PagedSequence:
    token_ids: list[int]                                 # prompt + generated tokens so far
    block_ids: list[int] = field(default_factory=list)   # -1 where a block was released
    num_computed: int = 0                                # tokens whose KV is in the cache

    def append(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))


@dataclass
class StepEntry:
    """One sequence's share of a step, as the metadata builder needs it."""

    block_ids: list[int]
    num_cached: int
    num_new: int


def build_metadata(entries: list[StepEntry], *, num_context_seqs: int, tokens_per_block: int,
                   device: torch.device | str = "cpu") -> AttentionMetadata:
    """AttentionMetadata for a step: entries[:num_context_seqs] are context chunks, the rest decode tokens."""
    T = tokens_per_block
    positions, slots, query_lens, seq_lens = [], [], [], []
    for entry in entries:
        new_positions = list(range(entry.num_cached, entry.num_cached + entry.num_new))
        positions += new_positions
        slots += [entry.block_ids[p // T] * T + p % T for p in new_positions]
        query_lens.append(entry.num_new)
        seq_lens.append(entry.num_cached + entry.num_new)
    max_blocks = max(len(entry.block_ids) for entry in entries)
    block_tables = [entry.block_ids + [-1] * (max_blocks - len(entry.block_ids)) for entry in entries]
    query_start_loc = [0]
    for n in query_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    return AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        query_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(block_tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        tokens_per_block=T,
        num_context_seqs=num_context_seqs,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


class PagedDriver:
    """Owns a block-major KV pool [num_blocks, num_layers, 2, T, num_kv_heads, head_dim] and
    runs steps of a LlamaModel over it."""

    def __init__(self, model, *, tokens_per_block: int, num_blocks: int, kv_dtype: torch.dtype | None = None,
                 seed: int = 0) -> None:
        config = model.config
        device = model.embed_tokens.weight.device
        self.model = model
        self.tokens_per_block = tokens_per_block
        self.pool = torch.full((num_blocks, config.num_layers, 2, tokens_per_block, config.num_kv_heads,
                                config.head_dim), float("nan"), dtype=kv_dtype or model.embed_tokens.weight.dtype,
                               device=device)
        self.kv_caches = [self.pool[:, layer] for layer in range(config.num_layers)]
        self.free_block_ids = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_block_ids)

    def add_sequence(self, token_ids: list[int], *, share_prefix_with: PagedSequence | None = None,
                     num_shared_blocks: int = 0) -> PagedSequence:
        """A new sequence; its first ``num_shared_blocks`` blocks are those of ``share_prefix_with``
        (already computed there, so only the rest of its prompt will be computed)."""
        seq = PagedSequence(list(token_ids))
        if share_prefix_with is not None and num_shared_blocks:
            T = self.tokens_per_block
            shared = token_ids[:num_shared_blocks * T]
            assert shared == share_prefix_with.token_ids[:num_shared_blocks * T], "prefix tokens differ"
            assert share_prefix_with.num_computed >= num_shared_blocks * T, "prefix KV not computed yet"
            seq.block_ids = list(share_prefix_with.block_ids[:num_shared_blocks])
            seq.num_computed = num_shared_blocks * T
        return seq

    def release_blocks_outside_window(self, seq: PagedSequence, window: int, *, poison: bool = True) -> int:
        """Mark blocks no future token of ``seq`` can see as -1 (as the runtime does) and, with
        ``poison``, fill them with NaN (only for blocks no other sequence shares); returns how many."""
        first_visible = max(0, seq.num_computed + 1 - window)  # the next token's window
        released = 0
        for index in range(first_visible // self.tokens_per_block):
            block_id = seq.block_ids[index]
            if block_id != -1:
                if poison:
                    self.pool[block_id] = float("nan")
                seq.block_ids[index] = -1
                released += 1
        return released

    def step(self, context: list[tuple[PagedSequence, int]] = (), decode: list[PagedSequence] = ()
             ) -> list[torch.Tensor]:
        """Run one step: each context entry computes its next ``n`` tokens, each decode sequence its
        last token. Returns float32 logits [num_new_tokens, vocab] per entry, context entries first."""
        work = [(seq, n) for seq, n in context] + [(seq, 1) for seq in decode]
        entries, input_ids = [], []
        for seq, num_new in work:
            end = seq.num_computed + num_new
            assert end <= len(seq.token_ids), "scheduling tokens the sequence does not have"
            while len(seq.block_ids) * self.tokens_per_block < end:
                seq.block_ids.append(self.free_block_ids.pop())
            entries.append(StepEntry(list(seq.block_ids), seq.num_computed, num_new))
            input_ids += seq.token_ids[seq.num_computed:end]
        device = self.pool.device
        meta = build_metadata(entries, num_context_seqs=len(context), tokens_per_block=self.tokens_per_block,
                              device=device)
        with torch.no_grad():
            hidden = self.model(torch.tensor(input_ids, dtype=torch.int64, device=device), meta, self.kv_caches)
            logits = self.model.compute_logits(hidden)
        outputs, start = [], 0
        for seq, num_new in work:
            outputs.append(logits[start:start + num_new])
            start += num_new
            seq.num_computed += num_new
        return outputs

    def generate_greedy(self, seqs: list[PagedSequence], num_tokens: int, *, window: int | None = None) -> None:
        """Decode ``num_tokens`` greedy tokens for sequences whose prompts are computed and whose
        first token is appended; with ``window``, blocks outside it are released each step."""
        for _ in range(num_tokens - 1):
            if window is not None:
                for seq in seqs:
                    self.release_blocks_outside_window(seq, window)
            for seq, logits in zip(seqs, self.step(decode=seqs)):
                seq.append(int(logits[-1].argmax()))
