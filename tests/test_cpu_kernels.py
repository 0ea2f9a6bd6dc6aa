"""Each CPU kernel computes what the torch ops it replaces compute, in every instruction set this
CPU runs, for float32 and bfloat16 (and a bfloat16 cache under float32 activations):

- rms_norm (+ residual) against F.rms_norm of x + residual;
- silu_mul against F.silu(gate) * up;
- linear (a few rows' projection) against F.linear in float32;
- argmax against NumPy's argmax (ties, infinities, NaNs);
- draw against the inverse transform of a float64 softmax cut to top_k and top_p;
- rope_store_kv against kvtool.models.llama's apply_rope (after F.rms_norm for Qwen3's q/k norm)
  and write_kv_cache;
- attention against TorchPagedAttention on mixed steps (whole prompts, chunks after a cached
  prefix, decode tokens), GQA and MHA, head dims 32-128, blocks of 8-32 tokens, a sliding window.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvtool.cpu_kernels import CpuKernels, ops, supported_isas
from kvtool.layers.attention import TorchPagedAttention, write_kv_cache
from kvtool.layers.attention_metadata import AttentionMetadata
from kvtool.models.llama import apply_rope, rope_cos_sin

ISAS = supported_isas()
# (activation dtype, cache dtype, largest relative error): bfloat16 results round once where torch
# rounds after every op, so they may differ in their last bit.
DTYPES = [(torch.float32, torch.float32, 2e-6), (torch.bfloat16, torch.bfloat16, 2e-2),
          (torch.float32, torch.bfloat16, 2e-6)]


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.float() - reference.float()).abs().max() / reference.float().abs().max())


@pytest.fixture(params=ISAS)
def kernels(request) -> CpuKernels:
    return CpuKernels(request.param, 2)


@pytest.mark.parametrize("dtype, _, tolerance", DTYPES[:2])
@pytest.mark.parametrize("num_rows, dim", [(1, 576), (300, 576), (5, 37)])
def test_rms_norm_with_residual_is_the_norm_of_the_sum(kernels, dtype, _, tolerance, num_rows, dim):
    torch.manual_seed(dim)
    x, residual, weight = torch.randn(num_rows, dim).to(dtype), torch.randn(num_rows, dim).to(dtype), \
        torch.randn(dim).to(dtype)
    out, updated = torch.empty_like(x), residual.clone()
    ops.rms_norm(kernels, x, weight, 1e-5, out, updated)
    assert torch.equal(updated, x + residual)
    assert relative_error(out, F.rms_norm(x + residual, (dim,), weight, 1e-5)) <= tolerance
    ops.rms_norm(kernels, x, weight, 1e-5, out)
    assert relative_error(out, F.rms_norm(x, (dim,), weight, 1e-5)) <= tolerance


@pytest.mark.parametrize("dim", [576, 45])
def test_a_bfloat16_sum_is_rounded_as_torch_rounds_it_bit_for_bit(kernels, dim):
    """x + residual in bfloat16 rounds to nearest even as torch does, bit for bit: sums that need
    rounding, and denormals, infinities and a NaN among them (AVX512-BF16's rounding instruction takes
    a denormal as zero: such vectors take the kernels' own rounding). A NaN stays a NaN (torch's own
    conversions differ in its bits)."""
    generator = torch.Generator().manual_seed(dim)
    x = torch.randn(8, dim, generator=generator).to(torch.bfloat16)
    residual = (torch.randn(8, dim, generator=generator) * 1e-3).to(torch.bfloat16)
    specials = torch.tensor([1e-39, -3e-40, 9e-41, float("nan"), float("inf"), -float("inf"), 3.3e38, -0.0])
    x[1, :len(specials)] = specials.to(torch.bfloat16)  # one vector of every kind
    residual[1, :len(specials)] = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 3.3e38, 0.0]).to(torch.bfloat16)
    x[2, 3], residual[2] = 2e-39, 0.0  # a lone denormal among normal lanes
    expected = (x.float() + residual.float()).to(torch.bfloat16)
    out = torch.empty_like(x)
    ops.rms_norm(kernels, x, torch.ones(dim, dtype=torch.bfloat16), 1e-5, out, residual)
    nan = expected.isnan()
    assert torch.equal(residual.isnan(), nan)
    assert torch.equal(residual[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("dtype, _, tolerance", DTYPES[:2])
@pytest.mark.parametrize("num_rows, dim", [(1, 1536), (200, 1536), (3, 45)])
def test_silu_mul_is_silu_of_gate_times_up(kernels, dtype, _, tolerance, num_rows, dim):
    torch.manual_seed(dim)
    gate_up = (4 * torch.randn(num_rows, 2 * dim)).to(dtype)
    out = ops.silu_mul(kernels, gate_up, torch.empty(num_rows, dim, dtype=dtype))
    gate, up = gate_up.chunk(2, dim=-1)
    assert relative_error(out, F.silu(gate) * up) <= tolerance


@pytest.mark.parametrize("dtype, _, tolerance", DTYPES[:2])
@pytest.mark.parametrize("num_rows, in_features, out_features", [(1, 576, 960), (1, 1536, 576), (2, 64, 3),
                                                                  (3, 37, 129), (1, 130, 40_000), (8, 576, 131),
                                                                  (5, 100, 33), (4, 1536, 576), (7, 64, 1),
                                                                  (12, 70, 19), (1, 576, 963), (3, 1536, 577),
                                                                  (2, 4100, 9)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_is_x_times_the_transposed_weight(kernels, dtype, _, tolerance, num_rows, in_features, out_features,
                                                 with_bias):
    # In-feature counts off every vector multiple exercise the tails; 40,000 outputs split across threads; 963
    # and 577 outputs of a few rows, shared by threads as streams, are no multiple of the streams.
    torch.manual_seed(in_features)
    x = torch.randn(num_rows, in_features).to(dtype)
    weight = (torch.randn(out_features, in_features) / in_features ** 0.5).to(dtype)
    bias = torch.randn(out_features).to(dtype) if with_bias else None
    out = ops.linear(kernels, x, weight, bias, torch.empty(num_rows, out_features, dtype=dtype))
    reference = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    # bfloat16: one rounding of the float32 sum, as torch's product makes it.
    assert relative_error(out, reference) <= (tolerance if dtype == torch.bfloat16 else 1e-5)


def test_linear_refuses_shapes_that_disagree(kernels):
    x, weight = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"linear: x \(1, 8\), weight \(4, 8\), bias None and out \(1, 5\) disagree"):
        ops.linear(kernels, x, weight, None, torch.empty(1, 5))
    with pytest.raises(ValueError, match="must share one dtype"):
        ops.linear(kernels, x, weight.bfloat16(), None, torch.empty(1, 4))


@pytest.mark.parametrize("num_threads", [1, 2])
@settings(max_examples=30, deadline=None)
@given(num_floats=st.integers(0, 200_000))
def test_sum_reads_each_float_once_however_the_threads_share_them(num_threads, num_floats):
    # The floats in 16,384-float ranges over the threads' shares (Parallel::run_shares, as the row
    # products split their weights; tests/test_parallel_shares.py slows a thread down): a range read
    # twice or never would change the sum of ones.
    kernels = CpuKernels("auto", num_threads)
    ones = torch.ones(num_floats)
    assert kernels.sum(ones.data_ptr(), num_floats) == num_floats


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.sampled_from([-3.0, -1.0, 0.0, 2.5, 7.0, float("inf"), float("-inf"), float("nan")]),
                       min_size=1, max_size=80),
       start=st.integers(0, 17))
def test_argmax_picks_the_first_largest_or_the_first_nan_as_numpy_does(isa, dtype, values, start):
    # Few distinct values, so ties, infinities and NaNs are common; rows of any length (whole vectors and
    # a scalar tail, or the tail alone) starting at any element's alignment, in every instruction set.
    row = torch.tensor([1.0] * start + values).to(dtype)[start:]
    pick = ops.argmax(CpuKernels(isa, 1), row)
    expected = int(row.float().numpy().argmax())
    assert pick.index == expected
    assert pick.value == row[expected].item() or (math.isnan(pick.value) and math.isnan(row[expected].item()))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 3000), temperature=st.sampled_from([0.05, 0.7, 1.0, 3.0]), seed=st.integers(0, 2**31),
       masked=st.floats(0.0, 0.9), top_k=st.sampled_from([0, 1, 5, 100]), top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
       spread=st.sampled_from([0.02, 3.0]), u=st.one_of(st.floats(0.0, 1.0, exclude_max=True), st.just(1.0 - 2.0**-53)))
def test_draw_is_the_inverse_transform_of_a_float64_softmax_cut_to_top_k_and_top_p(isa, dtype, size, temperature,
                                                                                   seed, masked, top_k, top_p, spread,
                                                                                   u):
    # Kept: the top_k largest weights exp((x - max) / temperature) (ties with the k-th too), then of those
    # the fewest largest whose mass reaches top_p of theirs; the pick is the first kept index whose
    # running sum of kept weights exceeds u times their total, in float64 from the same values. -inf
    # logits (a share `masked` of them) weigh nothing and are never drawn. Rows of any length: whole
    # vectors and a tail, or the tail alone; flat rows (spread 0.02) put many weights in the bucket
    # where the cut falls.
    generator = torch.Generator().manual_seed(seed)
    row = (torch.randn(size, generator=generator) * spread).to(dtype)
    row[torch.rand(size, generator=generator) < masked] = float("-inf")
    row[int(torch.randint(size, (1,), generator=generator))] = 1.0  # one finite logit at least
    x = row.double()
    weights = torch.exp((x - x.max()) / temperature)
    ordered = torch.sort(weights, descending=True).values
    kept = weights > 0
    if 0 < top_k < size:
        # Rounding (float32 weights here against float64) may order near-equal weights either way.
        assume(ordered[top_k - 1] - ordered[top_k] > 1e-5 * ordered[top_k - 1])
        kept &= weights >= ordered[top_k - 1]
    if top_p < 1.0:
        values = torch.sort(weights[kept], descending=True).values
        needed = top_p * float(values.sum())
        before = values.cumsum(0) - values
        num_kept = max(1, int((before < needed).sum()))
        assume(all(abs(float(b) - needed) > 1e-5 * needed for b in before[max(0, num_kept - 1):num_kept + 1]))
        kept &= weights >= values[num_kept - 1]
    pick = ops.draw(CpuKernels(isa, 1), row, temperature, u, top_k=top_k, top_p=top_p)
    assert kept[pick]
    cdf = (weights * kept).cumsum(0)
    target = u * float(cdf[-1])
    # Float32 weights against float64: the pick may move past a token whose edge lies within rounding.
    tolerance = 1e-5 * float(cdf[-1])
    before = float(cdf[pick - 1]) if pick > 0 else 0.0
    assert before <= target + tolerance and float(cdf[pick]) > target - tolerance, (pick, target, cdf)


def test_draw_falls_back_to_the_argmax_where_a_draw_means_nothing_and_refuses_bad_numbers(kernels):
    row = torch.tensor([0.5, float("inf"), 2.0, float("nan"), 1.0])
    assert ops.draw(kernels, row, 1.0, 0.5) == 3  # a NaN, the first: argmax's pick
    assert ops.draw(kernels, row[:3].clone(), 1.0, 0.5) == 1  # +inf
    bad = [({"temperature": 0.0}, "temperature"), ({"temperature": -1.0}, "temperature"),
           ({"temperature": float("nan")}, "temperature"), ({"u": 1.0}, "uniform number"),
           ({"u": -0.1}, "uniform number"), ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"),
           ({"top_p": 1.5}, "top_p")]
    for change, named in bad:
        args = {"temperature": 1.0, "u": 0.5, "top_k": 0, "top_p": 1.0, **change}
        with pytest.raises(ValueError, match=named):
            ops.draw(kernels, row[:3].clone(), args["temperature"], args["u"], top_k=args["top_k"],
                     top_p=args["top_p"])


@pytest.mark.parametrize("dtype, cache_dtype, tolerance", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_kv_rotates_q_and_k_and_stores_k_and_v(kernels, dtype, cache_dtype, tolerance, qk_norm):
    torch.manual_seed(1)
    heads, kv_heads, head_dim, tokens_per_block, num_blocks, num_tokens = 9, 3, 64, 16, 12, 40
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.randint(0, 500, (num_tokens,))
    slots = torch.randperm(num_blocks * tokens_per_block)[:num_tokens]
    q_norm, k_norm = (torch.randn(head_dim).to(dtype), torch.randn(head_dim).to(dtype)) if qk_norm else (None, None)
    pool = torch.zeros(num_blocks, 4, 2, tokens_per_block, kv_heads, head_dim, dtype=cache_dtype)
    cache = pool[:, 1]  # a layer of a block-major pool: strided across blocks

    q, k, v = (part.reshape(num_tokens, -1, head_dim) for part in
               qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    if qk_norm:
        q, k = F.rms_norm(q, (head_dim,), q_norm, 1e-6), F.rms_norm(k, (head_dim,), k_norm, 1e-6)
    cos, sin = rope_cos_sin(inv_freq, positions, dtype)
    expected_q = apply_rope(q, cos, sin)
    expected_cache = cache.clone()
    write_kv_cache(apply_rope(k, cos, sin), v, expected_cache, slots, tokens_per_block)

    ops.rope_store_kv(kernels, qkv, heads, kv_heads, head_dim, positions, ops.rope_cache(inv_freq, 512), cache, slots,
                      q_norm, k_norm, 1e-6)
    assert relative_error(qkv[:, :heads * head_dim].reshape(num_tokens, heads, head_dim), expected_q) <= tolerance
    assert relative_error(cache, expected_cache) <= tolerance
    assert torch.count_nonzero(pool[:, 0]) == 0 and torch.count_nonzero(pool[:, 2]) == 0  # other layers untouched


def test_rope_store_kv_refuses_a_position_past_its_table(kernels):
    qkv = torch.zeros(2, 3 * 8)
    cache = torch.zeros(4, 2, 4, 1, 8)
    with pytest.raises(ValueError, match="position 70 of token 1 is outside the RoPE table of 64"):
        ops.rope_store_kv(kernels, qkv, 1, 1, 8, torch.tensor([3, 70]), ops.rope_cache(torch.ones(4), 64), cache,
                          torch.tensor([0, 1]))


def step_metadata(seqs: list[tuple[int, int]], tokens_per_block: int, num_blocks: int,
                  seed: int) -> AttentionMetadata:
    """Metadata for sequences (num_cached, num_new): context chunks first, shuffled block ids."""
    return shared_prefix_metadata([(None, 0, cached, new) for cached, new in sorted(seqs, key=lambda s: s[1] == 1)],
                                  tokens_per_block, num_blocks, seed)


def shared_prefix_metadata(seqs: list[tuple[int | None, int, int, int]], tokens_per_block: int, num_blocks: int,
                           seed: int) -> AttentionMetadata:
    """Metadata for sequences (group, shared_blocks, num_cached, num_new), shuffled block ids: a
    sequence of a group (None: none) begins with the first shared_blocks block ids of its group's
    prefix (the same ids for every member), then blocks of its own."""
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    prefixes: dict[int, list[int]] = {}
    for group, shared, _, _ in seqs:
        if group is not None:
            prefixes.setdefault(group, [])
            while len(prefixes[group]) < shared:
                prefixes[group].append(free.pop())
    max_blocks = max(-(-(c + n) // tokens_per_block) for _, _, c, n in seqs)
    tables, positions, slots, starts, lens = [], [], [], [0], []
    for group, shared, cached, new in seqs:
        row = prefixes[group][:shared] if group is not None else []
        row = row + [free.pop() for _ in range(-(-(cached + new) // tokens_per_block) - len(row))]
        for p in range(cached, cached + new):
            positions.append(p)
            slots.append(row[p // tokens_per_block] * tokens_per_block + p % tokens_per_block)
        tables.append(row + [-1] * (max_blocks - len(row)))
        starts.append(starts[-1] + new)
        lens.append(cached + new)
    query_lens = torch.tensor([n for *_, n in seqs], dtype=torch.int32)
    return AttentionMetadata(
        positions=torch.tensor(positions), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        query_lens=query_lens, seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32), slot_mapping=torch.tensor(slots),
        tokens_per_block=tokens_per_block, num_context_seqs=int((query_lens > 1).sum()),
        max_query_len=int(query_lens.max()), max_seq_len=max(lens))


def cache_layer(layout: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A random layer of a KV cache, [num_blocks, 2, tokens_per_block, kv_heads, head_dim] as the kernels
    index it, over memory laid out as a pool lays it out: "contiguous"; "block-major" (every third block
    of a larger pool, as a layer of a pool whose blocks hold every layer); "head-major" (in a block,
    each head's tokens one after another, as kvtool.runtime.kv_pool.layer_major_zeros lays it out)."""
    num_blocks, kv, tokens, heads, head_dim = shape
    if layout == "contiguous":
        return torch.randn(shape).to(dtype)
    if layout == "block-major":
        return torch.randn(num_blocks, 3, *shape[1:]).to(dtype)[:, 1]
    if layout == "head-major":
        return torch.randn(num_blocks, kv, heads, tokens, head_dim).to(dtype).transpose(2, 3)
    raise ValueError(f"unknown cache layout {layout!r}")


