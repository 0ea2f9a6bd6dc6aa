"""Token sampling: greedy, temperature, top-k, top-p, seeded per request."""

from __future__ import annotations

import torch

from kvtool.config import SamplingParams


def make_generator(params: SamplingParams, request_id: int, device: torch.device) -> torch.Generator | None:
    """A request's own random stream: seeded runs repeat whatever else is in the batch."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else torch.seed() ^ request_id)
    return generator


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """Picks one token per row of logits [num_seqs, vocab_size] (float32): a greedy row its first
    largest logit, any other a draw from softmax(logits / temperature) over its ``top_k`` largest logits
    and then the fewest of those whose probability reaches ``top_p`` (the largest always stays)."""
    if all(p.greedy for p in params):
        if logits.is_cpu:
            # NumPy's argmax (the first maximum, as torch's): 18 us for SmolLM2's 49,152 logits after a
            # decode step, where torch's (its threads woken after the step's kernels) took 60.
            return logits.numpy().argmax(axis=-1).tolist()
        return logits.argmax(dim=-1).tolist()
    return [int(row.argmax()) if p.greedy else draw(row, p, generator)
            for row, p, generator in zip(logits, params, generators)]


def draw(row: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from a row of logits [vocab_size] as ``sample`` draws it."""
    probs = torch.softmax(row / params.temperature, dim=-1)  # [vocab_size]
    vocab_size = probs.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab_size else vocab_size
    if top_k == vocab_size and params.top_p >= 1.0:
        return pick(probs, generator)
    candidates, token_ids = top_candidates(probs, top_k, params.top_p)
    return int(token_ids[pick(candidates, generator)])


def top_candidates(probs: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_k largest of probs [vocab_size] in descending order (ties at the k-th taken in torch.topk's
    order), cut to the fewest whose mass reaches top_p of theirs; returns them and their token ids.

    Without a top_k the candidates are found among the largest 64, 512, ... until the cut falls inside:
    a top_p keeps few tokens as a rule, and sorting SmolLM2's 49,152 probabilities took ~4 ms.
    """
    vocab_size = probs.shape[-1]
    num_candidates = top_k if top_p >= 1.0 or top_k < vocab_size else min(64, vocab_size)
    while True:
        values, token_ids = torch.topk(probs, num_candidates)  # descending
        if top_p >= 1.0:
            return values, token_ids
        total = values.sum() if top_k < vocab_size else probs.sum()
        # Kept: the candidates whose mass before them is short of top_p (the largest always is).
        num_kept = max(1, int((values.cumsum(-1) - values < top_p * total).sum()))
        if num_kept < num_candidates or num_candidates == top_k:
            return values[:num_kept], token_ids[:num_kept]
        num_candidates = min(8 * num_candidates, top_k)


def pick(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """An index drawn with probability proportional to probs [n] (non-negative, not all zero): one
    uniform number from ``generator``, then ``inverse_transform``.

    One random number a draw: torch.multinomial took ~1 ms for SmolLM2's 49,152 probabilities on the
    CPU (it draws a number per token), where a whole decode step takes ~7 ms; this takes ~0.1 ms.
    """
    return inverse_transform(probs, torch.rand(1, dtype=torch.float64, generator=generator, device=probs.device))


def inverse_transform(probs: torch.Tensor, u: torch.Tensor) -> int:
    """The first index of probs [n] whose running sum exceeds u [1] (in [0, 1)) times their total. An
    index of zero probability is never the one: its running sum equals its predecessor's."""
    cdf = probs.cumsum(-1, dtype=torch.float64)  # [n]; float64: the sum of 49k float32s keeps its tail
    # u <= 1 - 2^-53 keeps u * total below the total once rounded, so some index's sum exceeds it.
    return int(torch.searchsorted(cdf, u * cdf[-1:], right=True))
