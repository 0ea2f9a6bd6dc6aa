"""Sampling: greedy rows pick what torch's argmax picks (NumPy's on the CPU); temperature, top-k and top-p
draws follow the distribution a plain softmax over the kept tokens gives."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.config import SamplingParams
from kvtool.layers.sampler import (draw, draw_rows, inverse_transform, make_generator, sample, step_picks,
                                   top_candidates)

GREEDY = SamplingParams(max_tokens=1, temperature=0)


def test_greedy_rows_take_the_first_maximum_as_torch_does():
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    logits[1, 10] = logits[1, 900] = 50.0           # a tie: the first one
    logits[2, 3] = float("nan")                     # NaN counts as the maximum, as in torch
    expected = logits.argmax(dim=-1).tolist()
    assert step_picks([GREEDY] * 5, [None] * 5) is None  # a greedy step draws nothing
    assert sample(logits, [GREEDY] * 5, None) == expected
    assert expected[1] == 10 and expected[2] == 3


def test_greedy_rows_of_a_strided_view_are_sampled_from_the_view():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    view = logits[::2]                              # [3, 300], rows 0, 2, 4
    assert sample(view, [GREEDY] * 3, np.zeros(3)) == logits.argmax(dim=-1).tolist()[::2]
    with torch.inference_mode():                    # the runner's logits are inference tensors
        assert sample(logits.clone(), [GREEDY] * 6, np.zeros(6)) == logits.argmax(dim=-1).tolist()


def draws(logits: list[float], params: SamplingParams, num_draws: int, seed: int = 0) -> list[int]:
    """Token counts of num_draws draws from one row of logits, one generator for all of them."""
    row = torch.tensor([logits])
    generator = torch.Generator().manual_seed(seed)
    counts = [0] * len(logits)
    for _ in range(num_draws):
        counts[sample(row, [params], step_picks([params], [generator]).uniforms)[0]] += 1
    return counts


def reference_probs(logits: list[float], temperature: float, keep: list[int]) -> list[float]:
    """softmax(logits / temperature) over the tokens of ``keep``, 0 elsewhere, in plain Python."""
    weights = [math.exp(logits[i] / temperature) if i in keep else 0.0 for i in range(len(logits))]
    return [w / sum(weights) for w in weights]


def assert_follows(counts: list[int], probs: list[float]) -> None:
    """Pearson's chi-square of the counts against probs below its 0.999 quantile; no draw where probs is 0."""
    num_draws = sum(counts)
    assert all(c == 0 for c, p in zip(counts, probs) if p == 0), (counts, probs)
    support = [(c, p) for c, p in zip(counts, probs) if p > 0]
    chi2 = sum((c - num_draws * p) ** 2 / (num_draws * p) for c, p in support)
    assert chi2 < CHI2_999[len(support) - 1], (chi2, counts, [round(num_draws * p) for p in probs])


CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
LOGITS = [1.0, 2.5, -0.5, 0.0, 3.0, 1.5, -2.0, 0.5]


def test_a_temperature_draws_from_the_softmax_of_the_scaled_logits():
    for temperature in (0.5, 1.0, 2.0):
        counts = draws(LOGITS, SamplingParams(temperature=temperature), 20_000)
        assert_follows(counts, reference_probs(LOGITS, temperature, keep=list(range(8))))


def test_top_k_draws_among_the_k_largest_logits_only():
    counts = draws(LOGITS, SamplingParams(temperature=0.8, top_k=3), 20_000)
    assert_follows(counts, reference_probs(LOGITS, 0.8, keep=[4, 1, 5]))


