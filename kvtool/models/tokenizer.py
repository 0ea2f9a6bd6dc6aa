"""Tokenizers a plan carries: the checkpoint's Hugging Face tokenizer, or a byte-level fallback.

A plan's ``tokenizer/`` directory holds either the copied Hugging Face tokenizer files or
``kvtool_tokenizer.json`` (byte-level: token id b < 256 is byte b), so text prompts always work,
even for presets with random weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Protocol

BYTE_LEVEL_FILE = "kvtool_tokenizer.json"
# The files transformers' tokenizers are made of; whichever exist are copied into the plan.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
NUM_BYTE_TOKENS = 256


class Tokenizer(Protocol):
    """What the runtime needs from a tokenizer."""

    eos_token_ids: list[int]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteLevelTokenizer:
    """UTF-8 bytes are tokens 0..255; BOS is prepended when the model has one. Ids that are
    neither bytes nor special decode to ``<|id|>`` so random models' output stays readable."""

    def __init__(self, vocab_size: int, bos_token_id: int | None, eos_token_ids: list[int]) -> None:
        if vocab_size < NUM_BYTE_TOKENS:
            raise ValueError(f"a byte-level tokenizer needs a vocabulary of at least {NUM_BYTE_TOKENS} tokens, "
                             f"the model has {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids)
        self._special_ids = set(self.eos_token_ids) | ({bos_token_id} if bos_token_id is not None else set())

    def encode(self, text: str) -> list[int]:
        prefix = [self.bos_token_id] if self.bos_token_id is not None else []
        return prefix + list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        pieces: list[str] = []
        pending = bytearray()
        for token_id in token_ids:
            token_id = int(token_id)
            if token_id in self._special_ids:
                continue
            if 0 <= token_id < NUM_BYTE_TOKENS:
                pending.append(token_id)
                continue
            pieces.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            pieces.append(f"<|{token_id}|>")
        pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def to_dict(self) -> dict:
        return {"type": "byte_level", "vocab_size": self.vocab_size, "bos_token_id": self.bos_token_id,
                "eos_token_ids": self.eos_token_ids}


class HuggingFaceTokenizer:
    """A copied Hugging Face tokenizer. ``tokenizer.json`` loads with the fast ``tokenizers``
    library; other layouts (e.g. sentencepiece only) go through transformers' AutoTokenizer,
    which also renders the chat template (``apply_chat_template``)."""

    def __init__(self, directory: Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.directory = directory
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        if (directory / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as FastTokenizer

            self._fast = FastTokenizer.from_file(str(directory / "tokenizer.json"))
            self._auto = None
        else:
            from transformers import AutoTokenizer

            self._fast = None
            self._auto = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            # encode_batch: the same ids, but it lets other threads run meanwhile (encode holds the GIL
            # throughout, seconds for a long prompt), so kvtool serve keeps answering while a worker
            # thread tokenizes. It was also faster here: 6 s against 24 s for 7 MB (a word-level tokenizer).
            return list(self._fast.encode_batch([text])[0].ids)
        return list(self._auto.encode(text))

    def decode(self, token_ids: list[int]) -> str:
        ids = [int(t) for t in token_ids]
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=True)
        return self._auto.decode(ids, skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        if (self.directory / "chat_template.jinja").is_file():
            return True
        config = self.directory / "tokenizer_config.json"
        return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))

    def render_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """``messages`` ([{"role": ..., "content": ...}]) as text in the model's chat format."""
        if not self.has_chat_template:
            raise ValueError(f"the tokenizer in {self.directory} has no chat template: build the plan from a chat "
                             "model's checkpoint, or leave the chat template off")
        if self._auto is None:
            from transformers import AutoTokenizer

            self._auto = AutoTokenizer.from_pretrained(str(self.directory), local_files_only=True)
        return self._auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of chat-formatted text: its special tokens are written out, none is added."""
        if self._fast is not None:
            return list(self._fast.encode_batch([text], add_special_tokens=False)[0].ids)  # see encode
        return list(self._auto.encode(text, add_special_tokens=False))

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` in the model's chat format (as transformers' apply_chat_template)."""
        return self.encode_chat(self.render_chat_template(messages, add_generation_prompt=add_generation_prompt))


def has_hf_tokenizer(checkpoint_dir: Path) -> bool:
    return (checkpoint_dir / "tokenizer.json").is_file() or (checkpoint_dir / "tokenizer.model").is_file()


def write_tokenizer(output_dir: Path, *, checkpoint_dir: Path | None, vocab_size: int, bos_token_id: int | None,
                    eos_token_ids: list[int]) -> str:
    """Fill ``output_dir`` (the plan's tokenizer/) and return its kind: "huggingface" or "byte_level"."""
    output_dir.mkdir(parents=True, exist_ok=True)
    if checkpoint_dir is not None and has_hf_tokenizer(checkpoint_dir):
        for name in HF_TOKENIZER_FILES:
            if (checkpoint_dir / name).is_file():
                shutil.copy2(checkpoint_dir / name, output_dir / name)
        return "huggingface"
    byte_level = ByteLevelTokenizer(vocab_size, bos_token_id, eos_token_ids)
    (output_dir / BYTE_LEVEL_FILE).write_text(json.dumps(byte_level.to_dict(), indent=2) + "\n")
    return "byte_level"


def load_tokenizer(directory: Path, kind: str, *, vocab_size: int, eos_token_ids: list[int]) -> Tokenizer:
    """The tokenizer stored by ``write_tokenizer``; the model config's EOS ids are authoritative."""
    if kind == "huggingface":
        return HuggingFaceTokenizer(directory, vocab_size, eos_token_ids)
    if kind == "byte_level":
        data = json.loads((directory / BYTE_LEVEL_FILE).read_text())
        return ByteLevelTokenizer(data["vocab_size"], data["bos_token_id"], eos_token_ids)
    raise ValueError(f"tokenizer kind {kind!r} is unknown: expected 'huggingface' or 'byte_level'")
