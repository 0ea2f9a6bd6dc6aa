"""Workloads of real text: the system-prompt, multi-turn and A,B,A,B generators, with prompts cut
from a text file and tokenized by a plan's tokenizer (its chat template applied when asked).

Lines hold token ids (``input_ids``), so every engine that replays the file sees the same tokens.
Lengths are budgets in tokens of the text itself (chat markup comes on top): a passage is the
longest run of whole sentences from the file that fits its budget (whole words when no sentence
ends in time); a question quotes a fragment of its group's passage after a fixed instruction, so
the questions of a group are distinct. Passages follow each other through the file and never
overlap, so prompts of different groups share no text.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtool.workloads.generators import GeneratorOptions, Line, check_positive, Sampler
from kvtool.errors import KvtoolError

QUESTION = 'In one sentence, what does the text say about this: "{}"?'
SUMMARY_REQUEST = "Summarize this text.\n\n{}"
# Stands in for a generated answer when a later turn's chat markup is cut out of the template's output.
_ANSWER_PLACEHOLDER = "\x00answer\x00"
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


@dataclass
class TextSource:
    """A text file cut into passages for one dataset, with the tokenizer that counts and encodes them."""

    words: list[str]            # the file's words with the whitespace after each
    tokenizer: object           # kvtool.models.tokenizer.Tokenizer (apply_chat_template when chat is on)
    chat: bool
    where: str                  # the file's name, for error messages
    cursor: int = 0             # the next unused word

    @classmethod
    def from_file(cls, path: str | Path, tokenizer, *, chat: bool) -> TextSource:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8-sig")  # without a byte order mark in the first prompt
        except UnicodeDecodeError:
            raise KvtoolError(f"text file {path} is not UTF-8 text") from None
        words = re.findall(r"\S+\s*", text)
        if not words:
            raise KvtoolError(f"text file {path} holds no words: give an English (or any) text file")
        if chat and not getattr(tokenizer, "has_chat_template", False):
            raise KvtoolError("--chat_template needs a plan whose tokenizer has a chat template (a chat model's "
                              "checkpoint or GGUF file); drop --chat_template to use the text as is")
        return cls(words, tokenizer, chat, str(path))

    def num_text_tokens(self, text: str) -> int:
        return len(self._plain_ids(text))

    def passage(self, budget: int) -> list[str]:
        """The next passage of at most ``budget`` tokens (its words); the cursor moves past it."""
        start = self.cursor
        remaining = len(self.words) - start
        fits = bisect.bisect_right(range(remaining + 1), budget,
                                   key=lambda n: self.num_text_tokens(_join(self.words[start:start + n]))) - 1
        if fits < 1 or fits == remaining and self.num_text_tokens(_join(self.words[start:])) < budget // 2:
            raise KvtoolError(f"the text in {self.where} ran out after {start} of its {len(self.words)} words: "
                              f"this workload needs more text; give a longer file or smaller lengths / fewer "
                              "prompts")
        ends = [n for n in range(fits, 0, -1) if _SENTENCE_END.search(self.words[start + n - 1].rstrip())]
        count = ends[0] if ends and ends[0] >= fits // 2 else fits
        self.cursor = start + count
        return self.words[start:start + count]

    def question(self, passage: Sequence[str], index: int, budget: int) -> str:
        """Question ``index`` about a passage: the instruction quoting a fragment that starts at the
        passage's index-th sentence (then at other words), cut to fit ``budget`` tokens."""
        sentences = [0] + [n + 1 for n, word in enumerate(passage[:-1])
                           if _SENTENCE_END.search(word.rstrip()) or "\n" in word]  # sentences and headings
        # Sentence starts first; past them, other words, so a short passage still gives distinct questions.
        is_sentence = set(sentences)
        starts = sentences + [n for n in range(len(passage)) if n not in is_sentence]
        start = starts[index % len(starts)]
        words = list(passage[start:]) + list(passage[:start])

        def quote(n: int) -> str:
            return QUESTION.format(" ".join(_join(words[:n]).split()))

        fits = bisect.bisect_right(range(len(words) + 1), budget, key=lambda n: self.num_text_tokens(quote(n))) - 1
        if fits < 1:
            raise KvtoolError(f"a question of {budget} tokens is too short for the instruction "
                              f"({self.num_text_tokens(quote(0))} tokens): raise the question length")
        return quote(fits)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """A first prompt: the chat template applied, or the contents joined by blank lines."""
        if self.chat:
            return self.tokenizer.apply_chat_template(messages)
        return [int(t) for t in self.tokenizer.encode("\n\n".join(m["content"] for m in messages))]

    def next_turn_ids(self, history: list[dict[str, str]], message: str) -> list[int]:
        """The ids a later turn adds after the generated answer: in chat form the markup that closes the
        answer, the new user message and the assistant header; else a blank line and the message."""
        if not self.chat:
            return self._plain_ids("\n\n" + message)
        rendered = self.tokenizer.render_chat_template(
            history + [{"role": "assistant", "content": _ANSWER_PLACEHOLDER}, {"role": "user", "content": message}])
        return self.tokenizer.encode_chat(rendered.rsplit(_ANSWER_PLACEHOLDER, 1)[1])

    @functools.cached_property
    def _added_prefix(self) -> list[int]:
        return [int(t) for t in self.tokenizer.encode("")]

    def _plain_ids(self, text: str) -> list[int]:
        # Without the tokenizer's own prefix (a BOS token), which belongs only at a prompt's start.
        ids = [int(t) for t in self.tokenizer.encode(text)]
        prefix = self._added_prefix
        return ids[len(prefix):] if prefix and ids[:len(prefix)] == prefix else ids


