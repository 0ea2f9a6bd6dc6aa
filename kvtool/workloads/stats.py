"""What a dataset holds: request counts, length distributions and how much prompt could be reused."""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.workloads.datasets import Dataset
from kvtool.reports.metrics import LatencyStats


@dataclass(frozen=True)
class LengthStats:
    """Min, mean, percentiles and max of a list of lengths (tokens)."""

    count: int
    min: int | None
    mean: float | None
    p50: float | None
    p90: float | None
    max: int | None

    @classmethod
    def of(cls, values: list[int]) -> LengthStats:
        stats = LatencyStats.of(values)
        return cls(len(values), min(values, default=None), stats.mean, stats.p50, stats.p90, max(values, default=None))


@dataclass(frozen=True)
class DatasetStats:
    """Counts and distributions of a dataset file (token prompts only; text prompts are counted apart).

    ``shared_prefix_fraction``: the fraction of prompt tokens, in file order, that lie in full
    blocks of ``tokens_per_block`` tokens already seen as a prefix of an earlier prompt -- what
    block reuse could skip with an unbounded cache. A later session turn's prompt counts its
    history (earlier prompt + generated answer: unknown tokens, but cached blocks for the
    session's next turn).
    """

    num_lines: int
    num_sessions: int
    num_session_turns: int
    num_text_prompts: int
    prompt_tokens: LengthStats       # full prompts as sent to the engine (session history included)
    new_tokens: LengthStats          # each line's own tokens
    output_tokens: LengthStats
    tokens_per_block: int
    shared_prefix_tokens: int
    total_prompt_tokens: int

    @property
    def shared_prefix_fraction(self) -> float | None:
        return self.shared_prefix_tokens / self.total_prompt_tokens if self.total_prompt_tokens else None


def dataset_stats(dataset: Dataset, *, tokens_per_block: int = 32) -> DatasetStats:
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    # A prefix of whole blocks is known by its last block's id, chained to its parent's: linear in the
    # prompt's length (a tuple per prefix was quadratic: minutes and gigabytes for a 12k-token trace).
    block_ids: dict[tuple, int] = {}

    def prefix_ids(tokens: list[int]) -> list[int]:
        ids, parent = [], -1
        for end in range(tokens_per_block, len(tokens) + 1, tokens_per_block):
            parent = block_ids.setdefault((parent, tuple(tokens[end - tokens_per_block:end])), len(block_ids))
            ids.append(parent)
        return ids

    seen_blocks: set[int] = set()
    history: dict[str, list[int]] = {}
    prompt_lengths, new_lengths, output_lengths = [], [], []
    shared = total = num_text = 0
    next_placeholder = -1
    for record in dataset.records:
        output_lengths.append(record.output_tokens)
        if record.input_ids is None:
            num_text += 1
            if record.session_id is not None:
                history.pop(record.session_id, None)  # history of unknown tokens: stop following the session
            continue
        new_lengths.append(len(record.input_ids))
        prompt = list(record.input_ids)
        if record.session_id is not None and record.turn is not None and record.session_id in history:
            prompt = history[record.session_id] + prompt
        prompt_lengths.append(len(prompt))
        total += len(prompt)
        ids = prefix_ids(prompt)
        shared += tokens_per_block * sum(block in seen_blocks for block in ids)
        seen_blocks.update(ids)
        if record.session_id is not None:
            # The generated answer: tokens no other prompt has (negative ids), then the next turn follows.
            answer = list(range(next_placeholder, next_placeholder - record.output_tokens, -1))
            next_placeholder -= record.output_tokens
            history[record.session_id] = prompt + answer
            # The engine keeps the full blocks of the answer too (their KV is computed while decoding).
            seen_blocks.update(prefix_ids(history[record.session_id]))
    return DatasetStats(
        num_lines=len(dataset), num_sessions=dataset.num_sessions,
        num_session_turns=sum(1 for r in dataset.records if r.session_id is not None), num_text_prompts=num_text,
        prompt_tokens=LengthStats.of(prompt_lengths), new_tokens=LengthStats.of(new_lengths),
        output_tokens=LengthStats.of(output_lengths), tokens_per_block=tokens_per_block,
        shared_prefix_tokens=shared, total_prompt_tokens=total)
