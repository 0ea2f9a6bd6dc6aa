"""Readers of request traces: each turns a file into TraceRows, a bad row a DatasetError naming the
file and line.

- ``mooncake``: Mooncake's / AIPerf's JSON Lines, ``{"timestamp": ms, "input_length": n,
  "output_length": m, "hash_ids": [...]}``; ``hash_ids`` has one id per block of the trace's block
  size (the last block partial), and a row without them gets blocks of its own (AIPerf's rule).
- ``azure``: the Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``):
  2023's timestamps look like ``2023-11-16 18:15:46.6805900``, 2024's like
  ``2024-05-10 00:00:00.009930+00:00`` (with or without the fraction). Prompts share nothing.
- ``csv``: a CSV with a header row, or JSON Lines, of an arrival time (``arrival_time_s`` in
  seconds or ``timestamp`` in milliseconds), a prompt (``prompt``: text, or ``input_ids``: token
  ids, a JSON list or space-separated in a CSV cell) and an output length (``output_tokens``,
  ``max_tokens`` or ``output_length``, else --output_len).
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from kvtool.errors import DatasetError
from kvtool.workloads.datasets import LineChecker

MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
TIME_KEYS = {"arrival_time_s": 1, "timestamp": 1000}  # key -> units per second
PROMPT_KEYS = ("prompt", "input_ids")
OUTPUT_KEYS = ("output_tokens", "max_tokens", "output_length")
PLAIN_KEYS = (*TIME_KEYS, *PROMPT_KEYS, *OUTPUT_KEYS)


class TraceRow(NamedTuple):
    """One request of a trace. A row of hash ids (or of a length alone: ``hash_ids`` None, blocks of
    its own) has ``input_length``; a plain row has ``prompt`` or ``input_ids``."""

    line_number: int
    arrival_time_s: float | None
    output_tokens: int
    input_length: int | None = None
    hash_ids: list[int] | None = None
    prompt: str | None = None
    input_ids: list[int] | None = None


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 text file, blank lines left out."""
    try:
        with path.open(encoding="utf-8-sig", newline="") as source:  # a byte order mark is not part of line 1
            for line_number, line in enumerate(source, start=1):
                if line.strip():
                    yield line_number, line
    except UnicodeDecodeError as error:
        raise DatasetError(f"{path} is not a UTF-8 text file ({error.reason} at byte {error.start})") from None