def _join(words: Sequence[str]) -> str:
    return "".join(words).strip()


def _messages(system: str | None, user: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def text_system_prompt(source: TextSource, options: GeneratorOptions, *, num_groups: int, prompts_per_group: int,
                       system_prompt_len: int, question_len: int, output_len: int,
                       shuffle: bool = False) -> list[Line]:
    """num_groups x prompts_per_group requests; a group's requests share a passage as system prompt and
    each asks its own question about it."""
    check_positive(num_groups=num_groups, prompts_per_group=prompts_per_group, system_prompt_len=system_prompt_len,
              question_len=question_len, output_len=output_len)
    sampler = Sampler(options)
    lines = []
    for _group in range(num_groups):
        passage = source.passage(sampler.length(system_prompt_len))
        for index in range(prompts_per_group):
            question = source.question(passage, index, sampler.length(question_len))
            lines.append({"input_ids": source.prompt_ids(_messages(_join(passage), question)),
                          "output_tokens": sampler.length(output_len)})
    if shuffle:
        sampler.rng.shuffle(lines)
    return lines


def text_multi_turn(source: TextSource, options: GeneratorOptions, *, num_sessions: int, num_turns: int,
                    user_turn_len: int, answer_len: int, system_prompt_len: int = 0,
                    shared_system_prompt: bool = True) -> list[Line]:
    """Chat sessions asking questions about a passage of the text, turn by turn (all turns 0, then 1, ...).
    With a system prompt, the questions are about it; without, each session has a passage of its own
    that its first message quotes from."""
    check_positive(num_sessions=num_sessions, num_turns=num_turns, user_turn_len=user_turn_len, answer_len=answer_len)
    sampler = Sampler(options)
    shared = source.passage(sampler.length(system_prompt_len)) if system_prompt_len and shared_system_prompt else None
    sessions = []
    for _session in range(num_sessions):
        if system_prompt_len:
            passage = shared if shared is not None else source.passage(sampler.length(system_prompt_len))
            sessions.append((_join(passage), passage))
        else:
            sessions.append((None, source.passage(num_turns * user_turn_len)))
    histories: list[list[dict[str, str]]] = [[] for _ in sessions]
    lines = []
    for turn in range(num_turns):
        for number, (system, passage) in enumerate(sessions):
            question = source.question(passage, number + turn * num_sessions, sampler.length(user_turn_len))
            if turn == 0:
                histories[number] = _messages(system, question)
                ids = source.prompt_ids(histories[number])
            else:
                ids = source.next_turn_ids(histories[number], question)
                histories[number] += [{"role": "assistant", "content": _ANSWER_PLACEHOLDER},
                                      {"role": "user", "content": question}]
            lines.append({"session_id": f"s{number}", "turn": turn, "input_ids": ids,
                          "output_tokens": sampler.length(answer_len)})
    return lines


def text_abab(source: TextSource, options: GeneratorOptions, *, prompt_len: int, num_rounds: int,
              output_len: int) -> list[Line]:
    """Two passages A and B (each asking for a summary) alternating A, B, A, B, ..."""
    check_positive(prompt_len=prompt_len, num_rounds=num_rounds, output_len=output_len)
    sampler = Sampler(options)
    prompts = {name: source.prompt_ids(_messages(None, SUMMARY_REQUEST.format(_join(source.passage(prompt_len)))))
               for name in ("A", "B")}
    return [{"request_id": f"{name}{round_}", "input_ids": list(prompts[name]), "output_tokens": sampler.length(output_len)}
            for round_ in range(num_rounds) for name in ("A", "B")]

