"""Repeated runs: medians, spreads and the verdict, whose p-value is checked against a brute-force
permutation test (every way of splitting the runs into two groups)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.reports.repeats import Spread, group_by_label, mann_whitney_p, median_row, verdict


def permutation_p(a, b) -> float:
    """Two-sided p of U by enumerating every assignment of the pooled runs to groups of len(a) and len(b)."""
    def u(x, y):
        return sum(1.0 if i < j else 0.5 if i == j else 0.0 for i in x for j in y)

    pooled, m = list(a) + list(b), len(a)
    centre = m * len(b) / 2
    observed = abs(u(a, b) - centre)
    splits = list(itertools.combinations(range(len(pooled)), m))
    extreme = 0
    for chosen in splits:
        x = [pooled[i] for i in chosen]
        y = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        extreme += abs(u(x, y) - centre) >= observed - 1e-9
    return extreme / len(splits)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=2, max_size=6, unique=True),
       st.lists(st.integers(0, 1000), min_size=2, max_size=6, unique=True))
def test_p_value_matches_a_permutation_test(a, b):
    if set(a) & set(b):
        return  # the exact distribution assumes no ties between the groups
    assert mann_whitney_p(a, b) == pytest.approx(permutation_p(a, b))


def test_five_separated_runs_each_are_a_difference_and_overlapping_ones_are_not():
    fast, slow = Spread.of([10, 11, 12, 13, 21]), Spread.of([20, 22, 23, 24, 25])  # one disturbed fast run
    found = verdict("off", slow, "on", fast)
    assert found.conclusive and found.text.startswith("off is slower: ")
    assert found.ratio == pytest.approx(23 / 12) and "p = 0.016" in found.text
    mixed = verdict("b", Spread.of([10, 14, 18, 22, 26]), "a", Spread.of([12, 16, 20, 24, 28]))
    assert not mixed.conclusive and "inconclusive: the runs overlap too much" in mixed.text
    single = verdict("b", Spread.of([30]), "a", Spread.of([10]))
    assert not single.conclusive and "single runs" in single.text and "repeat: 5" in single.text


def test_runs_of_a_label_merge_into_medians():
    rows = [{"label": "on", "repeat": r, "ttft_ms_p50": t, "device": "cpu", "interrupted": i}
            for r, t, i in ((1, 10.0, False), (2, 30.0, False), (3, 20.0, True))]
    rows.append({"label": "off", "repeat": 1, "ttft_ms_p50": 5.0, "interrupted": False})
    on, off = group_by_label(rows)
    merged = median_row(on)
    assert (merged["ttft_ms_p50"], merged["device"], merged["num_runs"]) == (20.0, "cpu", 3)
    assert merged["interrupted"] is True
    assert len(off) == 1