def _json_object(path: Path, line_number: int, line: str) -> dict:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as error:
        raise DatasetError(f"{path} line {line_number}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{path} line {line_number}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _check_keys(check: LineChecker, obj: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise check.fail(f"unknown key(s) {unknown}; this format's keys are {list(allowed)}")


def _time_s(check: LineChecker, obj: dict, key: str, units_per_s: int) -> float | None:
    if key not in obj or obj[key] is None:
        return None
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise check.fail(f"'{key}' must be a number >= 0, got {json.dumps(value)}")
    return value / units_per_s


def read_mooncake(path: Path, block_size: int) -> list[TraceRow]:
    """Rows of a Mooncake / AIPerf trace whose hash ids stand for ``block_size`` tokens each."""
    rows = []
    for line_number, line in _text_lines(path):
        obj = _json_object(path, line_number, line)
        check = LineChecker(path, line_number)
        _check_keys(check, obj, MOONCAKE_KEYS)
        for key in ("input_length", "output_length"):
            if key not in obj:
                raise check.fail(f"'{key}' is missing (a Mooncake trace row has {list(MOONCAKE_KEYS)})")
        input_length = check.int_field(obj, "input_length", minimum=1)
        output_length = check.int_field(obj, "output_length", minimum=1)
        hash_ids = check.id_list(obj, "hash_ids", limit=1 << 63)
        if hash_ids is not None:
            expected = -(-input_length // block_size)
            if len(hash_ids) != expected:
                raise check.fail(f"'input_length' {input_length} takes {expected} blocks of --block_size {block_size} "
                                 f"tokens, but 'hash_ids' has {len(hash_ids)}: give the trace's block size "
                                 "(--block_size)")
        rows.append(TraceRow(line_number, _time_s(check, obj, "timestamp", 1000), output_length, input_length,
                             None if hash_ids is None else list(hash_ids)))
    return rows


_AZURE_TIME = re.compile(r"(\d{4}-\d\d-\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?\s*(Z|[+-]\d\d:?\d\d)?")
TICKS_PER_S = 10**9


def azure_ticks(text: str, day_ticks: dict[str, int]) -> int | None:
    """Nanoseconds since the epoch of an Azure trace TIMESTAMP (None if it is not one). ``day_ticks``
    memoizes each date: a week-long trace has 27M rows and seven dates."""
    match = _AZURE_TIME.fullmatch(text.strip())
    if match is None:
        return None
    date, hours, minutes, seconds, fraction, zone = match.groups()
    if date not in day_ticks:
        try:
            day = datetime.datetime.strptime(date, "%Y-%m-%d").replace(tzinfo=datetime.timezone.utc)
        except ValueError:
            return None
        day_ticks[date] = int(day.timestamp()) * TICKS_PER_S
    offset_s = 0
    if zone and zone != "Z":
        digits = zone[1:].replace(":", "")
        offset_s = (int(digits[:2]) * 3600 + int(digits[2:]) * 60) * (1 if zone[0] == "+" else -1)
    clock_s = int(hours) * 3600 + int(minutes) * 60 + int(seconds) - offset_s
    return day_ticks[date] + clock_s * TICKS_PER_S + int((fraction or "0").ljust(9, "0"))


def _csv_rows(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row by column name) of a CSV file with a header row."""
    try:
        with path.open(encoding="utf-8-sig", newline="") as source:
            reader = csv.reader(source)
            header = next(reader, None)
            if header is None:
                raise DatasetError(f"{path} is empty: a CSV trace starts with a header row")
            header = [name.strip() for name in header]
            for cells in reader:
                if not any(cell.strip() for cell in cells):
                    continue
                if len(cells) != len(header):
                    raise DatasetError(f"{path} line {reader.line_num}: {len(cells)} values for the header's "
                                       f"{len(header)} columns ({', '.join(header)})")
                yield reader.line_num, dict(zip(header, cells))
    except UnicodeDecodeError as error:
        raise DatasetError(f"{path} is not a UTF-8 text file ({error.reason} at byte {error.start})") from None
    except csv.Error as error:
        raise DatasetError(f"{path}: not a valid CSV file ({error})") from None


def _csv_int(path: Path, line_number: int, row: dict[str, str], column: str, minimum: int) -> int:
    text = row[column].strip()
    if not re.fullmatch(r"\d+", text) or int(text) < minimum:
        raise DatasetError(f"{path} line {line_number}: {column} must be an integer >= {minimum}, got {text!r}")
    return int(text)


def read_azure(path: Path) -> list[TraceRow]:
    """Rows of an Azure LLM inference trace; arrival times are seconds after its earliest TIMESTAMP."""
    parsed = []
    day_ticks: dict[str, int] = {}
    for line_number, row in _csv_rows(path):
        missing = [column for column in AZURE_COLUMNS if column not in row]
        if missing:
            raise DatasetError(f"{path}: the header has no column {missing[0]}; an Azure LLM inference trace has "
                               f"{', '.join(AZURE_COLUMNS)}")
        ticks = azure_ticks(row["TIMESTAMP"], day_ticks)
        if ticks is None:
            raise DatasetError(f"{path} line {line_number}: TIMESTAMP {row['TIMESTAMP']!r} is not a date and time "
                               "like 2023-11-16 18:15:46.6805900 or 2024-05-10 00:00:00.009930+00:00")
        parsed.append((line_number, ticks, _csv_int(path, line_number, row, "ContextTokens", 1),
                       _csv_int(path, line_number, row, "GeneratedTokens", 1)))
    start = min((ticks for _, ticks, _, _ in parsed), default=0)
    return [TraceRow(line_number, (ticks - start) / TICKS_PER_S, generated, context)
            for line_number, ticks, context, generated in parsed]


def _plain_objects(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, fields) of a JSON Lines file, or of a CSV file (cells as JSON values where they
    parse: numbers, lists; text otherwise)."""
    first = next(_text_lines(path), (0, ""))[1].lstrip()
    if path.suffix.lower() in (".jsonl", ".json") or first.startswith("{"):
        for line_number, line in _text_lines(path):
            yield line_number, _json_object(path, line_number, line)
        return
    for line_number, row in _csv_rows(path):
        obj = {}
        for key, cell in row.items():
            if cell.strip() == "":
                continue
            if key == "prompt":
                obj[key] = cell
            elif key == "input_ids" and re.fullmatch(r"[\d\s]+", cell):
                obj[key] = [int(token) for token in cell.split()]
            else:
                try:
                    obj[key] = json.loads(cell)
                except json.JSONDecodeError:
                    obj[key] = cell
        yield line_number, obj


def read_plain(path: Path, *, output_len: int | None, token_id_limit: int | None) -> list[TraceRow]:
    """Rows of a CSV or JSON Lines file of arrival times and prompts (see the module docstring)."""
    rows = []
    for line_number, obj in _plain_objects(path):
        check = LineChecker(path, line_number)
        _check_keys(check, obj, PLAIN_KEYS)
        times = [key for key in TIME_KEYS if key in obj]
        if len(times) != 1:
            raise check.fail("give the arrival time as 'arrival_time_s' (seconds) or 'timestamp' (milliseconds), "
                             f"once; got {times or 'neither'}")
        arrival_time_s = _time_s(check, obj, times[0], TIME_KEYS[times[0]])
        prompts = [key for key in PROMPT_KEYS if key in obj]
        if len(prompts) != 1:
            raise check.fail("give exactly one of 'prompt' (text) or 'input_ids' (token ids)")
        prompt, input_ids = obj.get("prompt"), check.id_list(obj, "input_ids")
        if prompt is not None and (not isinstance(prompt, str) or not prompt):
            raise check.fail(f"'prompt' must be non-empty text, got {json.dumps(prompt)}")
        if input_ids is not None:
            if not input_ids:
                raise check.fail("'input_ids' is empty; a request needs at least one prompt token")
            if token_id_limit is not None and max(input_ids) >= token_id_limit:
                position = next(i for i, token in enumerate(input_ids) if token >= token_id_limit)
                raise check.fail(f"'input_ids'[{position}] is {input_ids[position]}, outside the vocabulary: ids must "
                                 f"be below {token_id_limit:,} (--vocab_size, or the --plan's)")
        outputs = [key for key in OUTPUT_KEYS if key in obj]
        if len(outputs) > 1:
            raise check.fail(f"give the output length once, got {outputs}")
        if outputs:
            output_tokens = check.int_field(obj, outputs[0], minimum=1)
        elif output_len is not None:
            output_tokens = output_len
        else:
            raise check.fail(f"no output length: add one of {list(OUTPUT_KEYS)}, or give --output_len N for every row")
        rows.append(TraceRow(line_number, arrival_time_s, output_tokens, prompt=prompt,
                             input_ids=None if input_ids is None else list(input_ids)))
    return rows
