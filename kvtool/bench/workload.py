"""How many KV blocks a replay can ever create: the most it can put in a host cache.

A prompt's full blocks are identified, as the cache manager does, by their tokens chained to their
parent block (with extra ids and the cache salt), so blocks that requests share count once. The
blocks a request fills with generated tokens, and everything after the first answer of a
session, depend on what the model generates: they count once per request. The result is an
upper bound, never an estimate that a run could exceed.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtool.bench.replay import ReplayItem


def max_num_blocks(items: Sequence[ReplayItem], tokens_per_block: int) -> int:
    """The most distinct KV blocks replaying ``items`` (with every output length generated) creates."""
    block_index: dict[tuple, int] = {}     # (parent, tokens, extra ids) -> index of a distinct full block
    num_unknown = 0                        # blocks holding generated tokens: one per request
    session_lengths: dict[str, int] = {}   # tokens of a session so far (prompts + answers)
    for item in items:
        record = item.record
        num_new = len(item.new_token_ids)
        if record.session_id is not None and record.session_id in session_lengths:
            # A later turn: history (with answers) + new tokens + this answer. The blocks it shares with
            # the previous turn are counted; the rest depends on the answers.
            before = session_lengths[record.session_id]
            after = before + num_new + record.output_tokens
            num_unknown += -(-after // tokens_per_block) - before // tokens_per_block
            session_lengths[record.session_id] = after
            continue
        parent = ("salt", record.cache_salt)
        num_full = num_new // tokens_per_block
        for block in range(num_full):
            span = slice(block * tokens_per_block, (block + 1) * tokens_per_block)
            extra = item.new_extra_ids[span] if item.new_extra_ids else ()
            key = (parent, item.new_token_ids[span], extra if any(extra) else None)  # extra id 0: a normal token
            parent = block_index.setdefault(key, len(block_index))
        total = num_new + record.output_tokens
        num_unknown += -(-total // tokens_per_block) - num_full
        if record.session_id is not None:
            session_lengths[record.session_id] = total
    return len(block_index) + num_unknown
