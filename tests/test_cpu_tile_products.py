"""The amx kernels' tile products (a prompt's bfloat16 projections, kvtool.cpu_kernels.tile_products)
compute the float32 product rounded once to bfloat16, for any number of rows, output features not a
multiple of a tile, and strided rows; a gated weight's product is SiLU(gate) * up exactly as the plain
product followed by silu_mul computes it; the decoder runs a bfloat16 prompt on them, and keeps one
packed copy of each weight they take. The laying out and its refusals run on every CPU; the products
only where the CPU has AMX.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvtool.cpu_kernels import CpuKernels, ops, supported_isas
from kvtool.cpu_kernels._kernels import TileWeight
from kvtool.cpu_kernels.decoder import CpuDecoder, enable
from kvtool.layers.cpu_linear import PackedLinear, pack_linears
from hf_checkpoints import TEST_TOKENS_PER_BLOCK as T
from paged_driver import PagedDriver
from test_model_vs_transformers import random_prompt, relative_error

needs_amx = pytest.mark.skipif("amx" not in supported_isas(), reason="tile products need AMX (an Intel Xeon)")
SENTINEL = 7.0  # what the test writes where the product must not


def weight_and_rows(num_weight_rows: int, in_features: int, num_rows: int, seed: int):
    torch.manual_seed(seed)
    weight = (torch.randn(num_weight_rows, in_features) * 0.05).bfloat16()
    # x's rows lie 16 elements apart more than they are long (a view of a wider buffer).
    x = torch.randn(num_rows, in_features + 16).bfloat16()[:, :in_features]
    return weight, x


def tile_product(kernels: CpuKernels, weight: TileWeight, x: torch.Tensor, spare_columns: int = 0) -> torch.Tensor:
    """The product into a buffer of spare_columns more columns than it has (filled with SENTINEL)."""
    out = torch.full((x.shape[0], weight.out_features + spare_columns), SENTINEL, dtype=torch.bfloat16)
    kernels.tile_linear(weight, x.data_ptr(), x.shape[0], x.stride(0), out.data_ptr(), out.stride(0))
    return out


@needs_amx
@pytest.mark.parametrize("num_rows, out_features, in_features", [(1, 64, 32), (33, 100, 64), (70, 960, 576),
                                                                 (100, 576, 1536)])
def test_tile_product_is_the_float32_product_rounded_once(num_rows, out_features, in_features):
    kernels = CpuKernels("amx", 2)
    weight, x = weight_and_rows(out_features, in_features, num_rows, seed=num_rows)
    # 32 spare columns: a write past the last feature stays inside its row, where the test sees it.
    out = tile_product(kernels, TileWeight(weight.data_ptr(), out_features, in_features, weight.stride(0)), x, 32)
    reference = x.float() @ weight.float().T  # [num_rows, out_features]
    # One rounding to bfloat16 of float32 sums taken in another order: at most a unit in the last place.
    torch.testing.assert_close(out[:, :out_features].float(), reference, rtol=2 ** -7, atol=1e-4)
    assert bool((out[:, out_features:] == SENTINEL).all()), "columns past the product were written"


@needs_amx
@pytest.mark.parametrize("num_rows", [5, 32, 77])
def test_gated_product_is_silu_mul_of_the_plain_product_bit_for_bit(num_rows):
    kernels, intermediate, hidden = CpuKernels("amx", 2), 48, 64
    gate_up, x = weight_and_rows(2 * intermediate, hidden, num_rows, seed=num_rows)
    plain = tile_product(kernels, TileWeight(gate_up.data_ptr(), 2 * intermediate, hidden, hidden), x)
    expected = ops.silu_mul(kernels, plain, torch.empty(num_rows, intermediate, dtype=torch.bfloat16))
    gated = TileWeight(gate_up.data_ptr(), 2 * intermediate, hidden, hidden, gated=True)
    assert gated.out_features == intermediate
    assert torch.equal(tile_product(kernels, gated, x), expected)


def test_a_weight_tiles_cannot_take_is_refused():
    weight = torch.zeros(48, 48, dtype=torch.bfloat16)
    assert TileWeight.fits(48, 64) and TileWeight.fits(64, 64, gated=True)
    assert not TileWeight.fits(48, 48)  # in_features not whole steps of 32
    assert not TileWeight.fits(48, 64, gated=True)  # halves of 24 rows: not whole tiles of 16
    with pytest.raises(ValueError, match="whole steps of 32"):
        TileWeight(weight.data_ptr(), 48, 48, 48)


@pytest.mark.parametrize("isa", [isa for isa in supported_isas() if isa != "amx"])
def test_kernels_without_tiles_say_so(isa):
    kernels = CpuKernels(isa, 1)
    weight, x = weight_and_rows(32, 32, 4, seed=0)
    assert not kernels.has_tile_products
    with pytest.raises(ValueError, match="no tile products"):
        tile_product(kernels, TileWeight(weight.data_ptr(), 32, 32, 32), x)


def prompt_logits(model, prompt: list[int]) -> torch.Tensor:
    driver = PagedDriver(model, tokens_per_block=T, num_blocks=32)
    return driver.step(context=[(driver.add_sequence(prompt), len(prompt))])[0]


@needs_amx
def test_bfloat16_prompt_on_tiles_matches_onednn_and_keeps_one_packed_copy(models):
    model = copy.deepcopy(models("qwen3_qk_norm")[0]).to(torch.bfloat16)  # packed below: a copy of its own
    prompt = random_prompt(45, seed=12)
    pack_linears(model)  # as kvtool.LLM loads a model
    model.cpu_decoder = CpuDecoder(model, tile_products=False)
    untiled = prompt_logits(model, prompt)
    assert enable(model) == "amx"
    projections = [module for layer in model.layers for module in (
        layer.attention.qkv_proj, layer.attention.o_proj, layer.mlp.down_proj, layer.mlp.gate_up_proj)]
    assert sorted(map(id, model.cpu_decoder.tile_modules)) == sorted(map(id, projections))
    assert all(isinstance(module, PackedLinear) and module.packed_weight is None for module in projections)
    # Sums in another order, and SiLU(gate) * up from the same roundings: the last bits may differ.
    assert relative_error(prompt_logits(model, prompt), untiled) <= 3e-2
    # A decoder without tiles packs oneDNN's copy anew (the benchmarks compare the two).
    model.cpu_decoder = CpuDecoder(model, tile_products=False)
    assert torch.equal(prompt_logits(model, prompt), untiled)
