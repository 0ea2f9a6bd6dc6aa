"""Greedy sampling on the CPU (NumPy's argmax) picks what torch's argmax picks."""

from __future__ import annotations

import torch

from kvtool.config import SamplingParams
from kvtool.layers.sampler import sample

GREEDY = SamplingParams(max_tokens=1, temperature=0)


def test_greedy_rows_take_the_first_maximum_as_torch_does():
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    logits[1, 10] = logits[1, 900] = 50.0           # a tie: the first one
    logits[2, 3] = float("nan")                     # NaN counts as the maximum, as in torch
    expected = logits.argmax(dim=-1).tolist()
    assert sample(logits, [GREEDY] * 5, [None] * 5) == expected
    assert expected[1] == 10 and expected[2] == 3


def test_greedy_rows_of_a_strided_view_are_sampled_from_the_view():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    view = logits[::2]                              # [3, 300], rows 0, 2, 4
    assert sample(view, [GREEDY] * 3, [None] * 3) == logits.argmax(dim=-1).tolist()[::2]
    with torch.inference_mode():                    # the runner's logits are inference tensors
        assert sample(logits.clone(), [GREEDY] * 6, [None] * 6) == logits.argmax(dim=-1).tolist()
