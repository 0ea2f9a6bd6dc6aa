"""Random paged attention scenarios and the float64 attention oracle, on any device.

A scenario scatters random K/V of several sequences over random blocks of a NaN-filled pool:
blocks nobody owns, slots past a sequence's end and blocks released by a sliding window (-1 in
the block table) hold NaN, so a stray read shows up as a NaN in the result. The reference attends
each new token over its sequence's logical K/V (no paging) in float64. tests/test_kernels_gpu.py
checks the CUDA kernels against it; tests/test_attention_oracle.py checks the torch backend
(the CPU path) against it, on the CPU and on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtool.layers.attention_metadata import AttentionMetadata

DTYPES = [torch.float16, torch.bfloat16]
# float64 reference vs kernels that round P (context) and the output to 16 bits; float32 vs a
# float32 backend (the CPU path).
TOLERANCE = {torch.float16: {"atol": 3e-3, "rtol": 1e-2}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
             torch.float32: {"atol": 1e-4, "rtol": 1e-4}}
# Context chunks: none, a long and a short cached prefix, one token, a 1000-token prefix.
CONTEXT_SEQS = [(0, 100), (300, 77), (129, 64), (0, 1), (5, 130), (1000, 200)]


@dataclass
class Scenario:
    seqs: list[tuple[int, int]]  # (cached tokens, new tokens) per sequence; context ones first
    query: torch.Tensor          # [num_tokens, num_heads, head_dim]
    new_key: torch.Tensor        # [num_tokens, num_kv_heads, head_dim]
    new_value: torch.Tensor
    keys: list[torch.Tensor]     # per sequence [seq_len, num_kv_heads, head_dim], the logical truth
    values: list[torch.Tensor]
    pool: torch.Tensor           # [num_blocks, num_layers, 2, T, num_kv_heads, head_dim]
    layer: int
    meta: AttentionMetadata
    window: int | None

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.pool[:, self.layer]  # strided view, as the runtime hands it to attention

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.query.shape[-1])

    def rows(self, first_seq: int, last_seq: int) -> torch.Tensor:
        starts = self.meta.query_start_loc.tolist()
        return torch.arange(starts[first_seq], starts[last_seq], device=self.query.device)


def build_scenario(seqs: list[tuple[int, int]], *, num_context: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, tokens_per_block: int, dtype: torch.dtype, seed: int,
                   window: int | None = None, new_tokens_in_cache: bool = True, num_layers: int = 3,
                   layer: int = 1, strided_activations: bool = False, device: str | torch.device) -> Scenario:
    """Sequences with random K/V scattered over random blocks of a NaN-filled pool.

    Blocks wholly before every new token's window are released (-1 in the table, NaN in the pool).
    With ``new_tokens_in_cache`` the new tokens' K/V are already stored (as after the append).
    Random values come from a CPU generator, so a seed gives the same scenario on every ``device``.
    """
    assert all(n == 1 for _, n in seqs[num_context:]), "decode sequences have one new token"
    gen = torch.Generator().manual_seed(seed)
    T = tokens_per_block

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    keys = [randn(c + n, num_kv_heads, head_dim) for c, n in seqs]
    values = [randn(c + n, num_kv_heads, head_dim) for c, n in seqs]
    needed = [math.ceil((c + n) / T) for c, n in seqs]
    num_blocks = sum(needed) + 7  # some blocks belong to nobody and stay NaN
    order = iter(torch.randperm(num_blocks, generator=gen).tolist())
    max_blocks = max(needed) + 1  # always at least one -1 padding column
    block_tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    for i, (c, _n) in enumerate(seqs):
        first_visible = 0 if window is None else max(0, c - window + 1)
        for b in range(needed[i]):
            block = next(order)
            if (b + 1) * T > first_visible:  # else released by the window: stays -1, its block NaN
                block_tables[i, b] = block

    pool = torch.full((num_blocks, num_layers, 2, T, num_kv_heads, head_dim), float("nan"), dtype=dtype,
                      device=device)
    table_dev = block_tables.to(device)
    for i, (c, n) in enumerate(seqs):
        stored = c + n if new_tokens_in_cache else c
        positions = torch.arange(stored, device=device)
        blocks = table_dev[i, (positions // T)].long()
        keep = blocks >= 0
        positions, blocks = positions[keep], blocks[keep]
        pool[blocks, layer, 0, positions % T] = keys[i][positions]
        pool[blocks, layer, 1, positions % T] = values[i][positions]

    query_lens = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    positions = torch.cat([torch.arange(c, c + n) for c, n in seqs])
    seq_index = torch.repeat_interleave(torch.arange(len(seqs)), query_lens.long())
    slot_mapping = block_tables[seq_index, positions // T].long() * T + positions % T
    num_tokens = int(query_lens.sum())
    new_key = torch.cat([keys[i][c:] for i, (c, _n) in enumerate(seqs)])
    new_value = torch.cat([values[i][c:] for i, (c, _n) in enumerate(seqs)])
    query = randn(num_tokens, num_heads, head_dim, scale=1.5)  # sharper softmax than N(0, 1)
    if strided_activations:
        # As a fused QKV projection yields them: views into one [num_tokens, (H + 2 KVH) * D] tensor.
        fused = torch.full((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), float("nan"),
                           dtype=dtype, device=device)
        q_view, k_view, v_view = fused.split([num_heads * head_dim, num_kv_heads * head_dim,
                                              num_kv_heads * head_dim], dim=1)
        q_view.copy_(query.flatten(1))
        k_view.copy_(new_key.flatten(1))
        v_view.copy_(new_value.flatten(1))
        query = q_view.view(num_tokens, num_heads, head_dim)
        new_key = k_view.view(num_tokens, num_kv_heads, head_dim)
        new_value = v_view.view(num_tokens, num_kv_heads, head_dim)
    meta = AttentionMetadata(
        positions=positions.to(device), query_start_loc=query_start_loc.to(device),
        query_lens=query_lens.to(device), seq_lens=seq_lens.to(device), block_tables=table_dev,
        slot_mapping=slot_mapping.to(device), tokens_per_block=T, num_context_seqs=num_context,
        max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()))
    return Scenario(seqs, query, new_key, new_value, keys, values, pool, layer, meta, window)


def reference_attention(sc: Scenario) -> torch.Tensor:
    """Attention of every new token over its sequence's logical K/V, computed in float64 (immune to
    TF32 settings), returned as float32 [num_tokens, H, D]."""
    num_heads = sc.query.shape[1]
    device = sc.query.device
    out = torch.zeros(sc.query.shape, dtype=torch.float64, device=device)
    starts = sc.meta.query_start_loc.tolist()
    for i, (c, n) in enumerate(sc.seqs):
        group = num_heads // sc.keys[i].shape[1]
        k = sc.keys[i].double().repeat_interleave(group, dim=1)    # [S, H, D]
        v = sc.values[i].double().repeat_interleave(group, dim=1)
        q = sc.query[starts[i]:starts[i] + n].double()             # [n, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * sc.scale
        q_pos = torch.arange(c, c + n, device=device)[:, None]
        k_pos = torch.arange(c + n, device=device)[None, :]
        visible = k_pos <= q_pos
        if sc.window is not None:
            visible &= k_pos > q_pos - sc.window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[starts[i]:starts[i] + n] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.float()


def assert_rows_match(actual: torch.Tensor, expected: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype,
                      slack: float = 1.0):
    got = actual[rows].float()
    assert torch.isfinite(got).all(), f"{int((~torch.isfinite(got)).any(-1).any(-1).sum())} rows are not finite"
    bounds = {name: slack * bound for name, bound in TOLERANCE[dtype].items()}
    torch.testing.assert_close(got, expected[rows], **bounds)


def poisoned_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.full(tensor.shape, float("nan"), dtype=tensor.dtype, device=tensor.device)


def decode_seqs(seed: int, count: int, max_cached: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    cached = torch.randint(0, max_cached, (count,), generator=gen).tolist()
    # Partition edges: seq_len 1, 512 (one partition), 513 (two).
    return [(c, 1) for c in cached + [0, 511, 512]]
