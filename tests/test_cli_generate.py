"""`kvtool generate` prints the answer the LLM API gives for the same prompt; mistakes are one line."""

from __future__ import annotations

from typer.testing import CliRunner

from kvtool import LLM, SamplingParams
from kvtool.cli import app

runner = CliRunner()


def test_generate_prints_the_greedy_answer_of_the_llm_api(tiny_llama_plan):
    result = runner.invoke(app, ["generate", "--plan", str(tiny_llama_plan), "--prompt", "Hello", "--max_tokens", "6"])
    assert result.exit_code == 0, result.output
    with LLM(model=str(tiny_llama_plan), max_batch_size=1) as llm:
        expected = llm.generate("Hello", SamplingParams(max_tokens=6, temperature=0.0)).outputs[0].text.strip()
    assert result.output.strip() == expected


def test_generate_needs_exactly_one_of_plan_and_model(tiny_llama_plan):
    for args in ([], ["--plan", str(tiny_llama_plan), "--model", "preset:tiny-llama"]):
        result = runner.invoke(app, ["generate", "--prompt", "Hi", *args])
        assert result.exit_code == 2
        assert "give one of --plan DIR or --model NAME" in result.output


def test_chat_template_on_a_plan_without_one_is_refused(tiny_llama_plan):
    result = runner.invoke(app, ["generate", "--plan", str(tiny_llama_plan), "--prompt", "Hi", "--chat_template"])
    assert result.exit_code == 2
    assert "--chat_template needs a plan whose tokenizer has a chat template" in result.output
    assert "Traceback" not in result.output


def test_generate_samples_with_its_seed_as_the_llm_api_does(tiny_llama_plan):
    args = ["generate", "--plan", str(tiny_llama_plan), "--prompt", "Hello", "--max_tokens", "8",
            "--temperature", "1.0", "--top_p", "0.9", "--top_k", "50"]
    first = runner.invoke(app, [*args, "--seed", "11"])
    assert first.exit_code == 0, first.output
    with LLM(model=str(tiny_llama_plan), max_batch_size=1) as llm:
        params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=11)
        assert first.output.strip() == llm.generate("Hello", params).outputs[0].text.strip()
    assert runner.invoke(app, [*args, "--seed", "11"]).output == first.output


def test_a_bad_sampling_flag_is_named():
    result = runner.invoke(app, ["generate", "--model", "preset:tiny-llama", "--prompt", "Hi", "--top_p", "1.5"])
    assert result.exit_code == 2
    assert "--top_p must be in (0, 1], got 1.5" in result.output
    assert "Traceback" not in result.output
