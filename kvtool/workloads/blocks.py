"""How many KV blocks a replay can ever create: the most it can put in a host cache.

A prompt's full blocks are identified, as the cache manager does, by their tokens chained to their
parent block (with extra ids and the cache salt), so blocks that requests share count once. The
blocks a request fills with generated tokens, and everything after the first answer of a
session, depend on what the model generates: they count once per request. The result is an
upper bound, never an estimate that a run could exceed.
"""

from __future__ import annotations

from collections.abc import Sequence

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
        parent = ("salt", request.sampling_params.cache_salt)
        num_full = len(new_ids) // tokens_per_block
        for block in range(num_full):
            span = slice(block * tokens_per_block, (block + 1) * tokens_per_block)
            extra = tuple(new_extra[span]) if new_extra else ()
            key = (parent, tuple(new_ids[span]), extra if any(extra) else None)  # extra id 0: a normal token
            parent = block_index.setdefault(key, len(block_index))
        total = len(new_ids) + num_output
        num_unknown += -(-total // tokens_per_block) - num_full
        if session_id is not None:
            session_lengths[session_id] = total
    return len(block_index) + num_unknown


def workload_blocks(plan, config, replay, dataset) -> int | None:
    """The most KV blocks replaying ``dataset`` (a kvtool.workloads.datasets.Dataset, or None) as ``replay``
    (kvtool.config.ReplayOptions: its warm-up and measured lines) through ``plan`` can create, when the
    host cache ``config`` (an EngineConfig) asks for makes it matter (else None): a host cache larger
    than the available memory is accepted when the dataset cannot fill more than that."""
    if dataset is None or not config.kv_cache_config.host_cache_size:
        return None
    warmup, measured = replay.split(dataset_requests(dataset, tokenizer=plan.tokenizer))
    return max_num_blocks(warmup + measured, plan.build_options.tokens_per_block)
