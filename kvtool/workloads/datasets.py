"""Dataset files: JSON Lines of requests (the README's "Dataset format"), read and validated line by
line, so that a malformed line is a DatasetError naming the file and the line before anything runs.

For a multi-turn session, a line holds only its turn's new tokens or text: the replay prepends the
conversation so far when it issues the turn. A trace imported by `kvtool dataset import` gives its
prompts as block hash ids, whose token ids are made when read (kvtool.workloads.hash_prompt).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtool.errors import DatasetError
from kvtool.files import atomic_write
from kvtool.workloads.hash_prompt import HashPromptReader
from kvtool.workloads.trace_tokens import MIN_TOKEN_ID

if TYPE_CHECKING:
    from kvtool.config import KvCacheRetentionConfig

# Token ids reach the engine as int32, extra ids as uint64: a larger id is no id of any model.
ID_LIMITS = {"input_ids": 1 << 31, "extra_ids": 1 << 64}
HASH_KEYS = ("hash_ids", "hash_block_len", "input_length", "token_id_limit")  # a prompt of hash ids
ALLOWED_KEYS = ("input_ids", "prompt", "output_tokens", "max_tokens", "session_id", "turn",
                "arrival_time_s", "extra_ids", "priority", "cache_salt", "request_id", "task_id",
                "kv_cache_retention_config", *HASH_KEYS)


@dataclass(frozen=True)
class DatasetRecord:
    """One validated dataset line.

    For a session turn, ``input_ids``/``prompt`` hold only this turn's new tokens/text. ``input_ids``
    is a tuple, or a HashBlockPrompt for a line of hash ids (its ids made when read).
    """

    line_number: int
    output_tokens: int
    input_ids: Sequence[int] | None = None
    prompt: str | None = None
    session_id: str | None = None
    turn: int | None = None
    arrival_time_s: float | None = None
    extra_ids: tuple[int, ...] | None = None
    priority: int | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    # Retention of token ranges (kvtool.config.KvCacheRetentionConfig; TensorRT-LLM's JSON field names).
    kv_cache_retention_config: KvCacheRetentionConfig | None = None


@dataclass(frozen=True)
class Dataset:
    """A dataset file's records in file order."""

    path: Path
    records: tuple[DatasetRecord, ...]
    sha256: str = ""             # of the file's bytes: tells whether two reports replayed the same workload

    def __len__(self) -> int:
        return len(self.records)

    def where(self, record: DatasetRecord) -> str:
        """'file line N': how error messages point at a record."""
        return f"{self.path} line {record.line_number}"

    @property
    def num_sessions(self) -> int:
        return len({r.session_id for r in self.records if r.session_id is not None})


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


class LineChecker:
    """Checks the fields of one line and builds its error message: '<file> line <n>: <what is wrong>'."""

    def __init__(self, path: Path, line_number: int) -> None:
        self.path = path
        self.line_number = line_number

    def fail(self, what: str) -> DatasetError:
        return DatasetError(f"{self.path} line {self.line_number}: {what}")

    def int_field(self, obj: Mapping, key: str, *, minimum: int, maximum: int | None = None) -> int | None:
        if key not in obj:
            return None
        value = obj[key]
        if not _is_int(value):
            raise self.fail(f"'{key}' must be an integer, got {json.dumps(value)}")
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
            raise self.fail(f"'{key}' must be {bounds}, got {value}")
        return value

    def id_list(self, obj: Mapping, key: str, limit: int | None = None) -> tuple[int, ...] | None:
        """A list of non-negative integers below ``limit`` (default: the key's ID_LIMITS)."""
        if key not in obj:
            return None
        value = obj[key]
        limit = ID_LIMITS[key] if limit is None else limit
        if not isinstance(value, list):
            raise self.fail(f"'{key}' must be a list of non-negative integers, got {type(value).__name__}")
        if value and set(map(type, value)) == {int} and min(value) >= 0 and max(value) < limit:
            return tuple(value)  # the common case, 20x faster than the loop that finds what is wrong
        for position, item in enumerate(value):
            if not _is_int(item) or item < 0:
                raise self.fail(f"'{key}'[{position}] must be a non-negative integer, got {json.dumps(item)}")
            if item >= limit:
                raise self.fail(f"'{key}'[{position}] is {item}, beyond any vocabulary: ids must be below "
                                f"{limit:,} (use the ids of the model's vocabulary)")
        return tuple(value)

    def name_field(self, obj: Mapping, key: str) -> str | None:
        """A string or integer identifier, kept as a string."""
        if key not in obj or obj[key] is None:
            return None
        value = obj[key]
        if isinstance(value, str) and value:
            return value
        if _is_int(value):
            return str(value)
        raise self.fail(f"'{key}' must be a non-empty string or an integer, got {json.dumps(value)}")


