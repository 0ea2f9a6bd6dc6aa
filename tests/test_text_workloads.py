"""Workloads of real text: prompts cut from a text file by a plan's tokenizer, chat template applied when
asked; the workload shapes (shared passages, distinct questions, sessions, A/B) hold as with random ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf_files import CHATML_TEMPLATE, MERGES, SPECIAL_TOKENS, tokenizer_vocabulary
from typer.testing import CliRunner

from kvtool.workloads.datasets import load_dataset
from kvtool.workloads.generators import GeneratorOptions
from kvtool.workloads.text import TextSource, text_abab, text_multi_turn, text_system_prompt
from kvtool.cli import app
from kvtool.errors import KvtoolError
from kvtool.models.tokenizer import ByteLevelTokenizer, HuggingFaceTokenizer

TEXT = Path(__file__).resolve().parent.parent / "examples" / "text" / "ordinary_things.txt"
OPTIONS = GeneratorOptions()


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory) -> HuggingFaceTokenizer:
    """A byte-level BPE tokenizer with ChatML special tokens and chat template, saved as transformers does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    directory = tmp_path_factory.mktemp("chatml-tokenizer")
    vocab = tokenizer_vocabulary()
    tokenizer = Tokenizer(models.BPE({token: index for index, token in enumerate(vocab)}, list(MERGES)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "chat_template": CHATML_TEMPLATE}))
    return HuggingFaceTokenizer(directory, len(vocab), [vocab.index("<|im_end|>")])


def byte_source() -> TextSource:
    return TextSource.from_file(TEXT, ByteLevelTokenizer(1024, 256, [257]), chat=False)


def test_groups_share_a_passage_of_the_text_and_ask_distinct_questions_about_it():
    source = byte_source()
    lines = text_system_prompt(source, OPTIONS, num_groups=3, prompts_per_group=4, system_prompt_len=300,
                               question_len=80, output_len=5)
    assert len(lines) == 12 and all(line["output_tokens"] == 5 for line in lines)
    text = TEXT.read_text()
    for group in range(3):
        prompts = [lines[group * 4 + i]["input_ids"] for i in range(4)]
        decoded = [source.tokenizer.decode(ids) for ids in prompts]
        passage = decoded[0].split("\n\nIn one sentence")[0]
        assert 150 <= len(passage.encode()) <= 300 and passage in text  # real text, within its budget
        assert all(d.startswith(passage + "\n\nIn one sentence, what does the text say about this:") for d in decoded)
        assert len(set(decoded)) == 4  # distinct questions
        assert all(len(d.encode()) - len(passage.encode()) - 2 <= 80 for d in decoded)
    first_words = {source.tokenizer.decode(lines[g * 4]["input_ids"])[:40] for g in range(3)}
    assert len(first_words) == 3  # passages follow each other through the file


def test_chat_template_wraps_passage_and_question_as_transformers_renders_them(chatml_tokenizer):
    from transformers import AutoTokenizer

    source = TextSource.from_file(TEXT, chatml_tokenizer, chat=True)
    lines = text_system_prompt(source, OPTIONS, num_groups=2, prompts_per_group=2, system_prompt_len=200,
                               question_len=90, output_len=3)
    reference = AutoTokenizer.from_pretrained(str(chatml_tokenizer.directory))
    for line in lines:
        text = reference.decode(line["input_ids"])
        system = text.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]
        user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        expected = reference.apply_chat_template([{"role": "system", "content": system},
                                                  {"role": "user", "content": user}],
                                                 tokenize=False, add_generation_prompt=True)
        assert line["input_ids"] == reference(expected, add_special_tokens=False)["input_ids"]
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_a_later_turn_continues_the_conversation_in_chat_form(chatml_tokenizer):
    """Replayed as kvtool does (previous prompt + answer + new ids), turns equal the chat template of
    the whole conversation."""
    from transformers import AutoTokenizer

    source = TextSource.from_file(TEXT, chatml_tokenizer, chat=True)
    lines = text_multi_turn(source, OPTIONS, num_sessions=2, num_turns=3, user_turn_len=90, answer_len=4,
                            system_prompt_len=150)
    reference = AutoTokenizer.from_pretrained(str(chatml_tokenizer.directory))
    answer = "the rest is in the other story"
    answer_ids = reference(answer, add_special_tokens=False)["input_ids"]
    for session in ("s0", "s1"):
        turns = [line for line in lines if line["session_id"] == session]
        assert [line["turn"] for line in turns] == [0, 1, 2]
        prompt = turns[0]["input_ids"]
        for turn in turns[1:]:
            prompt = prompt + answer_ids + turn["input_ids"]
        text = reference.decode(prompt)
        messages = [{"role": "system", "content": text.split("<|im_start|>system\n", 1)[1].split("<|im_end|>")[0]}]
        for part in text.split("<|im_start|>user\n")[1:]:
            messages += [{"role": "user", "content": part.split("<|im_end|>")[0]},
                         {"role": "assistant", "content": answer}]
        expected = reference.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        assert prompt == reference(expected, add_special_tokens=False)["input_ids"]
    shared = [line["input_ids"] for line in lines if line["turn"] == 0]
    assert shared[0][:100] == shared[1][:100]  # one system prompt for every session


def test_abab_alternates_two_passages():
    lines = text_abab(byte_source(), OPTIONS, prompt_len=200, num_rounds=3, output_len=2)
    assert [line["request_id"] for line in lines] == ["A0", "B0", "A1", "B1", "A2", "B2"]
    a, b = lines[0]["input_ids"], lines[1]["input_ids"]
    assert a != b and all(line["input_ids"] == (a if line["request_id"][0] == "A" else b) for line in lines)


def test_a_text_too_short_for_the_workload_is_a_clear_error(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here. Nothing more.")
    source = TextSource.from_file(short, ByteLevelTokenizer(1024, 256, [257]), chat=False)
    with pytest.raises(KvtoolError, match="short.txt ran out"):
        text_system_prompt(source, OPTIONS, num_groups=2, prompts_per_group=1, system_prompt_len=1000,
                           question_len=60, output_len=1)


def test_cli_writes_a_token_id_dataset_from_text_and_rejects_mismatched_flags(tmp_path, tiny_llama_plan):
    runner = CliRunner()
    out = tmp_path / "sp.jsonl"
    base = ["dataset", "system-prompt", "--output", str(out), "--num_groups", "2", "--prompts_per_group", "3",
            "--system_prompt_len", "200", "--question_len", "70", "--output_len", "4"]
    result = runner.invoke(app, base + ["--text", str(TEXT), "--plan", str(tiny_llama_plan)])
    assert result.exit_code == 0, result.output
    dataset = load_dataset(out)
    assert len(dataset) == 6 and all(record.input_ids for record in dataset.records)
    checks = [(["--text", str(TEXT)], "--text needs --plan"),
              (["--plan", str(tiny_llama_plan)], "--plan and --chat_template go with --text"),
              (["--text", str(TEXT), "--plan", str(tiny_llama_plan), "--chat_template"], "has a chat template"),
              (["--text", str(TEXT), "--plan", str(tiny_llama_plan), "--max_token_id", "50"], "--max_token_id"),
              (["--text", str(tmp_path / "none.txt"), "--plan", str(tiny_llama_plan)], "none.txt does not exist")]
    for flags, message in checks:
        result = runner.invoke(app, base + flags)
        assert result.exit_code == 2 and message in result.output, (flags, result.output)
