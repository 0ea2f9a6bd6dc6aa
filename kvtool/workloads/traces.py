"""`kvtool dataset import`: a request trace (kvtool.workloads.trace_formats) as a kvtool dataset of
token ids or text prompts, each line with its ``arrival_time_s``, for `bench` / `simulate --mode trace`.

Rows of hash ids become token ids (kvtool.workloads.trace_tokens): prompts that share hash-id
prefixes share token prefixes, and nothing else. The dataset keeps the hash ids (a line of
``hash_ids``, kvtool.workloads.hash_prompt), whose token ids are made when a replay reads them: the
conversation trace's 145M prompt tokens are a 3 MiB file that loads in about half a second;
``write_token_ids`` writes every id (``input_ids``: 500 MiB, half a minute to load; see
results/traces/import.md) for tools that read the ids themselves. Rows of a length alone (Azure's)
get hash ids of their own. ``shrink`` divides every prompt of such a trace
(a hash id becomes block_size / shrink tokens, a partial block rounds up), keeping which prompts
share which blocks: a trace of 12k-token prompts replays on a CPU model of a few thousand tokens.
Rows longer than ``max_seq_len`` (prompt + output, as imported) are an error listing how many and
the first, or left out with ``skip_too_long``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.errors import DatasetError
from kvtool.files import atomic_write
from kvtool.workloads.trace_formats import TraceRow, read_azure, read_mooncake, read_plain
from kvtool.workloads.trace_tokens import MIN_TOKEN_ID, HashBlockTokens

TRACE_FORMATS = ("mooncake", "azure", "csv")
DEFAULT_VOCAB_SIZE = 32000  # Llama 2's and Mistral's: ids below it are valid in every common vocabulary


@dataclass(frozen=True)
class TraceImportOptions:
    """How a trace becomes a dataset (the fields are `kvtool dataset import`'s flags).

    Token ids made from hash ids (written as ``input_ids`` with ``write_token_ids``, else kept as hash
    ids) are below ``vocab_size`` (``DEFAULT_VOCAB_SIZE`` when None) and
    below every id of ``special_token_ids`` from MIN_TOKEN_ID up (a plan's bos and eos: no prompt
    holds one); ids a csv trace gives are checked against ``vocab_size`` when it is set.
    ``count_tokens``: the tokenizer that measures text prompts against ``max_seq_len`` (without one
    they are not measured).
    """

    block_size: int = 512
    shrink: int = 1
    vocab_size: int | None = None
    special_token_ids: tuple[int, ...] = ()
    max_seq_len: int | None = None
    skip_too_long: bool = False
    max_output_tokens: int | None = None
    output_len: int | None = None
    write_token_ids: bool = False
    count_tokens: Callable[[str], int] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("block_size", "shrink", "vocab_size", "max_seq_len", "max_output_tokens", "output_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name} must be a positive integer, got {value!r}")
        if self.block_size % self.shrink:
            raise ValueError(f"--shrink {self.shrink} must divide --block_size {self.block_size} (each hash id becomes "
                             "block_size / shrink tokens)")
        if self.skip_too_long and self.max_seq_len is None:
            raise ValueError("--skip_too_long needs a limit: give --max_seq_len N (or --plan DIR, whose limit applies)")

    @property
    def token_id_limit(self) -> int:
        """Token ids made from hash ids are below it."""
        specials = [token_id for token_id in self.special_token_ids if token_id >= MIN_TOKEN_ID]
        return min([self.vocab_size or DEFAULT_VOCAB_SIZE, *specials])

    @property
    def block_len(self) -> int:
        """Tokens each hash id becomes."""
        return self.block_size // self.shrink

    def prompt_length(self, row: TraceRow) -> int | None:
        """The imported prompt's tokens (None: a text prompt without a tokenizer to count it)."""
        if row.input_length is not None:
            num_blocks = -(-row.input_length // self.block_size)
            last = row.input_length - (num_blocks - 1) * self.block_size
            return (num_blocks - 1) * self.block_len + -(-last // self.shrink)
        if row.input_ids is not None:
            return len(row.input_ids)
        return None if self.count_tokens is None else self.count_tokens(row.prompt)

    def output_tokens(self, row: TraceRow) -> int:
        return row.output_tokens if self.max_output_tokens is None else min(row.output_tokens, self.max_output_tokens)


@dataclass(frozen=True)
class TraceImport:
    """What an import wrote and left out."""

    num_requests: int
    num_prompt_tokens: int          # of the prompts whose length is known
    num_too_long: int               # left out (skip_too_long)
    num_uncounted: int              # text prompts not measured (no tokenizer)
    first_arrival_s: float | None
    last_arrival_s: float | None

    def describe(self, output: Path, max_seq_len: int | None) -> str:
        parts = [f"wrote {self.num_requests:,} requests to {output}"]
        if self.first_arrival_s is not None:
            parts.append(f"arrivals {self.first_arrival_s:g} to {self.last_arrival_s:g} s")
        parts.append(f"{self.num_prompt_tokens:,} prompt tokens")
        if self.num_too_long:
            parts.append(f"left out {self.num_too_long:,} longer than --max_seq_len {max_seq_len}")
        if self.num_uncounted:
            parts.append(f"{self.num_uncounted:,} text prompts not measured against a max_seq_len (give --plan "
                         "to count their tokens)")
        return "; ".join(parts)


def read_trace(path: str | os.PathLike, trace_format: str, options: TraceImportOptions) -> list[TraceRow]:
    """The rows of a trace file (a DatasetError names a bad row's file and line)."""
    path = Path(path)
    if trace_format not in TRACE_FORMATS:
        raise ValueError(f"--format {trace_format}: unknown: use one of {', '.join(TRACE_FORMATS)} (ShareGPT: "
                         "`kvtool dataset import-sharegpt`)")
    if not path.is_file():
        raise DatasetError(f"trace {path} does not exist or is not a file")
    if trace_format == "csv" and options.shrink != 1:
        raise ValueError("--shrink divides traces that give prompt lengths (mooncake, azure); a csv trace gives its "
                         "prompts: leave out --shrink")
    if trace_format == "mooncake":
        rows = read_mooncake(path, options.block_size)
    elif trace_format == "azure":
        rows = read_azure(path)
    else:
        rows = read_plain(path, output_len=options.output_len, token_id_limit=options.vocab_size)
    if not rows:
        raise DatasetError(f"trace {path} has no requests (the file is empty)")
    return rows


def _check_lengths(path: Path, rows: list[TraceRow], lengths: list[int | None],
                   options: TraceImportOptions) -> tuple[list[TraceRow], list[int | None]]:
    """The rows to write and their prompt lengths: those too long are an error unless
    options.skip_too_long."""
    if options.max_seq_len is None:
        return rows, lengths
    kept, too_long = [], []
    for row, length in zip(rows, lengths):
        if length is not None and length + options.output_tokens(row) > options.max_seq_len:
            too_long.append((row, length))
        else:
            kept.append((row, length))
    if too_long and not options.skip_too_long:
        row, length = too_long[0]
        raise DatasetError(
            f"{len(too_long):,} of the {len(rows):,} requests in {path} are longer than --max_seq_len "
            f"{options.max_seq_len} (prompt + output tokens), the first on line {row.line_number} ({length} + "
            f"{options.output_tokens(row)}): give --skip_too_long to leave them out, or a larger --max_seq_len")
    if not kept:
        raise DatasetError(f"every request in {path} is longer than --max_seq_len {options.max_seq_len}: nothing left "
                           "to import")
    return [row for row, _ in kept], [length for _, length in kept]


def block_tokens(rows: list[TraceRow], options: TraceImportOptions) -> tuple[HashBlockTokens, dict[int, range]]:
    """The token maker for the rows of hash ids, and the blocks of their own that the rows without
    hash ids get (by line number: ids above every hash id of the trace)."""
    next_id = 1 + max((max(row.hash_ids) for row in rows if row.hash_ids), default=-1)
    own_blocks = {}
    for row in rows:
        if row.hash_ids is None and row.input_length is not None:
            num_blocks = -(-row.input_length // options.block_size)
            own_blocks[row.line_number] = range(next_id, next_id + num_blocks)
            next_id += num_blocks
    tokens = HashBlockTokens(block_len=options.block_len, token_id_limit=options.token_id_limit,
                             max_hash_id=max(next_id - 1, 0))
    return tokens, own_blocks


def _lines(rows: list[TraceRow], options: TraceImportOptions) -> Iterator[str]:
    """The dataset's lines (JSON text, newline included), in the trace's order."""
    tokens, own_blocks = block_tokens(rows, options) if any(row.input_length for row in rows) else (None, {})
    for row in rows:
        arrival = "" if row.arrival_time_s is None else f'"arrival_time_s":{float(row.arrival_time_s)!r},'
        output = options.output_tokens(row)
        if row.input_length is not None:
            hash_ids = row.hash_ids if row.hash_ids is not None else own_blocks[row.line_number]
            num_tokens = options.prompt_length(row)
            if options.write_token_ids:
                last_len = num_tokens - (len(hash_ids) - 1) * options.block_len
                yield f'{{{arrival}"input_ids":[{tokens.prompt_text(hash_ids, last_len)}],"output_tokens":{output}}}\n'
            else:
                yield (f'{{{arrival}"hash_ids":[{",".join(map(str, hash_ids))}],"hash_block_len":{options.block_len},'
                       f'"input_length":{num_tokens},"token_id_limit":{options.token_id_limit},'
                       f'"output_tokens":{output}}}\n')
        else:
            prompt = {"prompt": row.prompt} if row.prompt is not None else {"input_ids": row.input_ids}
            yield f"{{{arrival}{json.dumps(prompt, separators=(',', ':'))[1:-1]},\"output_tokens\":{output}}}\n"


def import_trace(path: str | os.PathLike, trace_format: str, output: str | os.PathLike,
                 options: TraceImportOptions) -> TraceImport:
    """Reads a trace, checks every row, then writes the dataset (atomically: all of it or nothing)."""
    path = Path(path)
    rows = read_trace(path, trace_format, options)
    num_read = len(rows)
    rows, lengths = _check_lengths(path, rows, [options.prompt_length(row) for row in rows], options)
    with atomic_write(output) as out:
        for line in _lines(rows, options):
            out.write(line)
    arrivals = [row.arrival_time_s for row in rows if row.arrival_time_s is not None]
    return TraceImport(num_requests=len(rows), num_prompt_tokens=sum(n for n in lengths if n is not None),
                       num_too_long=num_read - len(rows), num_uncounted=sum(n is None for n in lengths),
                       first_arrival_s=min(arrivals, default=None), last_arrival_s=max(arrivals, default=None))
