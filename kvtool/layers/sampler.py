"""Token sampling: greedy, temperature, top-k, top-p, seeded per request.

A step draws one uniform number for each sampling row from the request's own generator (step_picks),
before the forward: a draw is the inverse transform of that number over the kept tokens in vocabulary
order, here from the step's logits (sample) or in the CPU decode step itself
(kvtool.cpu_kernels.decoder.CpuDecoder.decode_picks, csrc/cpu/draw.h), the same number either way, so
a seed gives the same tokens on both paths (but where rounding puts the number at the edge of two
tokens, or a tie at the top-k's edge).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvtool.config import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A request's own random stream: seeded runs repeat whatever else is in the batch, on any device
    (a CPU generator: a step's numbers are drawn on the host whatever runs the model). Unseeded, it is
    seeded from the system's entropy, leaving torch's default generator as the caller set it."""
    if params.greedy:
        return None
    generator = torch.Generator()
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


class StepPicks(NamedTuple):
    """How a step picks its rows' tokens, a row each: temperatures float32 (0: greedy), top_ks int64 (0:
    every token), top_ps float32, and uniforms float64 in [0, 1) (0 for a greedy row)."""

    temperatures: np.ndarray
    top_ks: np.ndarray
    top_ps: np.ndarray
    uniforms: np.ndarray


def step_picks(params: list[SamplingParams], generators: list[torch.Generator | None]) -> StepPicks | None:
    """A step's sampling, with its random numbers: one from each sampling row's generator (a greedy row
    takes none from its stream). None: every row is greedy (a step picks greedily without the arrays,
    which after a CPU step's weight stream cost as much cold as the picks themselves)."""
    if all(p.greedy for p in params):
        return None
    uniforms = np.zeros(len(params))
    for i, (p, generator) in enumerate(zip(params, generators)):
        if not p.greedy:
            uniforms[i] = torch.rand(1, dtype=torch.float64, generator=generator).item()
    return StepPicks(np.array([0.0 if p.greedy else p.temperature for p in params], dtype=np.float32),
                     np.array([p.top_k for p in params], dtype=np.int64),
                     np.array([p.top_p for p in params], dtype=np.float32), uniforms)


def sample(logits: torch.Tensor, params: list[SamplingParams], uniforms: np.ndarray | None) -> list[int]:
    """Picks one token per row of logits [num_seqs, vocab_size] (float32): a greedy row its first
    largest logit, any other a draw from softmax(logits / temperature) over its ``top_k`` largest logits
    and then the fewest of those whose probability reaches ``top_p`` (the largest always stays), by
    inverse transform of its number of ``uniforms`` [num_seqs] (step_picks; None: every row greedy)."""
    if all(p.greedy for p in params):
        if logits.is_cpu:
            # NumPy's argmax (the first maximum, as torch's): 18 us for SmolLM2's 49,152 logits after a
            # decode step, where torch's (its threads woken after the step's kernels) took 60.
            return logits.numpy().argmax(axis=-1).tolist()
        return logits.argmax(dim=-1).tolist()
    if logits.is_cpu:
        return [int(row.argmax()) if p.greedy else draw(row, p, float(u))
                for row, p, u in zip(logits, params, uniforms)]
    # On a device, every row at once: ``draw``'s host sync a row would leave the device idle between rows.
    return draw_rows(logits, params, uniforms).tolist()


def draw(row: torch.Tensor, params: SamplingParams, u: float) -> int:
    """One token from a row of logits [vocab_size] as ``sample`` draws it with the uniform number u."""
    probs = torch.softmax(row / params.temperature, dim=-1)  # [vocab_size]
    vocab_size = probs.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab_size else vocab_size
    if top_k == vocab_size and params.top_p >= 1.0:
        return inverse_transform(probs, u)
    candidates, token_ids = top_candidates(probs, top_k, params.top_p)
    token_ids, order = torch.sort(token_ids)  # vocabulary order, as the CPU step draws
    return int(token_ids[inverse_transform(candidates[order], u)])