def attention_and_reference(kernels, meta: AttentionMetadata, dtype, cache_dtype, heads: int, kv_heads: int,
                            num_blocks: int, window: int | None, head_dim: int = 64, layout: str = "contiguous",
                            poison_unused: bool = False):
    """(plan, kvtool's output, torch's paged attention's) for random queries, keys and values of the
    step's new tokens over a random cache of num_blocks blocks, laid out as ``layout`` says
    (cache_layer); ``poison_unused``: every slot no sequence's token holds NaN, as a block's slots
    past its sequence's last token may."""
    query = torch.randn(meta.num_tokens, heads, head_dim).to(dtype)
    key, value = (torch.randn(meta.num_tokens, kv_heads, head_dim).to(dtype) for _ in range(2))
    cache = cache_layer(layout, (num_blocks, 2, meta.tokens_per_block, kv_heads, head_dim), cache_dtype)
    scale = head_dim ** -0.5
    expected = TorchPagedAttention().forward(query, key, value, cache.clone(), meta, scale=scale, sliding_window=window)
    write_kv_cache(key, value, cache, meta.slot_mapping, meta.tokens_per_block)
    if poison_unused:
        used = torch.zeros(num_blocks, meta.tokens_per_block, dtype=torch.bool)
        for seq, length in enumerate(meta.seq_lens.tolist()):
            blocks, offsets = torch.arange(length).div(meta.tokens_per_block, rounding_mode="floor"), \
                torch.arange(length) % meta.tokens_per_block
            used[meta.block_tables[seq, blocks].long(), offsets] = True
        cache.transpose(1, 2)[~used] = float("nan")  # [blocks, tokens_per_block, 2, kv_heads, head_dim]
    plan = ops.plan_attention(kernels, meta.query_start_loc, meta.seq_lens, meta.block_tables, num_blocks=num_blocks,
                              num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                              tokens_per_block=meta.tokens_per_block, sliding_window=window,
                              dtype=query.dtype)
    return plan, ops.attention(kernels, plan, query, cache, torch.empty_like(query), scale), expected


