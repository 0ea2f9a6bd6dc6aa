"""Token ids for a trace that gives its prompts as block hash ids (Mooncake's traces, AIPerf's
mooncake_trace): one id per block of the trace's block size, the last block possibly partial. Equal
ids mean equal blocks, and a block's hash covers the prompt before it, so equal id prefixes mean
equal prompt prefixes. kvtool replays token ids; ``HashBlockTokens`` turns each hash id into a block
of ids such that:

- a hash id always gives the same ids (a shorter last block: the first of them), so prompts with
  equal id prefixes have equal token prefixes, and kvtool's cache reuses what the trace's would;
- two hash ids never give the same block: tokens 1..k spell the hash id in base R (R: the ids
  available, k: the digits the trace's largest id needs);
- blocks that continue the same block (siblings: different turns after one prefix) differ in their
  first token, the next free one of their parent's. kvtool's partial reuse copies the first tokens
  that the next prompt block shares with a cached sibling; the trace says siblings differ, not
  where, so they share none. (This holds for up to R siblings of one block; the Mooncake
  conversation trace has at most 7,373, with R in the tens of thousands for a real vocabulary.)

The rest of a block is a fixed filler of ids 10..255: CPython keeps one object per int up to 256,
so a loaded dataset costs a pointer per filler token instead of an int object (the conversation
trace has 145M prompt tokens), and the file is smaller. A last block shorter than 1 + k tokens
still differs from its siblings in its first token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_TOKEN_ID = 10   # ids below are left out: special tokens of many tokenizers (pad, bos, eos, unk)
_FILLER_END = 256   # filler ids are below it (one shared int object each)


def num_digits(value: int, radix: int) -> int:
    """Digits ``value`` (>= 0) takes in base ``radix``: at least 1."""
    digits = 1
    while value >= radix:
        value //= radix
        digits += 1
    return digits


class HashBlockTokens:
    """Block token ids of hash ids (see the module docstring). ``block_len``: tokens a hash id
    becomes; ids are in [MIN_TOKEN_ID, ``token_id_limit``); ``max_hash_id``: the trace's largest.

    Sibling order is the order hash ids are first seen in: a trace's prompts must be given in file
    order for the same file to give the same ids.
    """

    def __init__(self, *, block_len: int, token_id_limit: int, max_hash_id: int) -> None:
        if token_id_limit < MIN_TOKEN_ID + 2:
            raise ValueError(f"token ids must be allowed up to at least {MIN_TOKEN_ID + 2}, got a limit of "
                             f"{token_id_limit} (ids below {MIN_TOKEN_ID} are left to special tokens)")
        self.radix = token_id_limit - MIN_TOKEN_ID
        self.num_digits = num_digits(max_hash_id, self.radix)
        if block_len < 1 + self.num_digits:
            raise ValueError(f"a block of {block_len} tokens cannot tell {max_hash_id + 1:,} hash ids apart with "
                             f"{self.radix:,} token ids: it needs {1 + self.num_digits} tokens (a first token and "
                             f"{self.num_digits} digits)")
        self.block_len = block_len
        num_filler = block_len - 1 - self.num_digits
        span = min(self.radix, _FILLER_END - MIN_TOKEN_ID)
        self._filler = [MIN_TOKEN_ID + position % span for position in range(num_filler)]
        # The filler as text, and where its first j ids end (text of a shorter block).
        self._filler_text = ",".join(map(str, self._filler))
        self._filler_ends = [0]
        for token_id in self._filler:
            self._filler_ends.append(self._filler_ends[-1] + len(str(token_id)) + 1)
        # A block's ids with zeros where the head goes (its first 1 + num_digits): int32 [block_len].
        self.block_template = np.array([0] * (1 + self.num_digits) + self._filler, dtype=np.int32)
        self._first_tokens: dict[int, int] = {}         # hash id -> its first token (its number among siblings)
        self._num_children: dict[int | None, int] = {}  # parent hash id (None: a prompt's start) -> children seen
        self._head_texts: dict[int, str] = {}

    def _number(self, hash_id: int, parent: int | None) -> None:
        sibling = self._num_children.get(parent, 0)
        self._num_children[parent] = sibling + 1
        self._first_tokens[hash_id] = MIN_TOKEN_ID + sibling % self.radix

    def number(self, hash_ids: Sequence[int]) -> None:
        """Numbers each block of a prompt's hash ids not numbered yet among its parent's children (a block
        keeps the first number it gets): what ``head`` does for each, without making the heads."""
        parent = None
        for hash_id in hash_ids:
            if hash_id not in self._first_tokens:
                self._number(hash_id, parent)
            parent = hash_id

    def head(self, hash_id: int, parent: int | None) -> list[int]:
        """The first 1 + num_digits ids of the hash id's block, following ``parent`` (None: a prompt's
        first block), which numbers it among its parent's children when it is first seen."""
        if hash_id not in self._first_tokens:
            self._number(hash_id, parent)
        head = [self._first_tokens[hash_id]]
        value = hash_id
        for _ in range(self.num_digits):  # least significant digit first
            value, digit = divmod(value, self.radix)
            head.append(MIN_TOKEN_ID + digit)
        return head

    def heads(self, hash_ids: np.ndarray) -> np.ndarray:
        """``head`` of each of these numbered hash ids (int64 [n]), at once: int32 [n, 1 + num_digits]."""
        out = np.empty((len(hash_ids), 1 + self.num_digits), dtype=np.int32)
        out[:, 0] = np.fromiter(map(self._first_tokens.__getitem__, hash_ids.tolist()), dtype=np.int32,
                                count=len(hash_ids))
        value = hash_ids.astype(np.int64)
        for digit in range(self.num_digits):  # least significant digit first
            value, out[:, 1 + digit] = np.divmod(value, self.radix)
            out[:, 1 + digit] += MIN_TOKEN_ID
        return out

    def prompt_ids(self, hash_ids: Sequence[int], last_block_len: int) -> list[int]:
        """The prompt's token ids: a block per hash id, the last one ``last_block_len`` tokens long."""
        ids: list[int] = []
        parent = None
        for position, hash_id in enumerate(hash_ids):
            length = self.block_len if position < len(hash_ids) - 1 else last_block_len
            ids += (self.head(hash_id, parent) + self._filler)[:length]
            parent = hash_id
        return ids

    def prompt_text(self, hash_ids: Sequence[int], last_block_len: int) -> str:
        """``prompt_ids`` as the text of a JSON list's items ("12,10,11,..."), built from cached pieces:
        formatting 145M ids one by one would take a minute."""
        parts = []
        parent = None
        full_tail = "," + self._filler_text if self._filler else ""
        for position, hash_id in enumerate(hash_ids):
            head_text = self._head_texts.get(hash_id)
            if head_text is None:
                head_text = self._head_texts[hash_id] = ",".join(map(str, self.head(hash_id, parent)))
            length = self.block_len if position < len(hash_ids) - 1 else last_block_len
            if length == self.block_len:
                parts.append(head_text + full_tail)
            elif length > 1 + self.num_digits:
                parts.append(head_text + "," + self._filler_text[:self._filler_ends[length - 1 - self.num_digits] - 1])
            else:
                parts.append(",".join(head_text.split(",")[:length]))
            parent = hash_id
        return ",".join(parts)
