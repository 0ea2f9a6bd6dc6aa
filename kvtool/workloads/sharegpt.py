"""Import a local ShareGPT-style JSON file as multi-turn sessions.

Input: ``[{"id": ..., "conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}, ...]}, ...]``
(messages with ``role``/``content`` keys are accepted too). Each conversation becomes a session;
each human message followed by an answer becomes a turn whose ``prompt`` is the human text and
whose ``max_tokens`` is the length of the recorded answer: counted with a tokenizer when one is
given, else approximated as ceil(characters / 4). A system message is put in front of the first
human message. Conversations with no human-then-answer pair are skipped (and counted).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtool.errors import DatasetError

USER_ROLES = frozenset({"human", "user"})
ANSWER_ROLES = frozenset({"gpt", "assistant", "chatgpt", "bard", "bing", "model"})
SYSTEM_ROLES = frozenset({"system"})


def approximate_token_count(text: str) -> int:
    """ceil(characters / 4), at least 1: the usual rule of thumb for English text."""
    return max(1, math.ceil(len(text) / 4))


@dataclass(frozen=True)
class ShareGptImport:
    """The dataset lines of an import and what was left out."""

    lines: list[dict]
    num_sessions: int
    num_turns: int
    num_skipped_conversations: int


def _messages(entry) -> list[tuple[str, str]] | None:
    """(role, text) pairs of one conversation, or None when the entry has no usable conversation."""
    if not isinstance(entry, dict):
        return None
    conversation = entry.get("conversations", entry.get("conversation", entry.get("messages")))
    if not isinstance(conversation, list):
        return None
    messages = []
    for message in conversation:
        if not isinstance(message, dict):
            return None
        role = message.get("from", message.get("role"))
        text = message.get("value", message.get("content"))
        if not isinstance(role, str) or not isinstance(text, str):
            return None
        messages.append((role.lower(), text))
    return messages


def _turns(messages: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(user text, answer text) pairs; consecutive user messages are joined, unanswered ones dropped."""
    turns = []
    system, pending = "", []
    for role, text in messages:
        if role in SYSTEM_ROLES and not turns and not pending:
            system = text
        elif role in USER_ROLES:
            pending.append(text)
        elif role in ANSWER_ROLES and pending:
            user_text = "\n".join(pending)
            if not turns and system:
                user_text = system + "\n" + user_text
            turns.append((user_text, text))
            pending = []
    return [(user, answer) for user, answer in turns if user]


def import_sharegpt(path: str | os.PathLike, *, count_tokens: Callable[[str], int] = approximate_token_count,
                    max_sessions: int | None = None, max_turns: int | None = None,
                    max_output_tokens: int | None = None) -> ShareGptImport:
    """Reads a ShareGPT-style JSON file into multi-turn dataset lines (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"ShareGPT file {path} does not exist or is not a file")
    try:
        with path.open(encoding="utf-8-sig") as source:  # a byte order mark is not JSON
            entries = json.load(source)
    except json.JSONDecodeError as error:
        raise DatasetError(f"{path}: not valid JSON ({error.msg} at line {error.lineno}, column {error.colno})") from None
    except UnicodeDecodeError as error:
        raise DatasetError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start}): give a ShareGPT JSON "
                           "file") from None
    if not isinstance(entries, list):
        raise DatasetError(f"{path}: expected a JSON list of conversations, got {type(entries).__name__}")
    for name, value in (("max_sessions", max_sessions), ("max_turns", max_turns),
                        ("max_output_tokens", max_output_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")

    sessions: list[tuple[str, list[tuple[str, str]]]] = []
    used_ids: set[str] = set()
    skipped = 0
    for index, entry in enumerate(entries):
        if max_sessions is not None and len(sessions) >= max_sessions:
            break
        messages = _messages(entry)
        turns = _turns(messages) if messages is not None else []
        if not turns:
            skipped += 1
            continue
        session_id = str(entry.get("id", index))
        while session_id in used_ids:  # ShareGPT dumps repeat ids across split conversations
            session_id += "+"
        used_ids.add(session_id)
        sessions.append((session_id, turns[:max_turns] if max_turns else turns))

    # Turn by turn, as a chat service sees them: every session's turn 0, then every turn 1, ...
    lines = []
    depth = max((len(turns) for _, turns in sessions), default=0)
    for turn in range(depth):
        for session_id, turns in sessions:
            if turn < len(turns):
                user_text, answer = turns[turn]
                output_tokens = max(1, count_tokens(answer))
                if max_output_tokens is not None:
                    output_tokens = min(output_tokens, max_output_tokens)
                lines.append({"session_id": session_id, "turn": turn, "prompt": user_text,
                              "max_tokens": output_tokens})
    return ShareGptImport(lines=lines, num_sessions=len(sessions), num_turns=len(lines),
                          num_skipped_conversations=skipped)