@pytest.mark.parametrize("dtype, cache_dtype, tolerance", DTYPES)
# 96 and 256: the bfloat16 pair products' head dimension in a part-filled chunk and in several chunks.
# 40 and 36: rows ending in a part-filled vector (of 16 lanes; 36 of 8 too).
# 32 heads: a decode token's rows more than a vector's lanes (its softmax's bookkeeping W rows at a time).
@pytest.mark.parametrize("heads, kv_heads, head_dim, tokens_per_block", [(9, 3, 64, 32), (4, 4, 32, 16),
                                                                          (8, 2, 128, 8), (6, 2, 80, 32),
                                                                          (6, 3, 96, 16), (4, 2, 256, 16),
                                                                          (6, 2, 40, 16), (4, 2, 36, 32),
                                                                          (32, 8, 64, 16)])
@pytest.mark.parametrize("window", [None, 20])
def test_attention_matches_torch_paged_attention(kernels, dtype, cache_dtype, tolerance, heads, kv_heads, head_dim,
                                                 tokens_per_block, window):
    torch.manual_seed(heads * head_dim)
    num_blocks = 80
    # A whole prompt, a chunk after a cached prefix (longer than the kernels' tasks), chunks of 2
    # and 33 tokens, decode tokens at various lengths; a chunk whose first 6 queries end at key 64,
    # the first key of a row block's second block of keys (attention_row_blocks.h: that query sees it).
    meta = step_metadata([(0, 70), (40, 150), (64, 2), (3, 33), (100, 1), (5, 1), (17, 1), (59, 10)],
                         tokens_per_block, num_blocks, seed=head_dim)
    _, out, expected = attention_and_reference(kernels, meta, dtype, cache_dtype, heads, kv_heads, num_blocks, window,
                                               head_dim, layout="block-major")
    assert relative_error(out, expected) <= tolerance


