"""The text a streaming client reads adds up to the whole answer: a character split over byte tokens
waits for its last byte, and a stop string is never sent, not even its first characters."""

from __future__ import annotations

from kvtool import SamplingParams
from kvtool.models.tokenizer import ByteLevelTokenizer
from kvtool.runtime.request import Request
from kvtool.serve.detokenize import TextAssembler

TOKENIZER = ByteLevelTokenizer(512, None, [])


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text)


def assembler(stop=None) -> TextAssembler:
    return TextAssembler(Request([1], SamplingParams(stop=stop)), TOKENIZER)


def stream(text: str, stop=None, finish_at: int | None = None) -> list[str]:
    """The deltas sent while the output grows one token at a time (finished at ``finish_at`` tokens), each
    token given to the detokenizer as the engine gives it."""
    text_assembler, tokens = assembler(stop), ids(text)
    end = len(tokens) if finish_at is None else finish_at
    pieces = []
    for n in range(1, end + 1):
        text_assembler.detokenizer.append(tokens[n - 1])
        pieces.append(text_assembler.delta(finished=n == end))
    return pieces


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
    whole = assembler(["STOP"])
    for token_id in ids(text):
        whole.detokenizer.append(token_id)
    assert whole.full_text() == "one, two. "
