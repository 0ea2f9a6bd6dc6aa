"""The CPU kernels' forward (kvtool.cpu_kernels.decoder) computes transformers' logits, in every
instruction set this CPU runs (AVX-512, AVX2, the portable build), for every family feature of
tests/hf_checkpoints.py: prompts in one step and in chunks, a suffix after shared prefix blocks,
mixed context + decode batches with greedy decoding, decode rows alone and in pairs (the row product), Mistral's sliding window with released blocks.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvtool.cpu_kernels import supported_isas
from kvtool.cpu_kernels.decoder import CpuDecoder, enable
from hf_checkpoints import HF_CASES
from hf_checkpoints import TEST_TOKENS_PER_BLOCK as T
from paged_driver import PagedDriver
from test_model_vs_transformers import MAX_RELATIVE_ERROR, hf_logits, random_prompt, relative_error


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("name", list(HF_CASES))
def test_prefix_reuse_mixed_batches_and_greedy_decoding_match_transformers(models, name, isa):
    ours, hf = models(name)
    ours.cpu_decoder = CpuDecoder(ours, isa=isa, num_threads=2)
    try:
        window = ours.sliding_window
        driver = PagedDriver(ours, tokens_per_block=T, num_blocks=64)
        prefix = random_prompt(3 * T, seed=3)
        first, second, third = prefix + random_prompt(21, seed=4), prefix + random_prompt(17, seed=5), \
            random_prompt(37, seed=8)
        owner = driver.add_sequence(first)
        chunks = [driver.step(context=[(owner, n)])[0] for n in (2 * T, len(first) - 2 * T)]
        assert relative_error(torch.cat(chunks), hf_logits(hf, first)) <= MAX_RELATIVE_ERROR
        owner.append(int(chunks[-1][-1].argmax()))

        reuser = driver.add_sequence(second, share_prefix_with=owner, num_shared_blocks=3)
        other = driver.add_sequence(third)
        # A suffix after cached blocks, a whole prompt and a decode token in one step.
        suffix, whole, decoded = driver.step(context=[(reuser, len(second) - 3 * T), (other, len(third))],
                                             decode=[owner])
        assert relative_error(suffix, hf_logits(hf, second)[3 * T:]) <= MAX_RELATIVE_ERROR
        assert relative_error(whole, hf_logits(hf, third)) <= MAX_RELATIVE_ERROR
        assert relative_error(decoded, hf_logits(hf, owner.token_ids)[-1:]) <= MAX_RELATIVE_ERROR
        seqs = [owner, reuser, other]
        reuser.append(int(suffix[-1].argmax()))
        other.append(int(whole[-1].argmax()))
        owner.append(int(decoded[-1].argmax()))
        # Decode rows alone and in pairs: every projection and the logits take the kernels' row product.
        lone = driver.step(decode=[owner])[0]
        assert relative_error(lone, hf_logits(hf, owner.token_ids)[-1:]) <= MAX_RELATIVE_ERROR
        owner.append(int(lone[-1].argmax()))
        for seq, logits in zip((owner, reuser), driver.step(decode=[owner, reuser])):
            assert relative_error(logits, hf_logits(hf, seq.token_ids)[-1:]) <= MAX_RELATIVE_ERROR
            seq.append(int(logits[-1].argmax()))
        for _ in range(4):
            if window is not None:
                for seq in seqs:
                    # owner and reuser share their first blocks: only the other's may be poisoned.
                    driver.release_blocks_outside_window(seq, window, poison=seq is other)
            for seq, logits in zip(seqs, driver.step(decode=seqs)):
                assert relative_error(logits, hf_logits(hf, seq.token_ids)[-1:]) <= MAX_RELATIVE_ERROR
                seq.append(int(logits[-1].argmax()))
        for seq, prompt in zip(seqs, (first, second, third)):
            with torch.no_grad():
                expected = hf.generate(torch.tensor([prompt]), max_new_tokens=len(seq.token_ids) - len(prompt),
                                       do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
            assert seq.token_ids[len(prompt):len(prompt) + len(expected)] == expected
    finally:
        ours.cpu_decoder = None


def test_bfloat16_model_matches_its_torch_path(models):
    ours, _ = models("qwen3_qk_norm")
    model = ours.to(torch.bfloat16)
    try:
        prompt = random_prompt(45, seed=11)
        results = []
        for use_kernels in (False, True):
            model.cpu_decoder = CpuDecoder(model) if use_kernels else None
            driver = PagedDriver(model, tokens_per_block=T, num_blocks=32)
            seq = driver.add_sequence(prompt)
            logits = driver.step(context=[(seq, len(prompt))])[0]
            seq.append(int(logits[-1].argmax()))
            results.append(torch.cat([logits, driver.step(decode=[seq])[0]]))
        # bfloat16 rounds differently where the kernels fuse what torch rounds op by op.
        assert relative_error(results[1], results[0]) <= 3e-2
    finally:
        model.cpu_decoder = None
        model.to(torch.float32)


@pytest.mark.parametrize("isa", supported_isas())
def test_bfloat16_kernels_round_no_worse_than_torchs_bfloat16(models, isa):
    # bfloat16 paths round in their own orders, so their greedy ids part from float32's somewhere; the
    # kernels must not part sooner than torch's bfloat16: over a prompt and decode steps, their logits'
    # error against float32 arithmetic on the same (bfloat16) weights within 1.2x torch's bfloat16 path's
    # (0.87-1.03x on four models, two prompts each; the portable build accumulating its products in
    # bfloat16: 1.9x).
    ours, _ = models("llama_threads_medium")
    prompt, continuation = random_prompt(45, seed=12), random_prompt(6, seed=13)

    def logits(model):
        driver = PagedDriver(model, tokens_per_block=T, num_blocks=32)
        seq = driver.add_sequence(prompt)
        rows = [driver.step(context=[(seq, len(prompt))])[0]]
        for token in continuation:
            seq.append(token)
            rows.append(driver.step(decode=[seq])[0])
        return torch.cat(rows).float()  # [len(prompt) + len(continuation), vocab]

    model = copy.deepcopy(ours).to(torch.bfloat16)  # a float32 round trip would round the shared weights
    reference = logits(copy.deepcopy(model).float())

    def errors(logits):  # the prompt's rows, then the decode steps' (each their own kernels)
        return [float((logits[rows] - reference[rows]).norm() / reference[rows].norm())
                for rows in (slice(0, len(prompt)), slice(len(prompt), None))]

    torch_errors = errors(logits(model))
    model.cpu_decoder = CpuDecoder(model, isa=isa, num_threads=2)
    kernel_errors = errors(logits(model))
    assert all(0 < kernel <= 1.2 * torch_error for kernel, torch_error in zip(kernel_errors, torch_errors))


def test_enable_keeps_the_torch_path_where_the_kernels_do_not_apply(models):
    ours, _ = models("llama_mha_tied_bias")
    half = ours.to(torch.float16)
    try:
        assert enable(half) is None
        assert half.cpu_decoder is None
        with pytest.raises(ValueError, match="float32 or bfloat16"):
            CpuDecoder(half)
    finally:
        ours.to(torch.float32)


def test_an_unknown_isa_is_refused(models):
    ours, _ = models("llama_mha_tied_bias")
    with pytest.raises(ValueError, match="does not run on this CPU"):
        CpuDecoder(ours, isa="neon")