@pytest.mark.parametrize("dtype, cache_dtype, tolerance", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, tokens_per_block", [(9, 3, 64, 32), (8, 2, 128, 8),
                                                                          (6, 2, 40, 16)])
def test_attention_over_a_head_major_cache_matches_torch(kernels, dtype, cache_dtype, tolerance, heads, kv_heads,
                                                         head_dim, tokens_per_block):
    # The CPU pool's layout: every kernel reads a head's rows at the token stride, and asks for them so.
    # A prompt, a chunk after a cached prefix, eight decode rows sharing a prefix, a long decode row
    # (split by keys) and a short one; slots past a sequence's last token hold NaN.
    torch.manual_seed(heads + head_dim)
    prefix_blocks = 160 // tokens_per_block
    seqs = [(None, 0, 0, 70), (None, 0, 40, 50), (None, 0, 500, 1), (None, 0, 17, 1)] + \
        [(0, prefix_blocks, prefix_blocks * tokens_per_block + 3 * i + 1, 1) for i in range(8)]
    meta = shared_prefix_metadata(seqs, tokens_per_block, num_blocks=200, seed=head_dim)
    plan, out, expected = attention_and_reference(kernels, meta, dtype, cache_dtype, heads, kv_heads, 200, None,
                                                  head_dim, layout="head-major", poison_unused=True)
    assert plan.num_shared_prefixes == 1
    assert relative_error(out, expected) <= tolerance


