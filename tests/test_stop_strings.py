"""Stop strings and output text: each token is decoded once (a window of a few tokens, not the whole
output), and the text is what decoding the whole output gives, ending before the first stop string
(OpenAI's and vLLM's rule: the stop string is never part of the text; the tokens that made it are
part of token_ids). The reference below decodes the whole output at every token, as kvtool did."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool import LLM, KvCacheConfig, SamplingParams, SchedulerConfig
from kvtool.models.tokenizer import ByteLevelTokenizer
from kvtool.runtime.detokenizer import IncrementalDetokenizer
from kvtool.runtime.engine import Engine
from kvtool.runtime.request import Request

BOS, EOS = 300, 301
TOKENIZER = ByteLevelTokenizer(512, BOS, [EOS])


class PieceTokenizer:
    """A tokenizer of byte pieces, as BPE's: a piece may hold the end of one character and the start of
    the next, and a character may take several pieces."""

    PIECES = (b"a", b"b", b" ", b".", b"|", b"<>", b"ab", "\u00e9".encode(), b"\xe2", b"\x82\xac", b"ab\xe2",
              b"\x82\xacb", b"\xf0\x9f", b"\x98\x80", b"\x80", b"\xff", b"")

    def decode(self, token_ids: list[int]) -> str:
        return b"".join(self.PIECES[i] for i in token_ids).decode("utf-8", errors="replace")


# Byte-level: ASCII, the bytes of multi-byte characters, bytes never valid in UTF-8, the special
# tokens (never decoded), ids that decode to "<|id|>".
BYTE_LEVEL_IDS = st.lists(st.one_of(st.sampled_from(list(b"ab .|<>")), st.sampled_from(list("\u00e9\u20ac\U0001f600".encode())),
                                    st.sampled_from([0x80, 0xBF, 0xFF]), st.sampled_from([BOS, EOS, 257, 402])),
                          max_size=40)
PIECE_IDS = st.lists(st.integers(0, len(PieceTokenizer.PIECES) - 1), max_size=40)
OUTPUTS = st.one_of(st.tuples(st.just(TOKENIZER), BYTE_LEVEL_IDS), st.tuples(st.just(PieceTokenizer()), PIECE_IDS))
STOPS = st.lists(st.text(alphabet="ab .|<>\u00e9\u20ac\U0001f600024", min_size=1, max_size=4), max_size=3)


def reference_text(tokenizer, token_ids: list[int], stop: list[str]) -> str:
    """The whole output decoded, cut before the first stop string."""
    text = tokenizer.decode(token_ids)
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(cuts)] if cuts else text


def reference_stop_position(tokenizer, token_ids: list[int], stop: list[str]) -> int | None:
    """How many tokens until the output's decoded text first holds a stop string."""
    for n in range(1, len(token_ids) + 1):
        if any(s in tokenizer.decode(token_ids[:n]) for s in stop):
            return n
    return None


@settings(max_examples=500, deadline=None)
@given(output=OUTPUTS, stop=STOPS)
def test_incremental_text_is_the_whole_decode_cut_before_the_first_stop_string(output, stop):
    tokenizer, token_ids = output
    detokenizer = IncrementalDetokenizer(tokenizer, stop)
    stopped_at = None
    shown = ""
    for n, token_id in enumerate(token_ids, start=1):
        if detokenizer.append(token_id) and stopped_at is None:
            stopped_at = n
        streamed = detokenizer.text()
        assert streamed.startswith(shown), "streamed text only grows"
        shown = streamed
        assert not any(s in streamed for s in stop), "a stop string is never shown"
    assert stopped_at == reference_stop_position(tokenizer, token_ids, stop)
    assert detokenizer.text(finished=True) == reference_text(tokenizer, token_ids, stop)
    assert reference_text(tokenizer, token_ids, stop).startswith(shown)


@settings(max_examples=200, deadline=None)
@given(output=OUTPUTS)
def test_text_without_stop_strings_equals_the_whole_decode_at_every_length(output):
    tokenizer, token_ids = output
    detokenizer = IncrementalDetokenizer(tokenizer)
    for n, token_id in enumerate(token_ids, start=1):
        assert not detokenizer.append(token_id)
        assert detokenizer.text(finished=True) == tokenizer.decode(token_ids[:n])
        # While streaming, a character whose bytes have not all come yet is held back.
        assert tokenizer.decode(token_ids[:n]).startswith(detokenizer.text())


