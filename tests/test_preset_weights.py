"""Preset weights: generated on several threads, yet every tensor is exactly what one seeded
sequential generation gives (N(0, 0.02) matrices from a generator seeded with seed * 1_000_003 +
the tensor's index in the file, unit norms, zero biases), so plans built before and after agree."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from kvtool.models.model_config import torch_dtype, weight_shapes
from kvtool.models.presets import preset_config
from kvtool.plan import BuildOptions, build_plan, load_plan


def sequential_weights(preset: str, options: BuildOptions) -> dict[str, torch.Tensor]:
    dtype = torch_dtype(options.dtype)
    weights = {}
    for index, (name, shape) in enumerate(weight_shapes(preset_config(preset)).items()):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype)
        elif name.endswith(".bias"):
            weights[name] = torch.zeros(shape, dtype=dtype)
        else:
            generator = torch.Generator().manual_seed(options.seed * 1_000_003 + index)
            weights[name] = torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=generator)
    return weights


@pytest.mark.parametrize("cpus", [1, 3, 64])
@pytest.mark.parametrize(("preset", "dtype", "seed"), [("tiny-qwen3", "bfloat16", 0), ("tiny-llama", "float32", 7)])
def test_preset_weights_match_sequential_generation_whatever_the_cpu_count(tmp_path, monkeypatch, cpus, preset,
                                                                          dtype, seed):
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)  # how many tensors are generated at once
    options = BuildOptions(dtype=dtype, seed=seed)
    plan = load_plan(build_plan(f"preset:{preset}", tmp_path / "plan", options))
    on_disk = load_file(str(plan.weights_path))
    expected = sequential_weights(preset, options)
    assert set(on_disk) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(on_disk[name], tensor), name


def test_small_preset_weights_match_sequential_generation(tmp_path):
    options = BuildOptions(dtype="bfloat16", max_seq_len=512)
    on_disk = load_file(str(build_plan("preset:small-llama", tmp_path / "plan", options) / "weights.safetensors"))
    for name, tensor in sequential_weights("small-llama", options).items():
        assert torch.equal(on_disk[name], tensor), name
