"""Plans carry a tokenizer: the checkpoint's own when it has one, else a byte-level one, so text
prompts always work."""

from __future__ import annotations

import shutil

from kvtool.models.tokenizer import ByteLevelTokenizer
from kvtool.plan import BuildOptions, build_plan, load_plan


def test_byte_level_round_trips_any_text_and_prepends_bos():
    tokenizer = ByteLevelTokenizer(vocab_size=1024, bos_token_id=256, eos_token_ids=[257])
    text = "naïve café → 東京 🚀"
    ids = tokenizer.encode(text)
    assert ids[0] == 256 and ids[1:] == list(text.encode("utf-8"))
    assert tokenizer.decode(ids + [257]) == text


def test_byte_level_decodes_non_byte_ids_visibly():
    tokenizer = ByteLevelTokenizer(vocab_size=1024, bos_token_id=None, eos_token_ids=[257])
    assert tokenizer.encode("ab") == [97, 98]
    assert tokenizer.decode([97, 700, 98, 0xC3]) == "a<|700|>b\ufffd"


def test_preset_plan_has_a_byte_level_tokenizer_with_the_model_eos(tiny_qwen3_plan):
    tokenizer = load_plan(tiny_qwen3_plan).tokenizer
    assert tokenizer.eos_token_ids == [257] and tokenizer.vocab_size == 1024
    assert tokenizer.decode(tokenizer.encode("Hello")) == "Hello"


def test_checkpoint_tokenizer_is_copied_into_the_plan(hf_checkpoint, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "kv": 5, "cache": 6}
    hf_tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    checkpoint = shutil.copytree(hf_checkpoint("llama_llama3_rope_gqa").path, tmp_path / "ckpt")
    hf_tokenizer.save(str(checkpoint / "tokenizer.json"))
    plan = load_plan(build_plan(str(checkpoint), tmp_path / "plan", BuildOptions()))
    assert plan.manifest["tokenizer"]["kind"] == "huggingface"
    assert (plan.path / "tokenizer" / "tokenizer.json").is_file()
    # Moving the checkpoint away does not matter: the plan has its own copy.
    shutil.rmtree(checkpoint)
    assert plan.tokenizer.encode("hello kv cache world") == [3, 5, 6, 4]
    assert plan.tokenizer.decode([3, 5, 6]) == "hello kv cache"
    assert plan.tokenizer.eos_token_ids == plan.model_config.eos_token_ids == [2]