@pytest.mark.parametrize("dtype, cache_dtype, tolerance", DTYPES)
@pytest.mark.parametrize("seqs, window", [([(700, 1)], None), ([(700, 1)], 300), ([(500, 2)], None),
                                          ([(400, 1), (650, 1)], None)])
def test_a_long_decode_split_by_keys_across_threads_matches_torch(kernels, dtype, cache_dtype, tolerance, seqs,
                                                                    window):
    """One or two decode rows have a task per KV head, fewer than two threads share evenly: the tasks
    split by keys, each share's softmax merged with the others'."""
    torch.manual_seed(7)
    meta = step_metadata(seqs, tokens_per_block=16, num_blocks=96, seed=1)
    plan, out, expected = attention_and_reference(kernels, meta, dtype, cache_dtype, heads=6, kv_heads=2,
                                                  num_blocks=96, window=window)
    if seqs == [(700, 1)]:  # 2 tasks for 2 threads: split, except in the one-lane build (never split)
        assert (plan.num_merges > 0) == (kernels.width > 1)
    assert relative_error(out, expected) <= tolerance


@pytest.mark.parametrize("num_seqs, num_tasks", [(1, 2), (2, 2), (3, 6)])
def test_decode_rows_split_into_as_few_shares_as_spread_evenly_over_the_threads(num_seqs, num_tasks):
    """Each share of a split decode task starts by waiting for its first keys from memory: for two
    threads one sequence splits in two, two stay whole, three split in two each (six tasks, three a
    thread)."""
    kernels = CpuKernels("auto", 2)
    if kernels.num_threads < 2 or kernels.width == 1:
        pytest.skip("needs two threads and vector kernels (the one-lane build never splits)")
    meta = step_metadata([(700 + 50 * i, 1) for i in range(num_seqs)], tokens_per_block=16, num_blocks=160, seed=1)
    plan = ops.plan_attention(kernels, meta.query_start_loc, meta.seq_lens, meta.block_tables, num_blocks=160,
                              num_heads=6, num_kv_heads=2, head_dim=64, tokens_per_block=16, sliding_window=None,
                              dtype=torch.float32)
    assert plan.num_tasks == num_tasks
    assert plan.num_merges == (num_seqs if num_tasks > num_seqs else 0)


