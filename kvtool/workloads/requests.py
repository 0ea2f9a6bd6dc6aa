"""A dataset's lines as the Requests a replay hands to an engine."""

from __future__ import annotations

import hashlib

from kvtool.config import ReplayOptions, SamplingParams
from kvtool.runtime.request import Request
from kvtool.workloads.datasets import Dataset, DatasetRecord


def dataset_requests(dataset: Dataset, *, tokenizer, replay: ReplayOptions | None = None) -> list[Request]:
    """A request per dataset line, text prompts tokenized (kvtool.bench.precheck checks them
    against the model), sampled as ``replay`` asks (default: greedy). A later session turn holds only
    its new tokens until it is issued."""
    replay = replay or ReplayOptions()
    requests = []
    # Not every tokenizer has one (a Hugging Face tokenizer adds it itself).
    bos_token_id = getattr(tokenizer, "bos_token_id", None)
    sessions_seen: set[str] = set()
    # Lines alike share one SamplingParams (nothing changes it): building one costs more than the rest
    # of a request here.
    shared_params: dict[tuple, SamplingParams] = {}
    for index, line in enumerate(dataset.records):
        if line.input_ids is not None:
            # The record's tuple itself: copying 2k ids costs about 40 µs (a refcount write per id).
            token_ids = line.input_ids
        else:
            token_ids = [int(t) for t in tokenizer.encode(line.prompt)] if line.prompt else []
            if line.session_id in sessions_seen and bos_token_id is not None and token_ids[:1] == [bos_token_id]:
                # A later turn continues the conversation: no second beginning-of-sequence token mid-prompt.
                token_ids = token_ids[1:]
        if line.session_id is not None:
            sessions_seen.add(line.session_id)
        if replay.sampled:  # a seed of its own
            params = sampling_params_for(line, replay, request_seed(replay.seed, index))
        else:
            key = (line.output_tokens, line.cache_salt, line.priority, id(line.kv_cache_retention_config))
            if key not in shared_params:
                shared_params[key] = sampling_params_for(line, replay)
            params = shared_params[key]
        requests.append(Request(token_ids, params,
                                None if line.extra_ids is None else list(line.extra_ids), line=line,
                                name=line.request_id if line.request_id is not None else str(index),
                                where=dataset.where(line)))
    return requests


def request_seed(seed: int, index: int) -> int:
    """The seed of the sampled request of a dataset's line ``index`` in a run seeded ``seed``: runs of
    one seed draw alike, and no two lines' streams (nor two seeds') start alike."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch takes seeds below 2**63


def sampling_params_for(line: DatasetRecord, replay: ReplayOptions, seed: int | None = None) -> SamplingParams:
    """Bench requests always generate exactly output_tokens tokens (as trtllm-bench's do): greedily
    unless ``replay`` samples them, then seeded ``seed``."""
    extra = {}
    if line.priority is not None:
        extra["priority"] = line.priority
    if replay.sampled:
        extra.update(temperature=replay.temperature, top_p=replay.top_p, top_k=replay.top_k, seed=seed)
    else:
        extra["temperature"] = 0.0
    return SamplingParams(max_tokens=line.output_tokens, ignore_eos=True,
                          cache_salt=line.cache_salt, kv_cache_retention_config=line.kv_cache_retention_config,
                          **extra)
