"""Every request of a run is checked before the first one is sent: a dataset line the engine would
refuse (a token outside the vocabulary, longer than max_seq_len, larger than the KV pool, ...) is
reported now, together with the other such lines, instead of ending the run halfway.

A session turn is checked with its whole prompt: the history's length is known in advance, since
bench requests generate exactly their output length.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtool.bench.replay import ReplayItem, sampling_params_for
from kvtool.errors import DatasetError

MAX_LISTED = 5  # problems listed in the error; the rest are counted


def request_problems(items: Sequence[ReplayItem], engine, vocab_size: int) -> list[str]:
    """'<file> line N: why' for every item the engine would refuse, in dataset order."""
    problems = []
    history: dict[str, int] = {}  # session_id -> tokens of its last turn's prompt and answer
    for item in items:
        record = item.record
        bad = [t for t in item.new_token_ids if t >= vocab_size]
        if bad:
            problems.append(f"{item.where}: token id {max(bad)} is outside the model's vocabulary [0, {vocab_size}): "
                            f"regenerate the dataset with --max_token_id {vocab_size} or less")
            continue
        # The answers' token values are unknown before the run; their number is not.
        prompt = [0] * history.get(record.session_id, 0) + list(item.new_token_ids)
        problem = engine.request_problem(prompt, sampling_params_for(record))
        if problem is not None:
            problems.append(f"{item.where}: {problem}")
        if record.session_id is not None:
            history[record.session_id] = len(prompt) + record.output_tokens
    return problems


def check_requests(items: Sequence[ReplayItem], engine, vocab_size: int, *, source: str) -> None:
    """Raises a DatasetError listing the first few requests that cannot run (nothing has run yet)."""
    problems = request_problems(items, engine, vocab_size)
    if not problems:
        return
    listed = "\n  ".join(problems[:MAX_LISTED])
    more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    raise DatasetError(f"{len(problems)} of the {len(items)} requests in {source} cannot run with this plan and these "
                       f"limits (nothing was run; fix or remove them, or raise the limits):\n  {listed}{more}")