def test_a_short_chunk_splits_into_tasks_of_whole_row_vectors():
    """A 32-token hit over 1,024 cached tokens (9 query heads over 3 KV heads, two threads) makes fewer
    tasks than two a thread at the usual run of queries, so its queries split into runs of an even
    share (its 32 queries x 3 KV heads over 4 tasks: 24) rounded down to queries whose rows fill whole
    vectors: with 16 lanes, 16 queries a task (48 rows) rather than 24 and 8 (72 rows padded to 80,
    24 to 32)."""
    kernels = CpuKernels("auto", 2)
    if kernels.num_threads < 2 or kernels.width == 1:
        pytest.skip("needs two threads and vector kernels")
    meta = step_metadata([(1024, 32)], tokens_per_block=32, num_blocks=40, seed=0)
    plan = ops.plan_attention(kernels, meta.query_start_loc, meta.seq_lens, meta.block_tables, num_blocks=40,
                              num_heads=9, num_kv_heads=3, head_dim=64, tokens_per_block=32, sliding_window=None,
                              dtype=torch.float32)
    whole = kernels.width // math.gcd(3, kernels.width)  # queries whose 3 rows a query fill whole vectors
    per_task = 24 // whole * whole
    runs = [(begin, min(per_task, 32 - begin)) for begin in range(0, 32, per_task)]
    assert per_task * 3 % kernels.width == 0
    assert plan.num_tasks == 3 * len(runs)
    # Each run's queries attend to the cached tokens and the run's own up to its last.
    assert plan.work == sum(2 * count * 9 * (1024 + begin + count) * 64 for begin, count in runs)