def _hash_prompt(check: LineChecker, obj: Mapping, hash_prompts: HashPromptReader | None):
    """The prompt of a line of hash ids (kvtool.workloads.hash_prompt), or None for another line."""
    if "hash_ids" not in obj:
        given = [key for key in HASH_KEYS if key in obj]
        if given:
            raise check.fail(f"'{given[0]}' goes with 'hash_ids' (a prompt of block hash ids); leave it out")
        return None
    missing = [key for key in HASH_KEYS if key not in obj]
    if missing:
        raise check.fail(f"'hash_ids' needs {', '.join(repr(key) for key in missing)} as well (a line of hash ids "
                         "has 'hash_ids', 'hash_block_len', 'input_length' and 'token_id_limit')")
    hash_ids = check.id_list(obj, "hash_ids", limit=1 << 63)
    block_len = check.int_field(obj, "hash_block_len", minimum=2)
    num_tokens = check.int_field(obj, "input_length", minimum=1)
    token_id_limit = check.int_field(obj, "token_id_limit", minimum=MIN_TOKEN_ID + 2, maximum=ID_LIMITS["input_ids"])
    if len(hash_ids) != -(-num_tokens // block_len):
        raise check.fail(f"'input_length' {num_tokens} takes {-(-num_tokens // block_len)} blocks of 'hash_block_len' "
                         f"{block_len} tokens, but 'hash_ids' has {len(hash_ids)}")
    if hash_prompts is None:
        raise check.fail("a line of 'hash_ids' is read with the rest of its file (load_dataset)")
    return hash_prompts.add(check.line_number, hash_ids, block_len, num_tokens, token_id_limit)


def parse_line(obj, path: Path, line_number: int, hash_prompts: HashPromptReader | None = None) -> DatasetRecord:
    """Validates one decoded JSON line; raises DatasetError naming the line. A line of hash ids is
    added to ``hash_prompts`` (its prompt is readable once that has read the whole file)."""
    check = LineChecker(path, line_number)
    if not isinstance(obj, dict):
        raise check.fail(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(ALLOWED_KEYS))
    if unknown:
        raise check.fail(f"unknown key(s) {unknown}; allowed keys are {list(ALLOWED_KEYS)}")

    if sum(key in obj for key in ("input_ids", "prompt", "hash_ids")) != 1:
        raise check.fail("give exactly one of 'input_ids' (token ids), 'prompt' (text) or 'hash_ids' (block hash "
                         "ids of an imported trace)")
    input_ids = check.id_list(obj, "input_ids")
    hash_prompt = _hash_prompt(check, obj, hash_prompts)
    if hash_prompt is not None:
        input_ids = hash_prompt
    prompt = obj.get("prompt")
    if input_ids is not None and not input_ids and "session_id" not in obj:
        raise check.fail("'input_ids' is empty; a request needs at least one prompt token")
    if "prompt" in obj and not isinstance(prompt, str):
        raise check.fail(f"'prompt' must be a string, got {json.dumps(prompt)}")
    if prompt is not None and not prompt and "session_id" not in obj:
        raise check.fail("'prompt' is empty; a request needs at least one prompt token")

    if ("output_tokens" in obj) == ("max_tokens" in obj):
        raise check.fail("give exactly one of 'output_tokens' or 'max_tokens' (the number of tokens to generate)")
    length_key = "output_tokens" if "output_tokens" in obj else "max_tokens"
    output_tokens = check.int_field(obj, length_key, minimum=1)

    extra_ids = check.id_list(obj, "extra_ids")
    if extra_ids is not None:
        if input_ids is None:
            raise check.fail("'extra_ids' needs 'input_ids' (one extra id per input token), not a text prompt")
        if len(extra_ids) != len(input_ids):
            raise check.fail(f"'extra_ids' has {len(extra_ids)} entries but 'input_ids' has {len(input_ids)}; "
                             "give one extra id per input token (0 for a normal token)")

    session_id = check.name_field(obj, "session_id")
    turn = check.int_field(obj, "turn", minimum=0)
    if session_id is not None and turn is None:
        raise check.fail("'session_id' needs 'turn' (0, 1, 2, ... within the session)")
    if turn is not None and session_id is None:
        raise check.fail("'turn' needs 'session_id' (the conversation the turn belongs to)")

    arrival_time_s = obj.get("arrival_time_s")
    if arrival_time_s is not None and (not _is_number(arrival_time_s) or arrival_time_s < 0):
        raise check.fail(f"'arrival_time_s' must be a number of seconds >= 0, got {json.dumps(arrival_time_s)}")

    priority = check.int_field(obj, "priority", minimum=0, maximum=100)
    cache_salt = obj.get("cache_salt")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise check.fail(f"'cache_salt' must be a string, got {json.dumps(cache_salt)}")

    request_id = check.name_field(obj, "request_id")
    task_id = check.name_field(obj, "task_id")
    retention = None
    if obj.get("kv_cache_retention_config") is not None:
        from kvtool.config import retention_from_json  # noqa: PLC0415 - the C++ extension, only when used

        try:
            retention = retention_from_json(obj["kv_cache_retention_config"])
        except ValueError as error:
            raise check.fail(str(error)) from None
    return DatasetRecord(
        line_number=line_number, output_tokens=output_tokens, input_ids=input_ids, prompt=prompt,
        session_id=session_id, turn=turn,
        arrival_time_s=None if arrival_time_s is None else float(arrival_time_s),
        extra_ids=extra_ids, priority=priority, cache_salt=cache_salt or None,
        request_id=request_id if request_id is not None else task_id, kv_cache_retention_config=retention)


def _check_sessions_and_ids(path: Path, records: list[DatasetRecord]) -> None:
    """Turns of a session are consecutive in file order (from 0 or 1); request ids are unique."""
    next_turn: dict[str, tuple[int, int]] = {}  # session_id -> (expected turn, line of the last turn)
    seen_turns: dict[tuple[str, int], int] = {}
    seen_ids: dict[str, int] = {}
    for record in records:
        where = f"{path} line {record.line_number}"
        if record.request_id is not None:
            if record.request_id in seen_ids:
                raise DatasetError(f"{where}: request id {record.request_id!r} was already used on line "
                                   f"{seen_ids[record.request_id]}; give each request its own id")
            seen_ids[record.request_id] = record.line_number
        if record.session_id is None:
            continue
        key = (record.session_id, record.turn)
        if key in seen_turns:
            raise DatasetError(f"{where}: duplicate turn {record.turn} of session {record.session_id!r} "
                               f"(first on line {seen_turns[key]})")
        seen_turns[key] = record.line_number
        if record.session_id not in next_turn:
            if record.turn not in (0, 1):
                raise DatasetError(f"{where}: session {record.session_id!r} starts at turn {record.turn}; "
                                   "the first turn of a session must be 0 (or 1)")
            if (record.input_ids is not None and not record.input_ids) or record.prompt == "":
                raise DatasetError(f"{where}: the first turn of session {record.session_id!r} has an empty "
                                   "prompt; a request needs at least one prompt token")
        else:
            expected, last_line = next_turn[record.session_id]
            if record.turn != expected:
                raise DatasetError(f"{where}: session {record.session_id!r} jumps to turn {record.turn} after "
                                   f"turn {expected - 1} (line {last_line}); turns must be consecutive and "
                                   "in file order")
        next_turn[record.session_id] = (record.turn + 1, record.line_number)


def load_dataset(path: str | os.PathLike) -> Dataset:
    """Reads and validates a JSON Lines dataset; raises DatasetError naming the file and line."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset {path} does not exist; generate one with `kvtool dataset ...`")
    if path.is_dir():
        raise DatasetError(f"dataset {path} is a directory; give a JSON Lines file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # a byte order mark (as Windows editors write) is not part of line 1
    except UnicodeDecodeError as error:
        raise DatasetError(f"dataset {path} is not a UTF-8 text file ({error.reason} at byte {error.start}): "
                           "give a JSON Lines file (see `kvtool dataset`)") from None
    records: list[DatasetRecord] = []
    hash_prompts = HashPromptReader(path)
    for line_number, line in enumerate(text.replace("\r\n", "\n").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatasetError(f"{path} line {line_number}: not valid JSON ({error.msg} at column "
                               f"{error.colno})") from None
        records.append(parse_line(obj, path, line_number, hash_prompts))
    hash_prompts.finish()
    if not records:
        raise DatasetError(f"dataset {path} has no requests (the file is empty)")
    _check_sessions_and_ids(path, records)
    return Dataset(path=path, records=tuple(records), sha256=hashlib.sha256(data).hexdigest())


def write_jsonl(path: str | os.PathLike, lines: Iterable[Mapping]) -> Path:
    """Writes one JSON object per line, atomically (a temporary file, then os.replace)."""
    path = Path(path)
    with atomic_write(path) as out:
        for line in lines:
            out.write(json.dumps(line, separators=(",", ":")))
            out.write("\n")
    return path
