"""Every request of a run is checked before the first one is sent: a dataset line the engine would
refuse (a token outside the vocabulary, longer than max_seq_len, larger than the KV pool, ...) is
reported now, together with the other such lines, instead of ending the run halfway.

A session turn is checked with its whole prompt: the history's length is known in advance, since
bench requests generate exactly their output length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvtool.bench.target import TargetEngine
from kvtool.errors import DatasetError
from kvtool.runtime.request import Request

MAX_LISTED = 5  # problems listed in the error; the rest are counted


def request_problems(requests: Sequence[Request], engine: TargetEngine) -> list[str]:
    """'<file> line N: why' for every request the engine would refuse, in dataset order."""
    problems = []
    history: dict[str, int] = {}  # session_id -> tokens of its last turn's prompt and answer
    for request in requests:
        session_id = request.line.session_id if request.line is not None else None
        if session_id in history:
            # The answers' token values are unknown before the run; their number is not.
            prompt = [0] * history[session_id] + list(request.prompt_token_ids)
            checked = replace(request, prompt_token_ids=prompt, extra_ids=None)
        else:
            prompt = request.prompt_token_ids
            checked = request
        try:
            problem = engine.request_problem(checked)
        except (ValueError, OverflowError) as error:  # ids the engine cannot even convert: still this line's
            problem = str(error)
        if problem is not None:
            problems.append(f"{request.where}: {problem}")
        if session_id is not None:
            history[session_id] = len(prompt) + request.sampling_params.max_tokens
    return problems


def check_requests(requests: Sequence[Request], engine: TargetEngine, *, source: str) -> None:
    """Raises a DatasetError listing the first few requests that cannot run (nothing has run yet)."""
    problems = request_problems(requests, engine)
    if not problems:
        return
    listed = "\n  ".join(problems[:MAX_LISTED])
    more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    raise DatasetError(f"{len(problems)} of the {len(requests)} requests in {source} cannot run with this plan and these "
                       f"limits (nothing was run; fix or remove them, or raise the limits):\n  {listed}{more}")
