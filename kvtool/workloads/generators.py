"""Synthetic workloads, so no one has to download a dataset to measure KV-cache reuse.

Every generator returns the lines of a JSON Lines dataset (dicts in the format of
kvtool.workloads.datasets) with token ids drawn uniformly from ``[min_token_id, max_token_id)``.
Lengths are in tokens; with ``length_spread`` s > 0 each length L is drawn uniformly from
``[L(1-s), L(1+s)]`` (rounded, at least 1). The same seed gives the same file.

- ``system-prompt``: groups of requests sharing a system prompt, each with its own question
  (like SGLang's generated-shared-prefix benchmark).
- ``multi-turn``: chat sessions; turn 0 carries an optional system prompt (shared by every
  session or one per session), each later turn adds a user message after the generated answer.
- ``abab``: two prompts A and B alternating A, B, A, B, ... (host offloading's best case: B
  evicts A from a small primary pool, A comes back from host memory).
- ``random``: independent random prompts, no sharing (the baseline).
- ``prefix-repetition``: a few prefixes, each reused by many requests with distinct suffixes.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

Line = dict


@dataclass(frozen=True)
class GeneratorOptions:
    """What every generator shares: the seed, the token id range and the length spread."""

    seed: int = 0
    min_token_id: int = 10
    max_token_id: int = 1000
    length_spread: float = 0.0

    def __post_init__(self) -> None:
        if self.min_token_id < 0:
            raise ValueError(f"min_token_id must be >= 0, got {self.min_token_id}")
        if self.max_token_id <= self.min_token_id:
            raise ValueError(f"max_token_id ({self.max_token_id}) must be greater than min_token_id "
                             f"({self.min_token_id}): token ids are drawn from [min_token_id, max_token_id)")
        if not 0.0 <= self.length_spread < 1.0:
            raise ValueError(f"length_spread must be a fraction in [0, 1), got {self.length_spread}: "
                             "0.25 draws each length uniformly within +-25%")


class Sampler:
    """Seeded source of token ids and lengths for one generated file."""

    def __init__(self, options: GeneratorOptions) -> None:
        self.options = options
        self.rng = random.Random(options.seed)

    def length(self, nominal: int) -> int:
        spread = self.options.length_spread
        if nominal == 0 or spread == 0.0:
            return nominal
        return max(1, round(nominal * self.rng.uniform(1.0 - spread, 1.0 + spread)))

    def tokens(self, nominal_length: int) -> list[int]:
        lo, hi = self.options.min_token_id, self.options.max_token_id
        return [self.rng.randrange(lo, hi) for _ in range(self.length(nominal_length))]


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_positive(**values: int) -> None:
    for name, value in values.items():
        _require(isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value}")


def check_non_negative(**values: int) -> None:
    for name, value in values.items():
        _require(isinstance(value, int) and value >= 0, f"{name} must be an integer >= 0, got {value}")


def generate_system_prompt(options: GeneratorOptions, *, num_groups: int, prompts_per_group: int,
                           system_prompt_len: int, question_len: int, output_len: int,
                           shuffle: bool = False) -> list[Line]:
    """num_groups x prompts_per_group requests; the requests of a group share a system prompt.

    Lines come group by group (or shuffled with ``shuffle``).
    """
    check_positive(num_groups=num_groups, prompts_per_group=prompts_per_group, system_prompt_len=system_prompt_len,
              question_len=question_len, output_len=output_len)
    sampler = Sampler(options)
    lines = []
    for _group in range(num_groups):
        system_prompt = sampler.tokens(system_prompt_len)
        for _ in range(prompts_per_group):
            lines.append({"input_ids": system_prompt + sampler.tokens(question_len),
                          "output_tokens": sampler.length(output_len)})
    if shuffle:
        sampler.rng.shuffle(lines)
    return lines


def generate_multi_turn(options: GeneratorOptions, *, num_sessions: int, num_turns: int, user_turn_len: int,
                        answer_len: int, system_prompt_len: int = 0,
                        shared_system_prompt: bool = True) -> list[Line]:
    """num_sessions chat sessions of num_turns turns each, turn by turn (all turns 0, then all turns 1, ...).

    Turn 0's new tokens are the system prompt (if any) + the first user message; each later
    turn's are the next user message (the engine prepends the history and generated answer).
    """
    check_positive(num_sessions=num_sessions, num_turns=num_turns, user_turn_len=user_turn_len, answer_len=answer_len)
    check_non_negative(system_prompt_len=system_prompt_len)
    sampler = Sampler(options)
    shared = sampler.tokens(system_prompt_len) if shared_system_prompt else None
    first_tokens = {}
    for session in range(num_sessions):
        system_prompt = shared if shared is not None else sampler.tokens(system_prompt_len)
        first_tokens[session] = system_prompt + sampler.tokens(user_turn_len)
    lines = []
    for turn in range(num_turns):
        for session in range(num_sessions):
            new_ids = first_tokens[session] if turn == 0 else sampler.tokens(user_turn_len)
            lines.append({"session_id": f"s{session}", "turn": turn, "input_ids": new_ids,
                          "output_tokens": sampler.length(answer_len)})
    return lines


def generate_abab(options: GeneratorOptions, *, prompt_len: int, num_rounds: int, output_len: int) -> list[Line]:
    """Two prompts A and B of prompt_len tokens, alternating A, B, A, B, ... for num_rounds rounds."""
    check_positive(prompt_len=prompt_len, num_rounds=num_rounds, output_len=output_len)
    sampler = Sampler(options)
    prompt_a, prompt_b = sampler.tokens(prompt_len), sampler.tokens(prompt_len)
    lines = []
    for _round in range(num_rounds):
        for name, prompt in (("A", prompt_a), ("B", prompt_b)):
            lines.append({"request_id": f"{name}{_round}", "input_ids": list(prompt),
                          "output_tokens": sampler.length(output_len)})
    return lines


def generate_random(options: GeneratorOptions, *, num_requests: int, input_len: int,
                    output_len: int) -> list[Line]:
    """num_requests independent random prompts: no prefix is shared (beyond chance)."""
    check_positive(num_requests=num_requests, input_len=input_len, output_len=output_len)
    sampler = Sampler(options)
    return [{"input_ids": sampler.tokens(input_len), "output_tokens": sampler.length(output_len)}
            for _ in range(num_requests)]


def generate_prefix_repetition(options: GeneratorOptions, *, num_prefixes: int, prefix_len: int, suffix_len: int,
                               num_requests: int, output_len: int) -> list[Line]:
    """num_requests requests spread evenly over num_prefixes prefixes, each with its own suffix, shuffled."""
    check_positive(num_prefixes=num_prefixes, prefix_len=prefix_len, num_requests=num_requests, output_len=output_len)
    check_non_negative(suffix_len=suffix_len)
    _require(num_requests >= num_prefixes,
             f"num_requests ({num_requests}) must be >= num_prefixes ({num_prefixes}) so every prefix is used")
    sampler = Sampler(options)
    prefixes = [sampler.tokens(prefix_len) for _ in range(num_prefixes)]
    lines = [{"input_ids": prefixes[i % num_prefixes] + sampler.tokens(suffix_len),
              "output_tokens": sampler.length(output_len)} for i in range(num_requests)]
    sampler.rng.shuffle(lines)
    return lines


GENERATORS: Mapping[str, Callable[..., list[Line]]] = MappingProxyType({
    "system-prompt": generate_system_prompt,
    "multi-turn": generate_multi_turn,
    "abab": generate_abab,
    "random": generate_random,
    "prefix-repetition": generate_prefix_repetition,
})

OPTION_NAMES = ("seed", "min_token_id", "max_token_id", "length_spread")


def generator_parameters(name: str) -> list[str]:
    """The keyword parameters a generator takes, besides the common options."""
    function = _lookup(name)
    return [p for p in inspect.signature(function).parameters if p != "options"]


def _lookup(name: str) -> Callable[..., list[Line]]:
    key = name.replace("_", "-")
    if key not in GENERATORS:
        raise ValueError(f"unknown dataset generator {name!r}; use one of {sorted(GENERATORS)}")
    return GENERATORS[key]


def check_parameters(name: str, parameters: Mapping[str, object]) -> None:
    """Unknown or missing parameters of a generator are a ValueError listing the allowed ones."""
    function = _lookup(name)
    allowed = generator_parameters(name) + list(OPTION_NAMES)
    unknown = sorted(set(parameters) - set(allowed))
    if unknown:
        raise ValueError(f"dataset generator {name!r} has no parameter(s) {unknown}; allowed: {allowed}")
    required = [p.name for p in inspect.signature(function).parameters.values()
                if p.name != "options" and p.default is inspect.Parameter.empty]
    missing = [p for p in required if p not in parameters]
    if missing:
        raise ValueError(f"dataset generator {name!r} needs parameter(s) {missing}; allowed: {allowed}")


def generate(name: str, parameters: Mapping[str, object]) -> list[Line]:
    """Runs a generator by name with a flat mapping of parameters (common options included).

    Unknown parameters are an error listing the allowed ones (scenario files use this).
    """
    check_parameters(name, parameters)
    function = _lookup(name)
    options = GeneratorOptions(**{k: v for k, v in parameters.items() if k in OPTION_NAMES})
    return function(options, **{k: v for k, v in parameters.items() if k not in OPTION_NAMES})
