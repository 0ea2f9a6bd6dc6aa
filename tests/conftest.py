"""Shared fixtures: tiny Hugging Face checkpoints (random weights, saved as safetensors) and tiny plans.

    hf_checkpoint("qwen3_qk_norm")  -> HfCheckpoint(path, model)   # transformers model, eval, float32
    plan_from_checkpoint("mistral_sliding_window")  -> Path of a plan built from it (tokens_per_block 8)
    tiny_llama_plan, tiny_qwen3_plan  -> Paths of plans built from the presets (tokens_per_block 16)

Nothing is downloaded; transformers is imported only by tests that use these fixtures. Plans and
kernels built on the fly go to the session's temporary directory, never the user's cache.

Tests marked ``gpu`` (kvtool's CUDA kernels, launched through CuPy; a case of a test with
``pytest.param(..., marks=pytest.mark.gpu)``) are skipped where a CUDA GPU or CuPy is missing,
the skip saying which (``gpu_missing``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import pytest
from hf_checkpoints import TEST_TOKENS_PER_BLOCK, HfCheckpoint, make_hf_checkpoint

from kvtool.plan import BuildOptions, build_plan, load_plan


@functools.lru_cache(maxsize=None)
def gpu_missing() -> str | None:
    """What this machine lacks to run kvtool's CUDA kernels, or None when nothing is missing."""
    import torch

    if not torch.cuda.is_available():
        build = f"torch {torch.__version__} has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        return f"no CUDA device ({build})"
    if importlib.util.find_spec("cupy") is None:
        return "CuPy not installed (pip install cupy-cuda13x or cupy-cuda12x, matching torch's CUDA)"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
    missing = gpu_missing() if gpu_tests else None
    if missing is not None:
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason=missing))


@pytest.fixture(scope="session", autouse=True)
def caches_outside_home(tmp_path_factory):
    """LLM(model="preset:...") and `kvtool bench --model` build into $KVTOOL_CACHE_DIR, compiled kernels go
    to $KVTOOL_KERNEL_CACHE: both point into this session's temporary directory (subprocesses inherit it)."""
    saved = {name: os.environ.get(name) for name in ("KVTOOL_CACHE_DIR", "KVTOOL_KERNEL_CACHE")}
    os.environ["KVTOOL_CACHE_DIR"] = str(tmp_path_factory.mktemp("plan-cache"))
    os.environ["KVTOOL_KERNEL_CACHE"] = str(tmp_path_factory.mktemp("kernel-cache"))
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: HF_CASES name -> HfCheckpoint, built once per session."""
    built: dict[str, HfCheckpoint] = {}

    def make(name: str) -> HfCheckpoint:
        if name not in built:
            built[name] = make_hf_checkpoint(name, tmp_path_factory.mktemp("hf") / name)
        return built[name]

    return make


@pytest.fixture(scope="session")
def plan_from_checkpoint(hf_checkpoint, tmp_path_factory):
    """Factory: HF_CASES name -> plan directory built from that checkpoint (float32, T=8)."""
    built: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in built:
            out = tmp_path_factory.mktemp("plan") / name
            built[name] = build_plan(str(hf_checkpoint(name).path), out,
                                     BuildOptions(tokens_per_block=TEST_TOKENS_PER_BLOCK, max_seq_len=512))
        return built[name]

    return make


@pytest.fixture(scope="module")
def models(hf_checkpoint, plan_from_checkpoint):
    """Factory: HF_CASES name -> (kvtool model on the torch path, transformers model), loaded once per test
    module (a module may swap a model's CPU decoder; the next module gets its own copy)."""
    from kvtool.layers.attention import TorchPagedAttention  # noqa: PLC0415 - torch only where a test needs it

    built = {}

    def get(name: str):
        if name not in built:
            plan = load_plan(plan_from_checkpoint(name))
            built[name] = (plan.load_model("cpu", TorchPagedAttention()), hf_checkpoint(name).model)
        return built[name]

    return get


@pytest.fixture(scope="session")
def tiny_llama_plan(tmp_path_factory) -> Path:
    return build_plan("preset:tiny-llama", tmp_path_factory.mktemp("plan") / "tiny-llama",
                      BuildOptions(tokens_per_block=16, max_seq_len=1024))


@pytest.fixture(scope="session")
def tiny_qwen3_plan(tmp_path_factory) -> Path:
    return build_plan("preset:tiny-qwen3", tmp_path_factory.mktemp("plan") / "tiny-qwen3",
                      BuildOptions(tokens_per_block=16, max_seq_len=1024))
