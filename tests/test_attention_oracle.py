"""The torch attention backend (the CPU path) against the float64 oracle of the GPU kernel tests.

The scenarios and the reference are tests/attention_scenarios.py's, which tests/test_kernels_gpu.py
checks the CUDA kernels against: here they run on the CPU (and on a GPU, where there is one), so
the oracle itself is exercised on every machine. Each scenario scatters its sequences over random
blocks of a NaN-filled pool, so a read of a slot no token owns, past a sequence's end or in a block
a sliding window released, shows up as a NaN in the output.
"""

from __future__ import annotations

import pytest
import torch
from attention_scenarios import CONTEXT_SEQS, assert_rows_match, build_scenario, decode_seqs, reference_attention

from kvtool.layers.attention import TorchPagedAttention

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# float32 is what the CPU runs; the 16-bit types are what a GPU's KV cache holds.
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def run_backend(sc) -> torch.Tensor:
    """One step through TorchPagedAttention: stores the new K/V, attends; [num_tokens, H, D]."""
    out = TorchPagedAttention().forward(sc.query, sc.new_key, sc.new_value, sc.kv_cache, sc.meta, scale=sc.scale,
                                        sliding_window=sc.window)
    if out.is_cuda:
        torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,tokens_per_block", [(64, 16), (128, 128)])
def test_context_chunks_over_cached_prefixes_match_the_oracle(device, dtype, head_dim, tokens_per_block):
    seqs = CONTEXT_SEQS + [(50, 1), (7, 1)]  # and two decode tokens in the same step
    sc = build_scenario(seqs, num_context=len(CONTEXT_SEQS), num_heads=8, num_kv_heads=2, head_dim=head_dim,
                        tokens_per_block=tokens_per_block, dtype=dtype, seed=100 + head_dim + tokens_per_block,
                        new_tokens_in_cache=False, device=device)
    assert_rows_match(run_backend(sc), reference_attention(sc), sc.rows(0, len(seqs)), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 16, 50, 200, 4096])
def test_sliding_window_chunks_never_read_released_blocks(device, dtype, window):
    sc = build_scenario([(700, 150), (0, 90), (333, 64), (40, 3), (900, 1), (20, 1)], num_context=4, num_heads=8,
                        num_kv_heads=2, head_dim=64, tokens_per_block=16, dtype=dtype, seed=window, window=window,
                        device=device)
    if window < 700:
        assert (sc.meta.block_tables[0] == -1).sum() > 1, "the scenario should release blocks"
    assert_rows_match(run_backend(sc), reference_attention(sc), sc.rows(0, sc.meta.num_seqs), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (14, 2), (16, 1)], ids=["mha", "gqa-7", "mqa"])
def test_gqa_groups_match_the_oracle(device, dtype, num_heads, num_kv_heads):
    sc = build_scenario([(64, 96), (0, 33), (250, 17)] + decode_seqs(seed=num_heads, count=4, max_cached=700),
                        num_context=3, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                        tokens_per_block=16, dtype=dtype, seed=7 * num_heads + num_kv_heads, device=device)
    assert_rows_match(run_backend(sc), reference_attention(sc), sc.rows(0, sc.meta.num_seqs), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens_per_block", [16, 128])
@pytest.mark.parametrize("window", [None, 100])
def test_decode_tokens_of_very_different_lengths_match_the_oracle(device, dtype, tokens_per_block, window):
    # One padded decode batch: lengths from 1 to ~3000 (and 512 / 513, the GPU's partition edges).
    sc = build_scenario(decode_seqs(seed=tokens_per_block, count=10, max_cached=3000), num_context=0, num_heads=8,
                        num_kv_heads=2, head_dim=64, tokens_per_block=tokens_per_block, dtype=dtype,
                        seed=tokens_per_block + 1, window=window, device=device)
    assert_rows_match(run_backend(sc), reference_attention(sc), sc.rows(0, sc.meta.num_seqs), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_step_stores_its_keys_and_values_at_their_slots_from_strided_activations(device, dtype):
    # As a fused QKV projection hands them over: q, k, v are views of one [tokens, (H + 2 KVH) * D].
    sc = build_scenario([(0, 150), (260, 40), (33, 1), (900, 1), (0, 1)], num_context=2, num_heads=16,
                        num_kv_heads=4, head_dim=64, tokens_per_block=16, dtype=dtype, seed=42,
                        new_tokens_in_cache=False, strided_activations=True, device=device)
    assert not sc.query.is_contiguous()
    out = run_backend(sc)
    assert_rows_match(out, reference_attention(sc), sc.rows(0, sc.meta.num_seqs), dtype)
    T, slots = 16, sc.meta.slot_mapping
    assert torch.equal(sc.kv_cache[slots // T, 0, slots % T], sc.new_key)
    assert torch.equal(sc.kv_cache[slots // T, 1, slots % T], sc.new_value)
    # Nothing else was written: every slot outside the sequences' tokens is still NaN.
    num_real = sum(c + n for c, n in sc.seqs)
    assert int(torch.isfinite(sc.pool[:, sc.layer, 0].float()).all(-1).all(-1).sum()) == num_real


def test_the_oracle_sees_a_wrong_window():
    # The check can fail: attending one key too many under a window is outside every tolerance.
    sc = build_scenario([(40, 1), (3, 1)], num_context=0, num_heads=4, num_kv_heads=2, head_dim=64,
                        tokens_per_block=16, dtype=torch.float32, seed=3, window=16, device="cpu")
    wider = build_scenario([(40, 1), (3, 1)], num_context=0, num_heads=4, num_kv_heads=2, head_dim=64,
                           tokens_per_block=16, dtype=torch.float32, seed=3, window=17, device="cpu")
    with pytest.raises(AssertionError):
        assert_rows_match(run_backend(wider), reference_attention(sc), sc.rows(0, 1), torch.float32)
