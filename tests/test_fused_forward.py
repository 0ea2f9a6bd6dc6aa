"""The model's fused CUDA forward (kvtool/models/llama.py, ``use_fused_kernels``) wires its kernels as
the eager layers compute: checked on the CPU with each kernel replaced by the torch ops its contract
names (tests/test_kernels_fused.py checks the kernels themselves against the same ops on a GPU).

What this catches without a GPU: the residual stream's layout (vLLM's: the first layer's residual is
the embedding, each add_rms_norm updates it in place, the final norm adds the last MLP output), the
order of q/k norm, RoPE and the KV append, and that every fused layer still runs through
``layer(...)``: a step whose KV copies land layer by layer makes each layer wait for its own with a
forward pre-hook (kvtool.runtime.model_runner), which a direct ``forward_fused`` call would skip.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hf_checkpoints import TEST_TOKENS_PER_BLOCK as T
from paged_driver import PagedDriver

from kvtool.layers.attention import TorchPagedAttention, write_kv_cache
from kvtool.models import llama
from kvtool.plan import load_plan


def add_rms_norm(library, x, residual, weight, eps):
    """csrc/kernels/add_rms_norm.cu's contract, in place: residual = x + residual; x = rms_norm(residual)."""
    residual.copy_(x + residual)
    x.copy_(F.rms_norm(residual, (x.shape[-1],), weight, eps))


def rope_append(library, qkv, cos, signed_sin, q_norm_weight, k_norm_weight, eps, kv_cache, slot_mapping, *,
                num_heads, num_kv_heads):
    """csrc/kernels/rope_append.cu's contract: per-head q/k norms, RoPE, k and v stored at their slots
    (none for a negative slot); returns the rotated queries."""
    head_dim = kv_cache.shape[-1]
    q, k, v = qkv.view(qkv.shape[0], -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    if q_norm_weight is not None:
        q, k = F.rms_norm(q, (head_dim,), q_norm_weight, eps), F.rms_norm(k, (head_dim,), k_norm_weight, eps)
    q, k = llama.apply_rope(q, cos, signed_sin), llama.apply_rope(k, cos, signed_sin)
    stored = slot_mapping >= 0
    write_kv_cache(k[stored], v[stored], kv_cache, slot_mapping[stored], kv_cache.shape[2])
    return q.contiguous()


def silu_mul(library, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class CacheReadingAttention(TorchPagedAttention):
    """CudaPagedAttention.attend's contract: attention over a cache that already holds the step's KV."""

    def attend(self, query, kv_cache, meta, *, scale, sliding_window):
        slots = meta.slot_mapping
        blocks, offsets = slots // meta.tokens_per_block, slots % meta.tokens_per_block
        key, value = kv_cache[blocks, 0, offsets], kv_cache[blocks, 1, offsets]
        return self.forward(query, key, value, kv_cache, meta, scale=scale, sliding_window=sliding_window)


@pytest.fixture
def load(plan_from_checkpoint, monkeypatch):
    """name, fused -> the checkpoint's model on the CPU, with the fused forward (its kernels replaced by
    their torch contracts) or the eager one."""
    for name, reference in (("add_rms_norm", add_rms_norm), ("rope_append", rope_append), ("silu_mul", silu_mul)):
        monkeypatch.setattr(llama, name, reference)

    def make(name: str, fused: bool):
        model = load_plan(plan_from_checkpoint(name)).load_model("cpu", CacheReadingAttention())
        if fused:
            model.use_fused_kernels(object())  # a KernelLibrary on a GPU; the references ignore it
        return model

    return make


def run_steps(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of: the first prompt in one step, the second in two chunks beside the first's decode
    tokens (mixed steps), then both decoding."""
    driver = PagedDriver(model, tokens_per_block=T, num_blocks=32)
    first, second = (driver.add_sequence(p) for p in prompts)
    logits = driver.step(context=[(first, len(prompts[0]))])
    first.append(int(logits[0][-1].argmax()))
    half = len(prompts[1]) // 2
    logits += driver.step(context=[(second, half)], decode=[first])
    first.append(int(logits[-1][-1].argmax()))
    logits += driver.step(context=[(second, len(prompts[1]) - half)], decode=[first])
    second.append(int(logits[-2][-1].argmax()))
    first.append(int(logits[-1][-1].argmax()))
    logits += driver.step(decode=[first, second])
    return logits


@pytest.mark.parametrize("name", ["qwen3_qk_norm", "qwen2_qkv_bias_tied", "mistral_sliding_window"])
def test_fused_forward_gives_the_logits_of_the_eager_layers(load, name):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (37, 29)]
    fused, eager = run_steps(load(name, fused=True), prompts), run_steps(load(name, fused=False), prompts)
    assert len(fused) == len(eager) == 7
    for got, expected in zip(fused, eager):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_each_fused_layer_runs_its_hooks_before_and_after_it(load):
    # ModelRunner makes layer i wait for its own KV copies with a forward pre-hook on layer i.
    model = load("qwen3_qk_norm", fused=True)
    events = []
    handles = [hook for index, layer in enumerate(model.layers) for hook in (
        layer.register_forward_pre_hook(lambda *_, index=index: events.append(("wait", index))),
        layer.register_forward_hook(lambda *_, index=index: events.append(("ran", index))))]
    run_steps(model, [[5, 6, 7, 8, 9], [10, 11, 12]])
    for handle in handles:
        handle.remove()
    one_step = [event for index in range(len(model.layers)) for event in (("wait", index), ("ran", index))]
    assert events == one_step * 4
