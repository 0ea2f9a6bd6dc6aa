"""PackedLinear computes what nn.Linear computes, on either side of its row threshold."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvtool.layers.cpu_linear import MAX_PACKED_ROWS, PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("num_rows", [1, 7, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1, 600])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear(num_rows, bias):
    torch.manual_seed(num_rows)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(num_rows, 48)
    expected = linear(x)
    out = PackedLinear(linear)(x)
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


def test_half_precision_models_are_left_alone():
    model = _Model(torch.bfloat16)
    assert not can_pack(model)
    assert pack_linears(model) == 0
    assert type(model.layers[0].proj) is nn.Linear
