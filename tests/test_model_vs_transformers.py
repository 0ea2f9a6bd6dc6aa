"""kvtool's model over the paged KV cache computes the logits of transformers' own model.

Each checkpoint is a tiny random transformers model saved as safetensors, converted by
`build_plan` and loaded by `load_plan`; every case covers a family feature (llama3 RoPE scaling,
MHA with tied embeddings and biases, Mistral's sliding window smaller than the prompt, Qwen2's
qkv bias, Qwen3's q/k norm). The KV is computed in one step, in chunks, after a shared prefix and
in mixed batches; the logits must match transformers' within 1e-4 relative error.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvtool.layers.attention import TorchPagedAttention
from kvtool.plan import load_plan
from hf_checkpoints import HF_CASES
from hf_checkpoints import TEST_TOKENS_PER_BLOCK as T
from paged_driver import PagedDriver, PagedSequence

MAX_RELATIVE_ERROR = 1e-4
CASES = list(HF_CASES)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max() / reference.abs().max())


def random_prompt(length: int, seed: int, vocab_size: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(length)]


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()  # [len, vocab]


@pytest.mark.parametrize("name", CASES)
def test_prompt_in_one_step_matches_transformers(models, name):
    ours, hf = models(name)
    prompt = random_prompt(45, seed=1)
    driver = PagedDriver(ours, tokens_per_block=T, num_blocks=32)
    logits = driver.step(context=[(driver.add_sequence(prompt), len(prompt))])[0]
    assert relative_error(logits, hf_logits(hf, prompt)) <= MAX_RELATIVE_ERROR


@pytest.mark.parametrize("name", CASES)
def test_prompt_in_chunks_matches_transformers(models, name):
    ours, hf = models(name)
    prompt = random_prompt(45, seed=2)
    driver = PagedDriver(ours, tokens_per_block=T, num_blocks=32)
    seq = driver.add_sequence(prompt)
    chunks = [driver.step(context=[(seq, n)])[0] for n in (2 * T, 3 * T, len(prompt) - 5 * T)]
    assert relative_error(torch.cat(chunks), hf_logits(hf, prompt)) <= MAX_RELATIVE_ERROR


@pytest.mark.parametrize("name", CASES)
def test_suffix_after_reused_prefix_blocks_matches_transformers(models, name):
    ours, hf = models(name)
    prefix = random_prompt(3 * T, seed=3)
    first = prefix + random_prompt(11, seed=4)
    second = prefix + random_prompt(17, seed=5)
    driver = PagedDriver(ours, tokens_per_block=T, num_blocks=32)
    owner = driver.add_sequence(first)
    driver.step(context=[(owner, len(first))])
    reuser = driver.add_sequence(second, share_prefix_with=owner, num_shared_blocks=3)
    assert reuser.block_ids == owner.block_ids[:3]
    suffix_logits = driver.step(context=[(reuser, len(second) - 3 * T)])[0]
    assert relative_error(suffix_logits, hf_logits(hf, second)[3 * T:]) <= MAX_RELATIVE_ERROR


class LogitsByPosition:
    """Collects our logits per sequence position, whatever step computed them."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}

    def add(self, first_position: int, logits: torch.Tensor) -> None:
        for offset, row in enumerate(logits):
            self.rows[first_position + offset] = row

    def stacked(self) -> torch.Tensor:
        assert sorted(self.rows) == list(range(len(self.rows)))
        return torch.stack([self.rows[p] for p in range(len(self.rows))])


def run_step(driver: PagedDriver, trackers: dict[int, LogitsByPosition], context=(), decode=()) -> None:
    """One mixed step; each sequence's logits are recorded, and a sequence that finished its prompt
    (or decoded) appends its greedy token."""
    starts = [seq.num_computed for seq, _ in context] + [seq.num_computed for seq in decode]
    scheduled = [seq for seq, _ in context] + list(decode)
    for seq, start, logits in zip(scheduled, starts, driver.step(context=context, decode=decode)):
        trackers[id(seq)].add(start, logits)
        if seq.num_computed == len(seq.token_ids):
            seq.append(int(logits[-1].argmax()))


@pytest.mark.parametrize("name", CASES)
def test_mixed_context_and_decode_batches_then_greedy_decoding_match_transformers(models, name):
    ours, hf = models(name)
    window = ours.sliding_window
    prompts = [random_prompt(45, seed=6), random_prompt(20, seed=7), random_prompt(37, seed=8)]
    driver = PagedDriver(ours, tokens_per_block=T, num_blocks=64)
    seqs: list[PagedSequence] = [driver.add_sequence(p) for p in prompts]
    trackers = {id(seq): LogitsByPosition() for seq in seqs}
    s0, s1, s2 = seqs
    run_step(driver, trackers, context=[(s0, 45), (s1, 2 * T)])
    run_step(driver, trackers, context=[(s1, 20 - 2 * T), (s2, 3 * T)], decode=[s0])
    run_step(driver, trackers, context=[(s2, 37 - 3 * T)], decode=[s0, s1])
    for _ in range(5):
        if window is not None:
            # The runtime releases blocks that left every window; they must never be read again.
            for seq in seqs:
                driver.release_blocks_outside_window(seq, window)
        run_step(driver, trackers, decode=seqs)
    if window is not None:
        assert s0.block_ids[:3] == [-1, -1, -1]  # positions 0..23 are out of every later window

    for seq, prompt in zip(seqs, prompts):
        generated = seq.token_ids[len(prompt):]
        assert len(generated) >= 6
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=len(generated), do_sample=False,
                                   pad_token_id=0)[0, len(prompt):].tolist()
        # transformers stops early only at EOS; up to there the tokens agree one for one.
        assert generated[:len(expected)] == expected
        assert len(expected) == len(generated) or expected[-1] in hf.generation_config.eos_token_id
        reference = hf_logits(hf, seq.token_ids[:-1])
        assert relative_error(trackers[id(seq)].stacked(), reference) <= MAX_RELATIVE_ERROR


def test_runtime_attention_window_matches_a_mistral_sliding_window(hf_checkpoint, plan_from_checkpoint):
    """max_attention_window on a model without its own window acts as Mistral's sliding window."""
    import transformers

    mistral = hf_checkpoint("mistral_sliding_window").model
    plan = load_plan(plan_from_checkpoint("mistral_sliding_window"))
    # Same weights, window removed from the config and given by the runtime instead.
    plan.model_config.sliding_window = None
    ours = plan.load_model("cpu", TorchPagedAttention(), attention_window=20)
    assert ours.sliding_window == 20
    prompt = random_prompt(45, seed=9)
    driver = PagedDriver(ours, tokens_per_block=T, num_blocks=32)
    seq = driver.add_sequence(prompt)
    logits = torch.cat([driver.step(context=[(seq, n)])[0] for n in (3 * T, len(prompt) - 3 * T)])
    assert relative_error(logits, hf_logits(mistral, prompt)) <= MAX_RELATIVE_ERROR
    # Without any window the answer differs: the window really is applied.
    full = transformers.MistralForCausalLM(transformers.MistralConfig(**{**HF_CASES["mistral_sliding_window"][1],
                                                                          "sliding_window": None}))
    full.load_state_dict(mistral.state_dict())
    assert relative_error(logits, hf_logits(full.eval(), prompt)) > 1e-2
