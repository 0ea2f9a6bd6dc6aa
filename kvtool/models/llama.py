"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache, in one file.

Tokens of a step are flattened: every tensor is [num_tokens, ...], with no batch dimension.
Attention (and the KV cache) goes through an AttentionBackend; everything else is plain torch.
Weights use kvtool's fused layout: one qkv_proj per layer ([q; k; v] rows) and one gate_up_proj
([gate; up] rows), exactly the tensor names of a plan's weights.safetensors.

On a GPU with kvtool's kernels (``use_fused_kernels``), the forward fuses what runs between the
projections: residual add + RMSNorm, the q/k norms + RoPE + KV append, SiLU * up: about 9 launches
a layer instead of 22 (each eager launch costs host time, each graph node GPU time). The CPU path
is the plain torch one below, unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvtool.kernels.add_rms_norm import add_rms_norm
from kvtool.kernels.rope_append import rope_append
from kvtool.kernels.silu_mul import silu_mul
from kvtool.layers.attention import AttentionBackend
from kvtool.layers.attention_metadata import AttentionMetadata
from kvtool.models.model_config import ModelConfig
from kvtool.models.yarn import yarn_attention_factor, yarn_inv_freq


class Embedding(nn.Module):
    """Token embedding without random init (weights always come from a plan; nn.Embedding's
    normal_ init on the meta device would import torch._dynamo, seconds of start-up)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One op (a fused kernel on CUDA) instead of eight: every eager op costs host time on each
        # layer of each step. It normalises in float32 and scales by the weight before rounding to
        # the model dtype; identical to the reference implementations in float32.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with llama3, linear or yarn scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "yarn":
        return yarn_inv_freq(dim, config.rope_theta, scaling)
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    # llama3: leave high frequencies alone, divide low ones by `factor`, blend in between.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_attention_factor(config: ModelConfig) -> float:
    """What the cos and sin tables are multiplied by (yarn scales the rotated q and k; else 1)."""
    scaling = config.rope_scaling
    return yarn_attention_factor(scaling) if scaling is not None and scaling["rope_type"] == "yarn" else 1.0


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed_sin [num_tokens, 1, head_dim] for the rotate-half RoPE layout, once per step,
    times ``scale`` (rope_attention_factor).

    signed_sin is sin with its first half negated: rotate_half(x) * sin == roll(x, half) * signed_sin.
    """
    freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)  # [num_tokens, head_dim // 2]
    sin = freqs.sin()
    cos = freqs.cos()
    if scale != 1.0:
        sin, cos = sin * scale, cos * scale
    return torch.cat((cos, cos), dim=-1).unsqueeze(1).to(dtype), torch.cat((-sin, sin), dim=-1).unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim] rotated by position: x*cos + rotate_half(x)*sin, in three
    ops (rotate_half(x) = [-x2, x1] = roll(x, half) with the sign moved into signed_sin)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_output_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.backend = backend
        self.sliding_window = sliding_window
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.backend.forward(q, k, v, kv_cache, meta, scale=self.scale, sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, kernels) -> torch.Tensor:
        """forward with the prologue in one kernel (q/k norms, RoPE, KV append) on CudaPagedAttention."""
        num_tokens = x.shape[0]
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        query = rope_append(kernels, self.qkv_proj(x), cos, sin, None if self.q_norm is None else self.q_norm.weight,
                            None if self.k_norm is None else self.k_norm.weight, eps, kv_cache, meta.slot_mapping,
                            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)
        out = self.backend.attend(query, kv_cache, meta, scale=self.scale, sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor, kernels) -> torch.Tensor:
        return self.down_proj(silu_mul(kernels, self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, sliding_window: int | None) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config, backend, sliding_window)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, *, residual: torch.Tensor | None = None,
                kernels=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With ``kernels`` (the fused CUDA path): ``forward_fused``, entered here so that the module's
        hooks run as for any layer call (ModelRunner's per-layer copy waits are forward pre-hooks)."""
        if kernels is not None:
            return self.forward_fused(x, residual, cos, sin, kv_cache, meta, kernels)
        x = x + self.attention(self.input_norm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_norm(x))

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                      kv_cache: torch.Tensor, meta: AttentionMetadata, kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual layout: ``x`` is the previous sublayer's output, ``residual`` the stream
        before it (None at the first layer, where x is the embedding). Returns (the MLP's output, the
        stream before it); the caller adds them (in the next layer's or the final norm)."""
        if residual is None:
            residual, x = x, self.input_norm(x)
        else:
            add_rms_norm(kernels, x, residual, self.input_norm.weight, self.input_norm.eps)  # in place
        x = self.attention.forward_fused(x, cos, sin, kv_cache, meta, kernels)
        add_rms_norm(kernels, x, residual, self.post_attention_norm.weight, self.post_attention_norm.eps)
        return self.mlp.forward_fused(x, kernels), residual


def effective_window(config_window: int | None, attention_window: int | None) -> int | None:
    """The smaller of the model's sliding window and the runtime's max_attention_window, where set."""
    windows = [w for w in (config_window, attention_window) if w is not None]
    return min(windows) if windows else None


class LlamaModel(nn.Module):
    """The decoder stack plus LM head. ``forward`` returns hidden states; ``compute_logits``
    projects the rows the caller needs (usually each sequence's last token).

    The weights are not initialised here: load them with ``Plan.load_model`` (or
    ``load_state_dict`` of a plan's weights.safetensors, whose names are this module's).
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend, attention_window: int | None = None) -> None:
        super().__init__()
        if attention_window is not None and attention_window <= 0:
            raise ValueError(f"attention_window must be positive or None, got {attention_window}")
        self.config = config
        self.sliding_window = effective_window(config.sliding_window, attention_window)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, self.sliding_window)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)
        # Not a weight: recomputed from the config, and on CPU even when built on the meta device.
        self.register_buffer("rope_inv_freq", rope_inv_freq(config), persistent=False)
        # On the CPU, kvtool.cpu_kernels.decoder.CpuDecoder runs forward through fused kernels
        # (set by kvtool.cpu_kernels.decoder.enable); None: the torch path below.
        self.cpu_decoder = None
        self.rope_attention_factor = rope_attention_factor(config)
        self.fused_kernels = None  # a kvtool.kernels KernelLibrary once use_fused_kernels is called

    def use_fused_kernels(self, library) -> None:
        """Runs the forward with kvtool's fused CUDA kernels (``library``: a KernelLibrary); every layer's
        attention backend must be a CudaPagedAttention whose kernels take the KV cache (the caller
        checks: kvtool.runtime.model_runner does, on a GPU)."""
        self.fused_kernels = library

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids [num_tokens] int64 -> hidden [num_tokens, hidden_size]; writes each layer's KV
        into kv_caches[layer] ([num_blocks, 2, tokens_per_block, num_kv_heads, head_dim])."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"LlamaModel.forward got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        if self.cpu_decoder is not None:
            return self.cpu_decoder.forward(input_ids, meta, kv_caches)
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.rope_inv_freq, meta.positions, x.dtype, self.rope_attention_factor)
        if self.fused_kernels is not None:
            return self._forward_fused(x, cos, sin, meta, kv_caches)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    def _forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list[torch.Tensor]) -> torch.Tensor:
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            # Through layer(...), not layer.forward_fused: a layer whose KV copies land during the step
            # must wait for them first (ModelRunner's forward pre-hooks), as on the unfused path.
            x, residual = layer(x, cos, sin, kv_cache, meta, residual=residual, kernels=self.fused_kernels)
        add_rms_norm(self.fused_kernels, x, residual, self.norm.weight, self.norm.eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32."""
        if self.cpu_decoder is not None:
            return self.cpu_decoder.compute_logits(hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
