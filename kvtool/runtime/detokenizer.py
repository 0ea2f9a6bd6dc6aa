"""A request's output text, decoded once as its tokens arrive, and its stop strings found in it.

Decoding the whole output at every token costs O(n^2) over a long answer. Here each new token
decodes a short window instead (vLLM's incremental detokenization): the tokens since the text was
last complete plus the ones before them, whose text is known, so the tokenizer sees the context that
decides a piece's leading space. Text ending in U+FFFD (a character split over byte tokens, not all
of them here yet) waits for the next token.

Stop strings follow OpenAI / vLLM: the text ends before the first one, which is never part of it;
only text new since the last token is searched. While the output still grows, the last
``longest stop - 1`` characters are held back from ``text()``: they may be the start of one.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtool.models.tokenizer import Tokenizer

REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """The text of one request's output tokens (``append`` each), cut before its first stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or ()) if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.stopped = False  # a stop string was found: the text ends before it and stays as it is
        self._text = ""
        # The tokens a decode still needs: the first _num_known decode to the end of _text (the context
        # the next window starts with), the rest are not in _text yet. Earlier tokens are let go.
        self._window: list[int] = []
        self._num_known = 0

    def append(self, token_id: int) -> bool:
        """Adds an output token; True when it completes the first stop string. Without stop strings the
        text is decoded only when read."""
        if self.stopped:
            return False  # the text is final
        self._window.append(token_id)
        if not self.stop:
            return False
        self._catch_up()
        return self.stopped

    def text(self, *, finished: bool = False) -> str:
        """The text so far. While unfinished, without a last character still incomplete and the
        characters that may start a stop string; ``finished``: all of it, up to the first stop string."""
        self._catch_up()
        if self.stopped or (finished and self._num_known == len(self._window)):
            return self._text
        if finished:
            pending, _ = self._pending_text()  # an incomplete last character decodes to U+FFFD
            return self._cut_at_stop(self._text + pending, len(self._text))
        return self._text[:max(0, len(self._text) - self._hold)]

    def _pending_text(self) -> tuple[str, bool]:
        """The text the tokens not in ``_text`` add, and whether it is complete (no trailing U+FFFD)."""
        decode = self.tokenizer.decode
        known = decode(self._window[:self._num_known]) if self._num_known else ""
        text = decode(self._window)
        pending = text[len(known):]
        return pending, not pending.endswith(REPLACEMENT_CHARACTER)

    def _catch_up(self) -> None:
        """Decodes the tokens appended since the last call; their text waits while its last character is
        incomplete, unless a stop string ends before that character."""
        if self.stopped or self._num_known == len(self._window):
            return
        pending, complete = self._pending_text()
        if not complete:
            pending = pending.rstrip(REPLACEMENT_CHARACTER)
        if not pending:
            return
        start = len(self._text)
        text = self._text + pending
        cut = self._cut_at_stop(text, start) if self.stop else text
        self.stopped = len(cut) < len(text)
        if complete or self.stopped:
            self._text = cut
            self._window = self._window[self._num_known:]  # the new tokens are the next window's context
            self._num_known = len(self._window)

    def _cut_at_stop(self, text: str, start: int) -> str:
        """``text`` up to its first stop string, searching only where one could end at or after ``start``
        (the text before was searched already)."""
        found = [i for s in self.stop if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
        return text[:min(found)] if found else text