def test_characters_that_may_start_a_stop_string_wait_while_streaming():
    detokenizer = IncrementalDetokenizer(TOKENIZER, ["END"])
    for token_id in TOKENIZER.encode("one EN")[1:]:
        detokenizer.append(token_id)
    assert detokenizer.text() == "one "  # "EN" may become "END"
    assert detokenizer.text(finished=True) == "one EN"
    assert detokenizer.append(ord("D")) and detokenizer.text() == "one "


class CountingTokenizer(ByteLevelTokenizer):
    def __init__(self) -> None:
        super().__init__(512, None, [])
        self.num_decoded_tokens = 0

    def decode(self, token_ids: list[int]) -> str:
        self.num_decoded_tokens += len(token_ids)
        return super().decode(token_ids)


class _LetterRunner:
    """An executor with a free forward whose token cycles through 'a'..'z' by position."""

    def execute_step(self, batch, requests, generators):
        if not len(batch):
            return None
        return [ord("a") + (r.num_cached_tokens + r.num_tokens) % 26 for r in batch.requests if r.samples]

    def make_generator(self, params):
        return None


def _letter_engine(tokenizer) -> Engine:
    cache = KvCacheConfig().to_core(tokens_per_block=16, num_primary_blocks=256, num_secondary_blocks=0,
                                    max_attention_window=None)
    scheduler = SchedulerConfig().to_core(max_batch_size=4, max_num_tokens=4096, max_seq_len=4096)
    return Engine(_LetterRunner(), cache, scheduler, vocab_size=512, eos_token_ids=[], bytes_per_token=1,
                  tokenizer=tokenizer)


def _run(engine: Engine, request: Request) -> Request:
    engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    return request


def test_a_long_output_with_stop_strings_decodes_each_token_a_few_times_not_the_whole_output():
    tokenizer = CountingTokenizer()
    request = _run(_letter_engine(tokenizer), Request([1], SamplingParams(max_tokens=2000, temperature=0, stop=["never"])))
    assert request.finish_reason == "length" and request.num_output_tokens == 2000
    # Each new token: a window of itself and the token before (twice); decoding the whole output at
    # each token, as before, took 2,001,000 token decodes.
    assert tokenizer.num_decoded_tokens <= 4 * 2000


def test_the_engine_stops_at_the_token_that_completes_a_stop_string():
    request = _run(_letter_engine(TOKENIZER), Request([1], SamplingParams(max_tokens=100, temperature=0, stop=["xyz", "fgh"])))
    # The output is "bcdefgh...": "fgh" ends at the 7th token.
    assert request.finish_reason == "stop" and TOKENIZER.decode(request.output_token_ids) == "bcdefgh"
    assert request.detokenizer.text(finished=True) == "bcde"


def test_ignore_eos_generates_past_a_stop_string():
    request = _run(_letter_engine(TOKENIZER), Request([1], SamplingParams(max_tokens=10, temperature=0, stop=["d"],
                                                                           ignore_eos=True)))
    assert request.finish_reason == "length" and request.num_output_tokens == 10


# -- the LLM API, on the tiny model -------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_llama_plan):
    return LLM(model=tiny_llama_plan, kv_cache_config=KvCacheConfig(max_tokens=4096))


def test_llm_text_ends_before_the_stop_string_and_token_ids_keep_its_tokens(llm):
    prompt = list(range(3, 43))
    full = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)).outputs[0]
    assert full.text == llm.tokenizer.decode(full.token_ids)
    stop = full.text[6:9]
    if not stop or stop in full.text[:8]:
        pytest.skip("this model's output has no usable stop string")
    cut = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop=stop)).outputs[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.find(stop)]
    n = len(cut.token_ids)
    assert cut.token_ids == full.token_ids[:n] and stop in llm.tokenizer.decode(cut.token_ids)
    assert stop not in llm.tokenizer.decode(cut.token_ids[:n - 1])


def test_llm_streamed_text_adds_up_to_the_final_text(llm):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    texts = [output.outputs[0].text for output in llm.generate_async(list(range(3, 43)), params)]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    assert texts[-1] == llm.generate(list(range(3, 43)), params).outputs[0].text
