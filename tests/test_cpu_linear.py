"""PackedLinear computes what nn.Linear computes, on either side of its row threshold (the threshold of an
AVX2-only CPU; on AVX-512 and for bfloat16 every product takes the packed weight)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvtool.layers.cpu_linear import MAX_PACKED_ROWS_AVX2, PackedLinear, can_pack, can_pack_dtype, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("num_rows", [1, 7, MAX_PACKED_ROWS_AVX2, MAX_PACKED_ROWS_AVX2 + 1, 600])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("max_packed_rows", [MAX_PACKED_ROWS_AVX2, None])
def test_packed_linear_equals_linear(num_rows, bias, max_packed_rows):
    torch.manual_seed(num_rows)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(num_rows, 48)
    expected = linear(x)
    out = PackedLinear(linear.weight, linear.bias, max_packed_rows)(x)
    assert out.shape == (num_rows, 80)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.inner = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


class _Model(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()]).to(dtype)
        self.lm_head = nn.Linear(8, 32).to(dtype)


def test_pack_linears_swaps_every_layer_projection_but_not_the_head():
    model = _Model(torch.float32)
    x = torch.randn(5, 8)
    expected = [layer.inner(layer.proj(x)) for layer in model.layers]
    assert pack_linears(model) == 6
    assert all(type(m) is PackedLinear for layer in model.layers for m in (layer.proj, layer.inner[0], layer.inner[2]))
    assert type(model.lm_head) is nn.Linear
    for layer, want in zip(model.layers, expected):
        torch.testing.assert_close(layer.inner(layer.proj(x)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not can_pack_dtype(torch.bfloat16), reason="oneDNN has no native bfloat16 on this CPU")
def test_bfloat16_packed_linear_is_close_to_linear():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96).to(torch.bfloat16)
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(PackedLinear.of(linear)(x), linear(x), rtol=2e-2, atol=2e-2)


def test_half_precision_models_are_left_alone():
    model = _Model(torch.float16)
    assert not can_pack(model)
    assert pack_linears(model) == 0
    assert type(model.layers[0].proj) is nn.Linear


def test_a_bfloat16_model_is_told_when_this_cpu_has_no_native_bfloat16_products(monkeypatch):
    import kvtool.layers.cpu_linear as cpu_linear
    from kvtool.layers.cpu_linear import unpacked_bfloat16_note

    model = nn.Linear(8, 8).to(torch.bfloat16)
    monkeypatch.setattr(cpu_linear, "can_pack_dtype", lambda dtype: dtype == torch.float32)  # an AVX2-only CPU
    assert "rebuild the plan with --dtype float32" in unpacked_bfloat16_note(model)
    assert unpacked_bfloat16_note(nn.Linear(8, 8)) is None  # float32 packs everywhere
    monkeypatch.setattr(cpu_linear, "can_pack_dtype", lambda dtype: True)  # AVX512-BF16 or AMX
    assert unpacked_bfloat16_note(model) is None