@pytest.mark.parametrize("dtype, cache_dtype, tolerance", DTYPES)
@pytest.mark.parametrize("tokens_per_block", [16, 32, 48])
def test_a_blocks_slots_past_its_sequences_last_token_never_reach_the_output(kernels, dtype, cache_dtype, tolerance,
                                                                               tokens_per_block):
    """Each sequence's last block holds NaN past its last token (a block's free slots hold whatever
    was there): a prompt, a chunk after a cached prefix, eight decode rows sharing a prefix (their
    prefix's keys in a prompt layout task of their rows) and a decode row match torch's attention, the
    AMX layout's key tiles read in place from the blocks among them."""
    torch.manual_seed(tokens_per_block)
    prefix_blocks = 160 // tokens_per_block
    seqs = [(None, 0, 0, 75), (None, 0, 37, 90), (None, 0, 200, 1)] + \
        [(0, prefix_blocks, prefix_blocks * tokens_per_block + 5 * i + 3, 1) for i in range(8)]
    meta = shared_prefix_metadata(seqs, tokens_per_block, num_blocks=120, seed=5)
    plan, out, expected = attention_and_reference(kernels, meta, dtype, cache_dtype, heads=9, kv_heads=3,
                                                  num_blocks=120, window=None, poison_unused=True)
    assert plan.num_shared_prefixes == 1
    assert relative_error(out, expected) <= tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bfloat16_prompt_on_amx_tiles_takes_three_times_the_rows_a_task(dtype):
    """A 1,024-token prompt (9 query heads over 3 KV heads): 42 queries a task (126 rows), except a
    bfloat16 prompt where the AMX layout runs it, which lays each task's keys out for its tile
    products: 128 queries (384 rows), so that each key is laid out a third as often."""
    kernels = CpuKernels("auto", 2)
    meta = step_metadata([(0, 1024)], tokens_per_block=32, num_blocks=40, seed=0)
    plan = ops.plan_attention(kernels, meta.query_start_loc, meta.seq_lens, meta.block_tables, num_blocks=40,
                              num_heads=9, num_kv_heads=3, head_dim=64, tokens_per_block=32, sliding_window=None,
                              dtype=dtype)
    queries_per_task = 128 if dtype == torch.bfloat16 and kernels.has_tile_products else 42
    assert plan.num_tasks == 3 * math.ceil(1024 / queries_per_task)