def test_top_p_keeps_the_fewest_tokens_whose_probability_reaches_it():
    # softmax(LOGITS) in descending order: 4 (0.469), 1 (0.284), 5 (0.105), 0 (0.063), ...: 0.75 before
    # token 5, which is kept, 0.86 before token 0, which is not.
    probs = reference_probs(LOGITS, 1.0, keep=list(range(8)))
    order = sorted(range(8), key=lambda i: -probs[i])
    assert order[:3] == [4, 1, 5] and sum(probs[i] for i in order[:2]) < 0.8 < sum(probs[i] for i in order[:3])
    counts = draws(LOGITS, SamplingParams(temperature=1.0, top_p=0.8), 20_000)
    assert_follows(counts, reference_probs(LOGITS, 1.0, keep=[4, 1, 5]))
    # top_k first, then top_p of what top_k left: {4, 1} renormalized are 0.62 and 0.38, both kept.
    counts = draws(LOGITS, SamplingParams(temperature=1.0, top_k=2, top_p=0.8), 20_000)
    assert_follows(counts, reference_probs(LOGITS, 1.0, keep=[4, 1]))
    # The largest stays whatever top_p.
    assert draws(LOGITS, SamplingParams(temperature=1.0, top_p=0.01), 50) == [0, 0, 0, 0, 50, 0, 0, 0]


@settings(max_examples=60, deadline=None)
@given(vocab_size=st.integers(1, 3000), top_k=st.integers(0, 3000), top_p=st.floats(0.01, 1.0),
       seed=st.integers(0, 2**31), spread=st.sampled_from([0.1, 1.0, 8.0]))
def test_top_candidates_are_those_of_a_full_sort(vocab_size, top_k, top_p, seed, spread):
    # Flat rows (spread 0.1) keep many candidates past the first 64 and 512 looked at.
    logits = torch.randn(vocab_size, generator=torch.Generator().manual_seed(seed)) * spread
    probs = torch.softmax(logits, dim=-1)
    k = top_k if 0 < top_k < vocab_size else vocab_size
    ordered = sorted(range(vocab_size), key=lambda i: -float(probs[i]))[:k]
    mass = sum(float(probs[i]) for i in ordered)
    expected, before = [], 0.0
    for i in ordered:
        if expected and before >= top_p * mass and top_p < 1.0:  # top_p 1 cuts nothing, however the sums round
            break
        expected.append(i)
        before += float(probs[i])
    values, token_ids = top_candidates(probs, k, top_p)
    # Sums in float32 against float64: tokens whose mass before them lies within rounding of the cut may
    # go either way; several where a tail of tiny probabilities sits there (top_p 1 - 2^-53, a peaked row).
    before_each = [0.0, *itertools.accumulate(float(probs[i]) for i in ordered)]
    for j in range(min(len(token_ids), len(expected)), max(len(token_ids), len(expected))):
        assert abs(before_each[j] - top_p * mass) <= 1e-5 * mass, (j, before_each[j], top_p * mass)
    # The same probabilities in the same order (equal ones may come as other tokens), distinct tokens.
    common = min(len(expected), len(token_ids))
    assert values[:common].tolist() == [float(probs[i]) for i in expected[:common]]
    assert torch.equal(values, probs[token_ids]) and len(set(token_ids.tolist())) == len(token_ids)


def test_inverse_transform_never_lands_on_a_token_of_zero_probability():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25, 0.0, 0.0])
    below_one = 1.0 - 2.0**-53
    cases = {0.0: 1, 0.2: 1, 0.25: 3, 0.5: 3, 0.75: 4, 0.9: 4, below_one: 4}
    for u, expected in cases.items():
        assert inverse_transform(probs, u) == expected, u
    # Unnormalized probabilities: u is a fraction of their total.
    assert inverse_transform(probs * 8, below_one) == 4


def test_a_seed_repeats_its_draws_whatever_rows_share_the_step():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, seed=7)

    def row_one_draws(others: list[SamplingParams]) -> list[int]:
        generators = [torch.Generator().manual_seed(s) for s in (1, 7, 3)]
        step_params = [others[0], params, others[1]]
        return [sample(logits, step_params, step_picks(step_params, generators).uniforms)[1] for _ in range(20)]

    assert row_one_draws([GREEDY, GREEDY]) == row_one_draws([SamplingParams(top_k=5), SamplingParams(top_p=0.5)])


