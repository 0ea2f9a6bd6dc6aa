"""The text a streaming client reads adds up to the whole answer: a character split over byte tokens
waits for its last byte, and a stop string is never sent, not even its first characters."""

from __future__ import annotations

from kvtool.models.tokenizer import ByteLevelTokenizer
from kvtool.serve.detokenize import TextAssembler

TOKENIZER = ByteLevelTokenizer(512, None, [])


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text)


def stream(text: str, stop=None, finish_at: int | None = None) -> list[str]:
    """The deltas sent while the output grows one token at a time (finished at ``finish_at`` tokens)."""
    assembler, tokens = TextAssembler(TOKENIZER, stop), ids(text)
    end = len(tokens) if finish_at is None else finish_at
    return [assembler.delta(tokens[:n], finished=n == end) for n in range(1, end + 1)]


def test_pieces_add_up_to_the_text_and_a_split_character_waits_for_its_last_byte():
    pieces = stream("naïve €")
    assert "".join(pieces) == "naïve €"
    assert "\ufffd" not in "".join(pieces)
    assert pieces[2] == "" and pieces[3] == "ï"  # 'ï' is two bytes: nothing, then the character


def test_a_stop_string_is_held_back_and_cut_from_the_end():
    text = "one, two. STOP here"
    pieces = stream(text, stop=["STOP"], finish_at=len(ids("one, two. STOP")))
    assert "".join(pieces) == "one, two. "
    assert all("S" not in piece for piece in pieces)
    assert TextAssembler(TOKENIZER, ["STOP"]).full_text(ids(text)) == "one, two. "
