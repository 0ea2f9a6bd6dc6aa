"""LlamaModel's forward on the CPU through kvtool's kernels (the model calls it when one is set).

Per layer: the input norm fused with the residual add, the qkv projection, RoPE and the KV append
in one kernel, paged attention reading the cache in place (no gather), the o projection, the
post-attention norm fused with its residual add, the gate_up projection, SiLU-and-mul in one
kernel, the down projection. The projections are torch's oneDNN products on weights packed once
(kvtool.layers.cpu_linear). The step's attention tasks are planned once and serve every layer;
activations reuse one workspace, grown when a step has more tokens than any before.

Computes what the torch path computes (the same float32 or bfloat16 roundings up to the order of
a few sums), and tests/test_cpu_decoder.py holds it to transformers' logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtool.cpu_kernels import ops
from kvtool.cpu_kernels._kernels import CpuKernels, supported_isas
from kvtool.layers.attention_metadata import AttentionMetadata
from kvtool.layers.cpu_linear import PackedLinear, can_pack_dtype, packed_row_limit


def unsupported_reason(model) -> str | None:
    """Why the kernels cannot run this model (None: they can)."""
    weight = model.embed_tokens.weight
    if weight.device.type != "cpu":
        return f"the model is on {weight.device}"
    if weight.dtype not in ops.DTYPES:
        return f"the kernels take float32 or bfloat16 weights, not {weight.dtype}"
    if model.config.head_dim % 2:
        return f"head_dim {model.config.head_dim} is odd (RoPE rotates halves)"
    return None


class _Workspace:
    """Activation buffers for steps of up to ``capacity`` tokens; a step takes views of their first rows."""

    def __init__(self, capacity: int, hidden: int, attention: int, intermediate: int, dtype: torch.dtype) -> None:
        self.capacity = capacity
        self.normed = torch.empty(capacity, hidden, dtype=dtype)
        self.attention = torch.empty(capacity, attention, dtype=dtype)
        self.activation = torch.empty(capacity, intermediate, dtype=dtype)


class CpuDecoder:
    """Runs ``model``'s decoder stack through the CPU kernels (``isa``: 'auto' or one of
    kvtool.cpu_kernels.supported_isas(); ``num_threads``: the kernels' threads, torch's by default)."""

    def __init__(self, model, *, isa: str = "auto", num_threads: int | None = None) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the CPU kernels cannot run this model: {reason}")
        if isa != "auto" and isa not in supported_isas():
            raise ValueError(f"isa {isa!r} does not run on this CPU; it runs {supported_isas()}")
        self.model = model
        self.kernels = CpuKernels(isa, num_threads or torch.get_num_threads())
        config = model.config
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = config.q_size
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.dtype = model.embed_tokens.weight.dtype
        self._cos_sin = ops.rope_cache(model.rope_inv_freq, 0)
        self._workspace: _Workspace | None = None
        # The logits' weight (the embedding table when tied), packed as the projections are: one
        # decode row through MKL took 7 ms on SmolLM2's 113 MB head, through oneDNN 3 (one core).
        head = self.lm_head_weight()
        self.lm_head = PackedLinear(head, None, packed_row_limit(head.dtype)) if can_pack_dtype(head.dtype) else None

    @property
    def isa(self) -> str:
        return self.kernels.isa

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids [num_tokens] -> hidden [num_tokens, hidden_size] (a view of a workspace buffer,
        valid until the next forward); writes each layer's KV into kv_caches[layer]."""
        model, kernels = self.model, self.kernels
        num_tokens = input_ids.shape[0]
        work = self._workspace_for(num_tokens)
        normed = work.normed[:num_tokens]
        attended = work.attention[:num_tokens]
        activation = work.activation[:num_tokens]
        cos_sin = self._rope_table(meta.max_seq_len)
        plan = ops.plan_attention(kernels, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                  num_blocks=kv_caches[0].shape[0], num_heads=self.num_heads,
                                  num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                  tokens_per_block=meta.tokens_per_block, sliding_window=model.sliding_window)
        residual = F.embedding(input_ids, model.embed_tokens.weight)  # the residual stream, updated in place
        x = None  # the last sublayer's output, not yet added to the residual
        for layer, kv_cache in zip(model.layers, kv_caches):
            attention, mlp = layer.attention, layer.mlp
            ops.rms_norm(kernels, residual if x is None else x, layer.input_norm.weight, self.eps, normed,
                         None if x is None else residual)
            qkv = attention.qkv_proj(normed)
            ops.rope_store_kv(kernels, qkv, self.num_heads, self.num_kv_heads, self.head_dim, meta.positions,
                              cos_sin, kv_cache, meta.slot_mapping,
                              None if attention.q_norm is None else attention.q_norm.weight,
                              None if attention.k_norm is None else attention.k_norm.weight, self.eps)
            query = qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            ops.attention(kernels, plan, query, kv_cache, attended.view(num_tokens, self.num_heads, self.head_dim),
                          self.scale)
            x = attention.o_proj(attended)
            ops.rms_norm(kernels, x, layer.post_attention_norm.weight, self.eps, normed, residual)
            ops.silu_mul(kernels, mlp.gate_up_proj(normed), activation)
            x = mlp.down_proj(activation)
        ops.rms_norm(kernels, residual if x is None else x, model.norm.weight, self.eps, normed,
                     None if x is None else residual)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32."""
        if self.lm_head is None:
            return F.linear(hidden, self.lm_head_weight()).float()
        return self.lm_head(hidden).float()

    def lm_head_weight(self) -> torch.Tensor:
        model = self.model
        return model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight

    def _workspace_for(self, num_tokens: int) -> _Workspace:
        work = self._workspace
        if work is None or work.capacity < num_tokens:
            config = self.model.config
            capacity = max(num_tokens, 2 * work.capacity if work is not None else 1)
            work = self._workspace = _Workspace(capacity, config.hidden_size, self.q_size, config.intermediate_size,
                                                self.dtype)
        return work

    def _rope_table(self, max_seq_len: int) -> torch.Tensor:
        if self._cos_sin.shape[0] < max_seq_len:
            # Grown by doubling: a long model's full table can be tens of MB.
            size = max(max_seq_len, 2 * self._cos_sin.shape[0], 1024)
            self._cos_sin = ops.rope_cache(self.model.rope_inv_freq, size)
        return self._cos_sin


def enable(model, *, isa: str = "auto", num_threads: int | None = None) -> str | None:
    """Makes ``model`` (a LlamaModel) run its forward through the CPU kernels where they apply;
    returns the instruction set they use, or None (the model keeps its torch path)."""
    if unsupported_reason(model) is not None:
        return None
    model.cpu_decoder = CpuDecoder(model, isa=isa, num_threads=num_threads)
    return model.cpu_decoder.isa
