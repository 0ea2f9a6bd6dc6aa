"""The model's fused CUDA kernels against float64 references and against the eager torch ops they
replace (needs a GPU + CuPy; marked gpu). Compiling them is checked on any machine with nvcc in
tests/test_kernels_compile.py, their launch arguments in tests/test_kernel_launch_args.py.

Each reference starts from the same 16-bit inputs: residual add + RMSNorm (the rounded sum is
bit-exact, the norm within the dtype's rounding), q/k RMSNorm + rotate-half RoPE + the KV append
(values stored bit-exact at their slots, nothing stored for slot -1, nothing else in the pool
touched), SiLU * up.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtool.models.llama import apply_rope, rope_cos_sin


pytestmark = pytest.mark.gpu  # skipped, saying what is missing, without a CUDA GPU and CuPy (conftest.py)

DTYPES = [torch.float16, torch.bfloat16]
# One rounding of the result to 16 bits (float64 reference), a little more where inputs were rounded too.
TOLERANCE = {torch.float16: {"atol": 2e-3, "rtol": 2e-3}, torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2}}
DEVICE = "cuda"


@pytest.fixture(scope="module")
def library():
    from kvtool.kernels.loader import KernelLibrary

    return KernelLibrary()


def randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def rms_norm64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 4096), (7, 1024), (300, 2048), (3, 72)])
def test_add_rms_norm_stores_the_rounded_sum_and_normalizes_it(library, dtype, num_tokens, hidden):
    from kvtool.kernels.add_rms_norm import add_rms_norm

    x = randn(num_tokens, hidden, dtype=dtype, seed=hidden)
    residual = randn(num_tokens, hidden, dtype=dtype, seed=hidden + 1, scale=4.0)
    weight = randn(hidden, dtype=dtype, seed=2) + 1
    expected_sum = x + residual  # torch rounds the fp32 sum once, as the kernel does
    out, stream = x.clone(), residual.clone()
    add_rms_norm(library, out, stream, weight, 1e-6)
    torch.cuda.synchronize()
    assert torch.equal(stream, expected_sum)
    torch.testing.assert_close(out.double(), rms_norm64(expected_sum, weight, 1e-6), **TOLERANCE[dtype])
    eager = F.rms_norm(expected_sum, (hidden,), weight, 1e-6)
    torch.testing.assert_close(out, eager, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_reads_and_writes_strided_rows(library, dtype):
    from kvtool.kernels.add_rms_norm import add_rms_norm

    wide = randn(5, 2, 512, dtype=dtype, seed=9)
    x = wide[:, 1]  # row stride 1024
    residual = randn(5, 512, dtype=dtype, seed=10)
    weight = randn(512, dtype=dtype, seed=11)
    expected_sum = x + residual
    untouched = wide[:, 0].clone()
    add_rms_norm(library, x, residual, weight, 1e-5)
    torch.cuda.synchronize()
    assert torch.equal(residual, expected_sum) and torch.equal(wide[:, 0], untouched)
    torch.testing.assert_close(x.double(), rms_norm64(expected_sum, weight, 1e-5), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,intermediate", [(1, 12288), (33, 1024), (4, 8)])
def test_silu_mul_matches_the_float64_product(library, dtype, num_tokens, intermediate):
    from kvtool.kernels.silu_mul import silu_mul

    gate_up = randn(num_tokens, 2 * intermediate, dtype=dtype, seed=intermediate, scale=3.0)
    gate, up = gate_up.double().chunk(2, dim=-1)
    out = silu_mul(library, gate_up)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.double(), gate * torch.sigmoid(gate) * up, **TOLERANCE[dtype])
    # Extreme gates: silu(-100) is -0, silu(100) is 100 (no inf / nan from the exponential).
    edge = torch.tensor([[-100.0, 100.0, 0.0, 1.0, -100.0, 100.0, 0.0, 1.0] + [2.0] * 8], dtype=dtype, device=DEVICE)
    got = silu_mul(library, edge).float()
    torch.cuda.synchronize()
    torch.testing.assert_close(got, torch.tensor([[-0.0, 200.0, 0.0, 1.4621172, -0.0, 200.0, 0.0, 1.4621172]],
                                                 device=DEVICE), **TOLERANCE[dtype])


def _rope_case(dtype, head_dim: int, qk_norm: bool, seed: int, num_tokens: int = 37, num_heads: int = 8,
               num_kv_heads: int = 2, tokens_per_block: int = 16, num_layers: int = 3, layer: int = 1):
    """qkv rows, RoPE tables from real positions, norm weights, a NaN-poisoned pool and slots (two -1)."""
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=seed, scale=2.0)
    positions = torch.randint(0, 4000, (num_tokens,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    cos, sin = rope_cos_sin(inv_freq, positions, dtype)
    weights = (randn(head_dim, dtype=dtype, seed=seed + 1) + 1, randn(head_dim, dtype=dtype, seed=seed + 2) + 1) \
        if qk_norm else (None, None)
    num_blocks = 20
    pool = torch.full((num_blocks, num_layers, 2, tokens_per_block, num_kv_heads, head_dim), float("nan"),
                      dtype=dtype, device=DEVICE)
    slots = torch.randperm(num_blocks * tokens_per_block, generator=torch.Generator().manual_seed(seed))[:num_tokens]
    slots[[3, num_tokens - 2]] = -1  # padding tokens: nothing stored
    return qkv, cos, sin, weights, pool, slots.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_rope_append_rotates_queries_and_stores_keys_and_values_at_their_slots(library, dtype, head_dim, qk_norm):
    from kvtool.kernels.rope_append import rope_append

    num_heads, num_kv_heads, tpb = 8, 2, 16
    qkv, cos, sin, (q_weight, k_weight), pool, slots = _rope_case(dtype, head_dim, qk_norm, seed=head_dim)
    kv_cache = pool[:, 1]
    query = rope_append(library, qkv, cos, sin, q_weight, k_weight, 1e-6, kv_cache, slots, num_heads=num_heads,
                        num_kv_heads=num_kv_heads)
    torch.cuda.synchronize()

    q, k, v = qkv.view(qkv.shape[0], -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    if qk_norm:  # the eager model rounds the norms' outputs to the model dtype before RoPE
        q = rms_norm64(q, q_weight, 1e-6).to(dtype)
        k = rms_norm64(k, k_weight, 1e-6).to(dtype)
    half = head_dim // 2

    def rope64(x):
        x = x.double()
        return x * cos.double() + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin.double()

    torch.testing.assert_close(query.double(), rope64(q), **TOLERANCE[dtype])
    # The eager ops the kernel replaces (F.rms_norm, apply_rope): the same rounding steps.
    eager_q = qkv.view(qkv.shape[0], -1, head_dim)[:, :num_heads]
    if qk_norm:
        eager_q = F.rms_norm(eager_q, (head_dim,), q_weight, 1e-6)
    torch.testing.assert_close(query, apply_rope(eager_q, cos, sin), **TOLERANCE[dtype])

    stored = slots >= 0
    blocks, offsets = slots[stored] // tpb, slots[stored] % tpb
    torch.testing.assert_close(kv_cache[blocks, 0, offsets].double(), rope64(k)[stored], **TOLERANCE[dtype])
    assert torch.equal(kv_cache[blocks, 1, offsets], v[stored])  # values are stored as they are
    # Everything else (other slots, other layers) is untouched: still NaN.
    written = torch.zeros(pool.shape[0], tpb, dtype=torch.bool, device=DEVICE)
    written[blocks, offsets] = True
    assert torch.isnan(kv_cache.transpose(1, 2)[~written]).all()  # [blocks, tpb, 2, kvh, hd] by (block, slot)
    assert torch.isnan(pool[:, 0]).all() and torch.isnan(pool[:, 2]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_append_serves_the_wide_gqa_groups_of_qwen3_8b(library, dtype):
    from kvtool.kernels.rope_append import rope_append

    # 32 query heads over 8 KV heads of 128: 48 head rows, 12 CTAs of 4 warps per token.
    qkv, cos, sin, (q_weight, k_weight), pool, slots = _rope_case(dtype, 128, True, seed=3, num_tokens=5,
                                                                  num_heads=32, num_kv_heads=8)
    query = rope_append(library, qkv, cos, sin, q_weight, k_weight, 1e-6, pool[:, 1], slots, num_heads=32,
                        num_kv_heads=8)
    torch.cuda.synchronize()
    eager_q = F.rms_norm(qkv.view(5, -1, 128)[:, :32], (128,), q_weight, 1e-6)
    torch.testing.assert_close(query, apply_rope(eager_q, cos, sin), **TOLERANCE[dtype])
    v = qkv.view(5, -1, 128)[:, 40:]
    stored = slots >= 0
    assert torch.equal(pool[:, 1][slots[stored] // 16, 1, slots[stored] % 16], v[stored])
