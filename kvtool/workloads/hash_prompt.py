"""A prompt given as block hash ids, as `kvtool dataset import` writes a Mooncake-style trace: its token ids
(kvtool.workloads.trace_tokens.HashBlockTokens) are made when they are read, as an int32 array, and not
kept. The conversation trace holds 145M prompt tokens: as Python ints they took 25 s and 1.2 GB to
load; as hash ids the file loads in a fraction of a second, and a replay makes a prompt's ids when it
issues the request (a 126k-token prompt in about 0.1 ms).

A dataset line of hash ids (kvtool.workloads.datasets): ``"hash_ids": [...]``, a block of
``"hash_block_len"`` tokens each, the last one partial, ``"input_length"`` tokens in all, ids below
``"token_id_limit"``. Its ids are the ones `kvtool dataset import --write_token_ids` writes for the
same rows: each block's head is numbered among its siblings in file order, so every line of the file
is read before any prompt is (HashPromptReader).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvtool.errors import DatasetError
from kvtool.workloads.trace_tokens import HashBlockTokens


class HashBlockPrompt(Sequence):
    """The token ids of a prompt of hash ids, made when read: ``len`` and single ids without making
    them, ``np.asarray(prompt)`` (int32) or iteration for all. Equal to any sequence of the same ids."""

    __slots__ = ("hash_ids", "num_tokens", "_tokens", "_heads")

    def __init__(self, hash_ids: tuple[int, ...], num_tokens: int) -> None:
        self.hash_ids = hash_ids
        self.num_tokens = num_tokens
        self._tokens: HashBlockTokens | None = None  # set by HashPromptReader.finish
        self._heads: np.ndarray | None = None        # int32 [num_blocks, 1 + num_digits]

    def bind(self, tokens: HashBlockTokens, heads: np.ndarray) -> None:
        self._tokens, self._heads = tokens, heads

    @property
    def block_len(self) -> int:
        return self._tokens.block_len

    def _blocks(self, first: int, end: int) -> np.ndarray:
        """The ids of blocks first..end-1, whole: int32 [(end - first) * block_len]."""
        blocks = np.empty((end - first, self._tokens.block_len), dtype=np.int32)
        blocks[:] = self._tokens.block_template
        blocks[:, :self._heads.shape[1]] = self._heads[first:end]
        return blocks.reshape(-1)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        ids = self._blocks(0, len(self.hash_ids))[:self.num_tokens]
        return ids if dtype is None else ids.astype(dtype, copy=False)

    def tolist(self) -> list[int]:
        return self.__array__().tolist()

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self.num_tokens)
            if step != 1 or start >= stop:
                return tuple(self.tolist()[index])
            block_len = self._tokens.block_len
            first = start // block_len
            ids = self._blocks(first, -(-stop // block_len))
            return tuple(ids[start - first * block_len:stop - first * block_len].tolist())
        position = index + self.num_tokens if index < 0 else index
        if not 0 <= position < self.num_tokens:
            raise IndexError(f"prompt index {index} out of range for {self.num_tokens} tokens")
        block, offset = divmod(position, self._tokens.block_len)
        heads = self._heads[block]
        return int(heads[offset] if offset < len(heads) else self._tokens.block_template[offset])

    def __iter__(self):
        return iter(self.tolist())

    def __eq__(self, other) -> bool:
        if isinstance(other, HashBlockPrompt):
            return self.num_tokens == other.num_tokens and np.array_equal(self.__array__(), other.__array__())
        if isinstance(other, (list, tuple)):
            return len(other) == self.num_tokens and self.tolist() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        # Equal to the tuple of its ids, so hashed as that tuple is (it makes the ids: not on a hot path).
        return hash(tuple(self.tolist()))

    def __repr__(self) -> str:
        return f"HashBlockPrompt({len(self.hash_ids)} hash ids, {self.num_tokens} tokens)"


class HashPromptReader:
    """Collects the prompts of a dataset file's hash-id lines in file order (``add``); ``finish``, once
    every line is read, numbers their blocks (kvtool.workloads.trace_tokens) and makes them readable.
    The lines of one file share a block length and a token id limit: they come from one trace."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._prompts: list[tuple[int, HashBlockPrompt]] = []  # (line number, prompt)
        self._layout: tuple[int, int, int] | None = None     # block length, token id limit, line giving them

    def add(self, line_number: int, hash_ids: tuple[int, ...], block_len: int, num_tokens: int,
            token_id_limit: int) -> HashBlockPrompt:
        if self._layout is None:
            self._layout = (block_len, token_id_limit, line_number)
        elif self._layout[:2] != (block_len, token_id_limit):
            first_len, first_limit, first_line = self._layout
            raise DatasetError(
                f"{self.path} line {line_number}: 'hash_block_len' {block_len} and 'token_id_limit' {token_id_limit} "
                f"differ from line {first_line}'s ({first_len}, {first_limit}): a file's hash ids come from one "
                "trace; import each trace into a file of its own")
        prompt = HashBlockPrompt(hash_ids, num_tokens)
        self._prompts.append((line_number, prompt))
        return prompt

    def finish(self) -> None:
        if not self._prompts:
            return
        block_len, token_id_limit, _ = self._layout
        line_number, max_hash_id = max(((line, max(p.hash_ids)) for line, p in self._prompts), key=lambda x: x[1])
        try:
            tokens = HashBlockTokens(block_len=block_len, token_id_limit=token_id_limit, max_hash_id=max_hash_id)
        except ValueError as error:
            raise DatasetError(f"{self.path} line {line_number}: {error} (raise 'hash_block_len' or "
                               "'token_id_limit')") from None
        for _, prompt in self._prompts:  # in file order: siblings are numbered as they are first seen
            tokens.number(prompt.hash_ids)
        prompts = [prompt for _, prompt in self._prompts]
        heads = tokens.heads(np.fromiter(itertools.chain.from_iterable(p.hash_ids for p in prompts), dtype=np.int64,
                                         count=sum(len(p.hash_ids) for p in prompts)))
        start = 0
        for prompt in prompts:
            prompt.bind(tokens, heads[start:start + len(prompt.hash_ids)])
            start += len(prompt.hash_ids)
        self._prompts = []
