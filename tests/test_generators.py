"""Synthetic workloads: counts, lengths, prefixes really shared (and nothing else), seeds reproducible."""

from __future__ import annotations

import pytest

from kvtool.workloads import generators
from kvtool.workloads.datasets import load_dataset, write_jsonl
from kvtool.workloads.generators import GeneratorOptions

OPTIONS = GeneratorOptions(seed=3)


def common_prefix_len(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_system_prompt_groups_share_exactly_their_system_prompt():
    lines = generators.generate_system_prompt(OPTIONS, num_groups=3, prompts_per_group=4, system_prompt_len=40,
                                              question_len=10, output_len=5)
    assert len(lines) == 12
    assert all(len(line["input_ids"]) == 50 and line["output_tokens"] == 5 for line in lines)
    groups = [lines[g * 4:(g + 1) * 4] for g in range(3)]
    for group in groups:
        system_prompt = group[0]["input_ids"][:40]
        assert all(line["input_ids"][:40] == system_prompt for line in group)
        questions = {tuple(line["input_ids"][40:]) for line in group}
        assert len(questions) == 4  # every request asks its own question
    # Different groups have different system prompts (random ids: a long shared prefix would be a bug).
    assert common_prefix_len(groups[0][0]["input_ids"], groups[1][0]["input_ids"]) < 5


def test_system_prompt_shuffle_keeps_the_same_requests():
    kwargs = dict(num_groups=2, prompts_per_group=3, system_prompt_len=8, question_len=4, output_len=2)
    grouped = generators.generate_system_prompt(OPTIONS, **kwargs)
    shuffled = generators.generate_system_prompt(OPTIONS, shuffle=True, **kwargs)
    key = lambda line: tuple(line["input_ids"])  # noqa: E731
    assert sorted(map(key, grouped)) == sorted(map(key, shuffled))
    assert list(map(key, grouped)) != list(map(key, shuffled))


def test_multi_turn_sessions_turn_by_turn_with_a_shared_system_prompt(tmp_path):
    lines = generators.generate_multi_turn(OPTIONS, num_sessions=3, num_turns=4, user_turn_len=6, answer_len=5,
                                           system_prompt_len=20)
    assert len(lines) == 12
    assert [(line["session_id"], line["turn"]) for line in lines[:4]] == [("s0", 0), ("s1", 0), ("s2", 0), ("s0", 1)]
    first_turns = [line for line in lines if line["turn"] == 0]
    assert all(len(line["input_ids"]) == 26 for line in first_turns)
    assert all(line["input_ids"][:20] == first_turns[0]["input_ids"][:20] for line in first_turns)
    assert all(len(line["input_ids"]) == 6 for line in lines if line["turn"] > 0)
    assert all(line["output_tokens"] == 5 for line in lines)
    # What the generator writes is a valid dataset (turns consecutive, in file order).
    assert load_dataset(write_jsonl(tmp_path / "mt.jsonl", lines)).num_sessions == 3


def test_multi_turn_per_session_system_prompts_differ():
    lines = generators.generate_multi_turn(OPTIONS, num_sessions=2, num_turns=1, user_turn_len=2, answer_len=1,
                                           system_prompt_len=16, shared_system_prompt=False)
    assert common_prefix_len(lines[0]["input_ids"], lines[1]["input_ids"]) < 4


def test_abab_alternates_two_distinct_prompts():
    lines = generators.generate_abab(OPTIONS, prompt_len=32, num_rounds=3, output_len=2)
    prompts = [tuple(line["input_ids"]) for line in lines]
    assert len(prompts) == 6
    a, b = prompts[0], prompts[1]
    assert a != b and len(a) == len(b) == 32
    assert prompts == [a, b, a, b, a, b]


def test_random_prompts_share_nothing():
    lines = generators.generate_random(OPTIONS, num_requests=20, input_len=30, output_len=3)
    assert len(lines) == 20
    prompts = [line["input_ids"] for line in lines]
    assert all(len(p) == 30 for p in prompts)
    assert max(common_prefix_len(a, b) for i, a in enumerate(prompts) for b in prompts[i + 1:]) < 4


def test_prefix_repetition_spreads_requests_evenly_over_prefixes():
    lines = generators.generate_prefix_repetition(OPTIONS, num_prefixes=3, prefix_len=16, suffix_len=4,
                                                  num_requests=9, output_len=2)
    prefixes = [tuple(line["input_ids"][:16]) for line in lines]
    assert len(set(prefixes)) == 3
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [3, 3, 3]
    assert len({tuple(line["input_ids"]) for line in lines}) == 9  # suffixes differ


def test_token_ids_stay_in_the_requested_range():
    options = GeneratorOptions(seed=1, min_token_id=100, max_token_id=104)
    lines = generators.generate_random(options, num_requests=5, input_len=50, output_len=1)
    ids = {t for line in lines for t in line["input_ids"]}
    assert ids == {100, 101, 102, 103}


def test_length_spread_varies_lengths_within_bounds():
    options = GeneratorOptions(seed=2, length_spread=0.5)
    lines = generators.generate_random(options, num_requests=200, input_len=100, output_len=10)
    lengths = [len(line["input_ids"]) for line in lines]
    assert min(lengths) >= 50 and max(lengths) <= 150
    assert len(set(lengths)) > 20
    outputs = [line["output_tokens"] for line in lines]
    assert min(outputs) >= 5 and max(outputs) <= 15


@pytest.mark.parametrize("name, parameters", [
    ("system-prompt", dict(num_groups=2, prompts_per_group=2, system_prompt_len=8, question_len=4, output_len=2)),
    ("multi-turn", dict(num_sessions=2, num_turns=2, user_turn_len=4, answer_len=2)),
    ("abab", dict(prompt_len=8, num_rounds=2, output_len=2)),
    ("random", dict(num_requests=3, input_len=8, output_len=2)),
    ("prefix-repetition", dict(num_prefixes=2, prefix_len=8, suffix_len=2, num_requests=4, output_len=2)),
])
def test_same_seed_same_file_other_seed_other_file(name, parameters):
    first = generators.generate(name, {**parameters, "seed": 11})
    again = generators.generate(name, {**parameters, "seed": 11})
    other = generators.generate(name, {**parameters, "seed": 12})
    assert first == again
    assert first != other


def test_generate_by_name_rejects_unknown_and_missing_parameters():
    with pytest.raises(ValueError, match=r"has no parameter\(s\) \['num_group'\]; allowed: .*num_groups"):
        generators.generate("system-prompt", {"num_group": 2})
    with pytest.raises(ValueError, match=r"needs parameter\(s\) \['input_len'\]"):
        generators.generate("random", {"num_requests": 2, "output_len": 1})
    with pytest.raises(ValueError, match="unknown dataset generator 'zipf'"):
        generators.generate("zipf", {})


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_token_id=50, max_token_id=50), "must be greater than min_token_id"),
    (dict(length_spread=1.0), "length_spread must be a fraction"),
    (dict(min_token_id=-1), "min_token_id must be >= 0"),
])
def test_generator_options_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GeneratorOptions(**kwargs)


def test_lengths_must_be_positive():
    with pytest.raises(ValueError, match="question_len must be a positive integer, got 0"):
        generators.generate_system_prompt(OPTIONS, num_groups=1, prompts_per_group=1, system_prompt_len=4,
                                          question_len=0, output_len=1)


def test_generator_registry_is_read_only():
    with pytest.raises(TypeError):
        generators.GENERATORS["new"] = generators.generate_random  # type: ignore[index]