def test_an_unseeded_request_leaves_torchs_default_generator_as_the_caller_set_it():
    # A user of kvtool.LLM who seeds torch for their own work keeps that stream: an unseeded request's
    # generator is seeded from the system's entropy (torch.seed() reseeded the default generator).
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    first, second = make_generator(SamplingParams(temperature=1.0)), make_generator(SamplingParams(temperature=1.0))
    assert torch.equal(torch.rand(4), expected)
    assert first.initial_seed() != second.initial_seed()
    assert make_generator(SamplingParams(temperature=1.0, seed=9)).initial_seed() == 9
    assert make_generator(GREEDY) is None


def test_a_steps_picks_hold_each_rows_sampling_and_greedy_rows_take_no_number_from_their_stream():
    generator = torch.Generator().manual_seed(3)
    params = [GREEDY, SamplingParams(temperature=0.5, top_k=4, top_p=0.9)]
    picks = step_picks(params, [None, generator])
    expected_u = torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).item()
    assert picks.uniforms.tolist() == [0.0, expected_u]
    assert picks.temperatures.tolist() == [0.0, 0.5] and picks.temperatures.dtype == np.float32
    assert picks.top_ks.tolist() == [0, 4] and picks.top_ks.dtype == np.int64
    assert picks.top_ps.tolist() == [1.0, np.float32(0.9)] and picks.top_ps.dtype == np.float32


def test_top_k_and_top_p_draws_go_through_the_kept_tokens_in_vocabulary_order():
    # The CPU step draws over the kept tokens in vocabulary order; the sampler must too, so that one
    # uniform number gives one token on both paths. Kept here: tokens 1 and 4 (the two largest).
    logits = torch.tensor([[1.0, 2.5, -0.5, 0.0, 3.0, 1.5, -2.0, 0.5]])
    p1, p4 = reference_probs(LOGITS, 1.0, keep=[1, 4])[1], reference_probs(LOGITS, 1.0, keep=[1, 4])[4]
    params = [SamplingParams(temperature=1.0, top_k=2)]
    assert sample(logits, params, np.array([p1 * 0.99])) == [1]
    assert sample(logits, params, np.array([p1 * 1.01])) == [4]
    assert p4 > p1


def rows_and_params(seed: int, num_rows: int = 24, vocab_size: int = 3000):
    """Rows of flat and peaked logits, and each row's sampling: greedy, a temperature, top_k, top_p, both."""
    generator = torch.Generator().manual_seed(seed)
    spreads = torch.tensor([0.1, 1.0, 4.0]).repeat(num_rows)[:num_rows, None]
    logits = torch.randn(num_rows, vocab_size, generator=generator) * spreads
    choices = [GREEDY, SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=40),
               SamplingParams(temperature=1.2, top_p=0.8), SamplingParams(temperature=0.9, top_k=500, top_p=0.5)]
    params = [choices[i % len(choices)] for i in range(num_rows)]
    uniforms = torch.rand(num_rows, dtype=torch.float64, generator=generator).numpy()
    return logits, params, uniforms


def test_the_batched_draws_a_device_takes_are_the_row_by_row_draws():
    # draw_rows (a GPU's path: no sync a row) keeps the same tokens and draws the same one from the same
    # uniform number as draw (the CPU's path and the CPU step's): run here on the CPU's tensors.
    for seed in range(4):
        logits, params, uniforms = rows_and_params(seed)
        expected = [int(row.argmax()) if p.greedy else draw(row, p, float(u))
                    for row, p, u in zip(logits, params, uniforms)]
        assert draw_rows(logits, params, uniforms).tolist() == expected, seed


@pytest.mark.gpu
def test_a_devices_batched_draws_are_the_cpus():
    logits, params, uniforms = rows_and_params(7)
    assert sample(logits.cuda(), params, uniforms) == sample(logits, params, uniforms)
