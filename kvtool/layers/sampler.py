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
    """Picks one token per row of logits [num_seqs, vocab_size] (float32)."""
    if all(p.greedy for p in params):
        if logits.is_cpu:
            # NumPy's argmax (the first maximum, as torch's): 18 us for SmolLM2's 49,152 logits after a
            # decode step, where torch's (its threads woken after the step's kernels) took 60.
            return logits.numpy().argmax(axis=-1).tolist()
        return logits.argmax(dim=-1).tolist()
    token_ids = []
    for row, p, generator in zip(logits, params, generators):
        if p.greedy:
            token_ids.append(int(row.argmax()))
            continue
        row = row / p.temperature
        if p.top_k > 0:
            kth_largest = torch.topk(row, min(p.top_k, row.shape[-1])).values[-1]
            row = row.masked_fill(row < kth_largest, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, sorted_ids = torch.sort(probs, descending=True)
            # Keep the smallest set whose mass reaches top_p (the first token always stays).
            outside = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(outside, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, sorted_ids, sorted_probs)
        token_ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    return token_ids