# (group, shared blocks, cached tokens, new tokens); 16-token blocks, a prefix needs 128 shared keys.
SHARED_STEPS = {
    # Six decode sequences of one prompt prefix (their own tails from 1 to 75 tokens), two of
    # another, one alone, and a prompt chunk that begins with the first prefix (not a decode row).
    "two prefixes": ([(0, 20, 321, 1), (0, 20, 330, 1), (0, 20, 395, 1), (0, 20, 400, 1), (0, 20, 336, 1),
                      (0, 20, 352, 1), (1, 12, 200, 1), (1, 12, 260, 1), (None, 0, 300, 1), (0, 20, 320, 30)], 2),
    # Eight of one prefix: 24 query rows per KV head, the prefix's task in the prompt layout where a
    # vector has 16 lanes (the six above: 18 rows, the head dimension in the lanes).
    "eight sequences": ([(0, 10, 170 + 9 * i, 1) for i in range(8)], 1),
    # One member holds only 9 of the prefix's blocks: the prefix read once is those 9 (144 keys).
    "a shorter member": ([(0, 20, 330, 1), (0, 9, 300, 1), (0, 20, 340, 1)], 1),
    # Two sequences sharing 7 blocks (112 keys): too short to be worth a task of its own.
    "too short": ([(0, 7, 200, 1), (0, 7, 210, 1)], 0),
}


@pytest.mark.parametrize("dtype, cache_dtype, tolerance", DTYPES)
@pytest.mark.parametrize("step", list(SHARED_STEPS))
def test_decode_sequences_sharing_a_prefix_read_it_once_and_match_torch(kernels, dtype, cache_dtype, tolerance,
                                                                         step):
    """Decode rows whose block tables begin with the same blocks (a cached prompt prefix) attend to
    those keys in one task for all of them, then each to its own keys, the two shares merged: the
    output is torch's paged attention over each sequence's whole table."""
    seqs, num_prefixes = SHARED_STEPS[step]
    torch.manual_seed(3)
    meta = shared_prefix_metadata(seqs, tokens_per_block=16, num_blocks=160, seed=2)
    plan, out, expected = attention_and_reference(kernels, meta, dtype, cache_dtype, heads=6, kv_heads=2,
                                                  num_blocks=160, window=None)
    assert plan.num_shared_prefixes == num_prefixes
    assert relative_error(out, expected) <= tolerance


def test_attention_reads_only_the_blocks_inside_the_window(kernels):
    """Blocks released by a sliding window (-1 in the table) are never read; a released block
    inside the window is an error, not a read of block -1."""
    meta = step_metadata([(60, 1)], tokens_per_block=8, num_blocks=16, seed=0)
    tables = meta.block_tables.clone()
    cache = torch.randn(16, 2, 8, 1, 16)
    cache[tables[0, :4].long()] = float("nan")  # released, and poisoned
    tables[0, :4] = -1  # positions 0..31; the window of 20 starts at position 41
    args = dict(num_blocks=16, num_heads=2, num_kv_heads=1, head_dim=16, tokens_per_block=8, dtype=torch.float32)
    plan = ops.plan_attention(kernels, meta.query_start_loc, meta.seq_lens, tables, sliding_window=20, **args)
    out = ops.attention(kernels, plan, torch.randn(1, 2, 16), cache, torch.empty(1, 2, 16), 0.25)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="block_tables row 0 has block id -1 at index 2, inside the attention window"):
        ops.plan_attention(kernels, meta.query_start_loc, meta.seq_lens, tables, sliding_window=40, **args)


def test_kernels_refuse_an_isa_the_cpu_lacks():
    with pytest.raises(ValueError, match="do not run on this CPU"):
        CpuKernels("sve", 1)


def test_a_cpu_with_amx_tiles_runs_the_amx_kernels():
    """Where cpuinfo lists AMX's tiles and bfloat16 products, the kernels detect them and Linux lets the
    process use them (asked for when the kernels load), so "amx" is offered and chosen first."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    flags = next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())
    if not {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
        pytest.skip("this CPU has no AMX bfloat16 tiles")
    assert supported_isas()[0] == "amx"
    assert CpuKernels("auto", 1).isa == "amx"


def test_every_instruction_set_this_cpu_runs_is_one_the_engine_config_names():
    from kvtool.config import CPU_KERNEL_ISAS

    isas = supported_isas()
    assert isas[-1] == "generic" and [isa for isa in CPU_KERNEL_ISAS if isa in isas] == isas  # best first