def draw_rows(logits: torch.Tensor, params: list[SamplingParams], uniforms: np.ndarray) -> torch.Tensor:
    """``sample``'s tokens for every row at once, int64 [num_seqs] on the logits' device: batched ops and no
    host sync. Each row's kept tokens come from one sort of its probabilities (``top_candidates`` looks
    among the largest first, which a CPU's sort needs; a device's sorts all rows at once)."""
    device = logits.device
    vocab_size = logits.shape[-1]
    greedy = torch.tensor([p.greedy for p in params], device=device)
    temperatures = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)  # [num_seqs, vocab_size]
    if any(not p.greedy and (0 < p.top_k < vocab_size or p.top_p < 1.0) for p in params):
        sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True)
        top_ks = torch.tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], device=device)
        sorted_probs = sorted_probs * (torch.arange(vocab_size, device=device) < top_ks[:, None])
        top_ps = torch.tensor([p.top_p for p in params], device=device)
        needed = top_ps[:, None] * sorted_probs.sum(dim=-1, keepdim=True)
        # top_p 1 cuts nothing (rounding in the sums could cut the tail's tiniest); the largest is always kept.
        kept = (sorted_probs.cumsum(dim=-1) - sorted_probs < needed) | (top_ps[:, None] >= 1.0)
        kept[:, 0] = True
        probs = torch.zeros_like(probs).scatter_(1, sorted_ids, sorted_probs * kept)  # vocabulary order
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [num_seqs, vocab_size]
    u = torch.from_numpy(np.asarray(uniforms, dtype=np.float64)).to(device)[:, None]
    drawn = torch.searchsorted(cdf, cdf[:, -1:] * u, right=True).squeeze(1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


def top_candidates(probs: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_k largest of probs [vocab_size] in descending order (ties at the k-th taken in torch.topk's
    order), cut to the fewest whose mass reaches top_p of theirs; returns them and their token ids."""
    vocab_size = probs.shape[-1]
    if top_p >= 1.0 or top_k < vocab_size:
        values, token_ids = torch.topk(probs, top_k)  # descending
        # top_p 1 cuts nothing (rounding in the sums could cut the tail's tiniest).
        return (values, token_ids) if top_p >= 1.0 else _cut(values, token_ids, top_p * float(values.sum()))
    # top_p alone. Sorting SmolLM2's 49,152 probabilities took ~1.8 ms, where a top_p keeps few as a rule
    # (the largest 64: ~0.08 ms); else those above a threshold lowered 16-fold until their mass reaches
    # top_p (a masked sum, ~0.05 ms each) are sorted: a flat row kept 10,327 tokens at top_p 0.9.
    needed = top_p * float(probs.sum())
    values, token_ids = torch.topk(probs, min(64, vocab_size))
    if float(values.sum()) < needed:
        threshold = float(values[-1])
        while True:
            threshold /= 16
            above = probs >= threshold
            if threshold == 0.0 or float(probs[above].sum()) >= needed:
                break
        token_ids = above.nonzero().squeeze(1)
        values, order = torch.sort(probs[token_ids], descending=True)
        token_ids = token_ids[order]
    kept_values, kept_ids = _cut(values, token_ids, needed)
    if len(kept_ids) == len(token_ids) < vocab_size:  # the sums' rounding left the cut at the edge: sort all
        values, token_ids = torch.sort(probs, descending=True)
        return _cut(values, token_ids, needed)
    return kept_values, kept_ids


def _cut(values: torch.Tensor, token_ids: torch.Tensor, needed: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The leading candidates (values descending) whose mass before them is short of ``needed`` (the
    first always)."""
    num_kept = max(1, int((values.cumsum(-1) - values < needed).sum()))
    return values[:num_kept], token_ids[:num_kept]


def inverse_transform(probs: torch.Tensor, u: float) -> int:
    """The first index of probs [n] (non-negative, not all zero) whose running sum exceeds u (in [0, 1))
    times their total: a draw with probability proportional to probs from one uniform number. An index
    of zero probability is never the one: its running sum equals its predecessor's.

    One random number a draw: torch.multinomial took ~1 ms for SmolLM2's 49,152 probabilities on the
    CPU (it draws a number per token), where a whole decode step takes ~7 ms; this takes ~0.1 ms.
    """
    cdf = probs.cumsum(-1, dtype=torch.float64)  # [n]; float64: the sum of 49k float32s keeps its tail
    # u <= 1 - 2^-53 keeps u * total below the total once rounded, so some index's sum exceeds it.
    return int(torch.searchsorted(cdf, cdf[-1:] * u, right=True))
