"""Output tokens to the text a client reads, piece by piece while streaming.

The text is the request's IncrementalDetokenizer (kvtool.runtime.detokenizer), which the engine feeds
as tokens arrive and also finds stop strings with: each token is decoded once, and a character split
over byte tokens, or characters that may start a stop string, wait until they are known.
"""

from __future__ import annotations

from kvtool.runtime.detokenizer import IncrementalDetokenizer
from kvtool.runtime.request import Request


class TextAssembler:
    """Deltas of one request's output text. Gives the request the detokenizer the engine will feed."""

    def __init__(self, request: Request, tokenizer) -> None:
        request.detokenizer = IncrementalDetokenizer(tokenizer, request.sampling_params.stop)
        self.detokenizer = request.detokenizer
        self.num_sent = 0  # characters

    def full_text(self) -> str:
        """The final text, up to the first stop string."""
        return self.detokenizer.text(finished=True)

    def delta(self, *, finished: bool) -> str:
        """The text not sent yet that can be sent now (the text only grows)."""
        piece = self.detokenizer.text(finished=finished)[self.num_sent:]
        self.num_sent += len(piece)
        return piece
