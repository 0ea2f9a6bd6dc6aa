"""Output tokens to the text a client reads, piece by piece while streaming.

The whole output is decoded each time (tokens can merge: a multi-byte character split over two
byte tokens decodes to U+FFFD until its last byte arrives, so a trailing U+FFFD is held back).
Stop strings end generation in the engine; the client's text ends before the first one, so while
streaming the last ``longest stop - 1`` characters are held back until they cannot start one.
"""

from __future__ import annotations

REPLACEMENT_CHARACTER = "\ufffd"


class TextAssembler:
    """Deltas of one request's output text."""

    def __init__(self, tokenizer, stop: list[str] | None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.sent = ""

    def full_text(self, token_ids: list[int]) -> str:
        """The final text: decoded, cut before the first stop string."""
        text = self.tokenizer.decode(token_ids)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        return text if cut < 0 else text[:cut]

    def delta(self, token_ids: list[int], *, finished: bool) -> str:
        """The text not sent yet that can be sent now."""
        if finished:
            text = self.full_text(token_ids)
        else:
            text = self.tokenizer.decode(token_ids)
            if text.endswith(REPLACEMENT_CHARACTER):
                text = text.rstrip(REPLACEMENT_CHARACTER)
            if self._hold:
                text = text[:max(len(self.sent), len(text) - self._hold)]
        if len(text) <= len(self.sent):
            return ""
        # A decode may change earlier text (rarely: a tokenizer's cleanup of spaces); what was sent stays
        # sent, and only what the text grew by follows.
        piece = text[len(self.sent):]
        self.sent += piece
        return piece
