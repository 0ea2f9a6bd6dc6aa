"""How many KV blocks a replay can ever create: the most it can put in a host cache.

A prompt's full blocks are identified, as the cache manager does, by their tokens chained to their
parent block (with extra ids and the cache salt), so blocks that requests share count once. The
blocks a request fills with generated tokens, and everything after the first answer of a
session, depend on what the model generates: they count once per request. The result is an
upper bound, never an estimate that a run could exceed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtool.runtime.request import Request
from kvtool.workloads.requests import dataset_requests


def max_num_blocks(requests: Sequence[Request], tokens_per_block: int) -> int:
    """The most distinct KV blocks replaying ``requests`` (before they are issued: a later turn holds
    its new tokens), with every output length generated, creates."""
    block_index: dict[tuple, int] = {}     # (parent, tokens, extra ids) -> index of a distinct full block
    num_unknown = 0                        # blocks holding generated tokens: one per request
    session_lengths: dict[str, int] = {}   # tokens of a session so far (prompts + answers)
    for request in requests:
        session_id = request.line.session_id if request.line is not None else None
        new_ids, new_extra = request.prompt_token_ids, request.extra_ids
        num_output = request.sampling_params.max_tokens
        if session_id is not None and session_id in session_lengths:
            # A later turn: history (with answers) + new tokens + this answer. The blocks it shares with
            # the previous turn are counted; the rest depends on the answers.
            before = session_lengths[session_id]
            after = before + len(new_ids) + num_output
            num_unknown += -(-after // tokens_per_block) - before // tokens_per_block
            session_lengths[session_id] = after
            continue
        num_full = len(new_ids) // tokens_per_block
        # A block's tokens as the bytes of their int32 ids (ids are int32 in the engine): slices of one
        # bytes object per prompt, not a tuple of ints per block (the conversation trace: 4.5M blocks).
        token_bytes = np.asarray(new_ids, dtype=np.int32)[:num_full * tokens_per_block].tobytes()
        width = 4 * tokens_per_block
        keys = [(token_bytes[block * width:(block + 1) * width], _block_extra(new_extra, block, tokens_per_block))
                for block in range(num_full)]
        parent = ("salt", request.sampling_params.cache_salt)
        num_known = 0
        while num_known < num_full and (parent, *keys[num_known]) in block_index:
            parent = block_index[(parent, *keys[num_known])]
            num_known += 1
        if num_known < num_full:  # the rest are new blocks, and so are their children: numbered in order
            first = len(block_index)
            parents = [parent, *range(first, first + num_full - num_known - 1)]
            block_index.update(zip([(p, tokens, extra) for p, (tokens, extra) in zip(parents, keys[num_known:])],
                                   range(first, first + num_full - num_known)))
        total = len(new_ids) + num_output
        num_unknown += -(-total // tokens_per_block) - num_full
        if session_id is not None:
            session_lengths[session_id] = total
    return len(block_index) + num_unknown


def _block_extra(extra_ids, block: int, tokens_per_block: int) -> tuple | None:
    """A block's extra ids (multimodal items), or None when it has none (an extra id 0: a normal token)."""
    if not extra_ids:
        return None
    extra = tuple(extra_ids[block * tokens_per_block:(block + 1) * tokens_per_block])
    return extra if any(extra) else None


def workload_blocks(plan, config, replay, dataset) -> int | None:
    """The most KV blocks replaying ``dataset`` (a kvtool.workloads.datasets.Dataset, or None) as ``replay``
    (kvtool.config.ReplayOptions: its warm-up and measured lines) through ``plan`` can create, when the
    host cache ``config`` (an EngineConfig) asks for makes it matter (else None): a host cache larger
    than the available memory is accepted when the dataset cannot fill more than that."""
    if dataset is None or not config.kv_cache_config.host_cache_size:
        return None
    warmup, measured = replay.split(dataset_requests(dataset, tokenizer=plan.tokenizer))
    return max_num_blocks(warmup + measured, plan.build_options.tokens_per_block)
