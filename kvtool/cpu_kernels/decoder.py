"""LlamaModel's forward on the CPU through kvtool's kernels (the model calls it when one is set).

Per layer: the input norm fused with the residual add, the qkv projection, RoPE and the KV append
in one kernel, paged attention reading the cache in place (no gather), the o projection, the
post-attention norm fused with its residual add, the gate_up projection, SiLU-and-mul in one
kernel, the down projection. The projections are torch's oneDNN products on weights packed once
(kvtool.layers.cpu_linear), except a bfloat16 prompt's where the kernels have AMX tiles
(kvtool.cpu_kernels.tile_products: gate_up's product then ends in SiLU-and-mul, the separate kernel
skipped) and those of up to eight rows (decode steps at batch 1 to 8, and their logits): kvtool's row
product streams each weight row once, and on the family 25 model 17 EPYC a step's products took
0.58-0.73 of oneDNN's time at one and two rows, 0.65-0.79 at four; at eight its blocked form (each
weight vector loaded once for every row) put whole decode steps of eight sequences at 0.6-0.7 of the
time they took on oneDNN (bench/cpu_linear_rows.py, results/cpu_decode_rows.md). The step's attention
tasks are planned once and serve every layer; activations reuse one workspace, grown when a step has
more tokens than any before.

Where oneDNN has no native product for the weights' dtype (bfloat16 on a CPU without AVX512-BF16 or
AMX, an AVX2-only one), torch emulates bfloat16 products, and the row product, which reads bfloat16
weights as they are, takes every product instead: a SmolLM2-135M layer's four at 2 to 128 rows in
0.39-0.51 of the emulated products' time (AVX2 code on the AMD EPYC VM, ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2).

A step of up to MAX_ROW_PRODUCT_ROWS rows (a decode step at batch 1 to 8; MAX_UNPACKED_STACK_ROWS
where the row product takes every product) runs every layer in one
C++ call (the kernels' DecoderStack, on the weights' addresses registered once): called one by one
from Python, its some 300 kernel calls left the interpreter running between them. The engine's decode
steps go further (``decode``): from the tokens, positions and block tables to the logits, the
embedding, the slots, the attention plan and the LM head included, in that one call. Larger steps keep
the Python loop, which calls the kernels with the weights' addresses read once and the workspace's
known strides, and the projections' oneDNN op directly: the checking wrappers of
kvtool.cpu_kernels.ops and nn.Module's call machinery cost about a millisecond a step. Make a new
decoder after changing the model's weights.

Computes what the torch path computes (the same float32 or bfloat16 roundings up to the order of
a few sums), and tests/test_cpu_decoder.py holds it to transformers' logits.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from kvtool.cpu_kernels import ops
from kvtool.cpu_kernels._kernels import CpuKernels, DecoderLayerWeights, DecoderStack, supported_isas
from kvtool.cpu_kernels.step_buffers import StepBuffers
from kvtool.cpu_kernels.tile_products import tile_product, tile_weight
from kvtool.layers.attention_metadata import AttentionMetadata
from kvtool.layers.cpu_linear import PackedLinear, can_pack_dtype, packed_row_limit
from kvtool.layers.sampler import StepPicks

Projection = Callable[[torch.Tensor], torch.Tensor]
MAX_ROW_PRODUCT_ROWS = 8  # products of more rows run oneDNN's (see the module docstring)
MAX_UNPACKED_STACK_ROWS = 32  # the stack's rows where the row product takes every product (decode batches)


def row_product_rows(dtype: torch.dtype) -> int | None:
    """The most rows a product of ``dtype`` weights takes kvtool's row product for (more: oneDNN's);
    None: every product (oneDNN has no native one for the dtype here)."""
    return MAX_ROW_PRODUCT_ROWS if can_pack_dtype(dtype) else None


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


def projection(module: torch.nn.Module, kernels: CpuKernels | None, *, own_output: bool = True,
               max_rows: int | None = MAX_ROW_PRODUCT_ROWS, many: Projection | None = None) -> Projection:
    """The module's product without nn.Module's call machinery: up to ``max_rows`` rows (None: any) through
    ``kernels``' row product (up to MAX_ROW_PRODUCT_ROWS rows into a buffer of the projection's own, valid
    until its next call; a new tensor each call with ``own_output=False``, for results a caller keeps,
    as logits, and for more rows), more
    (every row count when ``kernels`` is None) through ``many`` where given (a tile product), else the packed
    oneDNN op itself where every row count takes it."""
    if many is None and isinstance(module, PackedLinear) and module.max_packed_rows is None:
        # Packed anew where the tile products' decoder dropped the module's copy (enable): a decoder
        # without them, as a benchmark compares, runs oneDNN's product as before.
        packed = module.packed_weight if module.packed_weight is not None else \
            torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
        op, bias = torch.ops.mkldnn._linear_pointwise, module.bias
        many = lambda x: op(x, packed, bias, "none", [], "")  # noqa: E731
    elif many is None:
        many = module.forward
    weight, bias = module.weight, module.bias
    if (kernels is None or weight.dtype not in ops.DTYPES or weight.stride(1) != 1
            or (bias is not None and not bias.is_contiguous())):
        return many
    out_features, in_features = weight.shape
    buffered = MAX_ROW_PRODUCT_ROWS if max_rows is None else min(max_rows, MAX_ROW_PRODUCT_ROWS)
    out = torch.empty(buffered, out_features, dtype=weight.dtype)  # [rows, out_features]
    outputs = [out[:rows] for rows in range(buffered + 1)]
    weight_ptr, weight_stride, bias_ptr = weight.data_ptr(), weight.stride(0), _address(bias)
    dtype = ops.DTYPES[weight.dtype]

    def product(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if (max_rows is not None and rows > max_rows) or rows == 0 or x.stride(-1) != 1:
            return many(x)
        result = outputs[rows] if own_output and rows <= buffered else \
            torch.empty(rows, out_features, dtype=weight.dtype)
        kernels.linear(x.data_ptr(), weight_ptr, bias_ptr, result.data_ptr(), rows, in_features, out_features,
                       x.stride(0), weight_stride, out_features, dtype)
        return result

    return product


class _Layer(NamedTuple):
    """One decoder layer as the hot loop uses it: norm weights' addresses (0: none) and products."""

    input_norm: int
    post_attention_norm: int
    q_norm: int
    k_norm: int
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    silu_gate_up: Projection | None  # SiLU(gate) * up in one tile product, for more than row-product rows


class _CacheLayout(NamedTuple):
    """The layers' KV caches as the kernels read them: each layer's address, the strides (elements) of a
    block, of keys to values, of a token and of a head, and the pool's blocks, tokens a block and dtype."""

    key: tuple
    addresses: np.ndarray  # int64 [num_layers]
    strides: tuple[int, int, int, int]
    num_blocks: int
    tokens_per_block: int
    dtype: object  # kvtool.cpu_kernels DType


def _address(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def _stack_projection(module: torch.nn.Module, dtype: torch.dtype) -> tuple[int, int] | None:
    """A projection's weight and bias addresses for the DecoderStack; None when it cannot take them
    (rows not contiguous, another type than the activations')."""
    weight, bias = module.weight, module.bias
    if weight.dtype != dtype or not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        return None
    return weight.data_ptr(), _address(bias)


def decoder_stack(model, max_rows: int) -> DecoderStack | None:
    """``model``'s layers, embedding and LM head registered with the kernels' DecoderStack (steps of up to
    max_rows rows in one call); None when a projection's weight is not laid out as the row product reads it."""
    config, dtype, layers = model.config, model.embed_tokens.weight.dtype, []
    embedding = model.embed_tokens.weight
    head = embedding if model.lm_head is None else model.lm_head.weight
    if any(w.dtype != dtype or not w.is_contiguous() for w in (embedding, head)):
        return None
    for layer in model.layers:
        attention, mlp = layer.attention, layer.mlp
        projections = [_stack_projection(m, dtype) for m in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj,
                                                             mlp.down_proj)]
        if any(p is None for p in projections):
            return None
        norms = [_address(None if norm is None else norm.weight)
                 for norm in (layer.input_norm, layer.post_attention_norm, attention.q_norm, attention.k_norm)]
        layers.append(DecoderLayerWeights(*norms, *(address for p in projections for address in p)))
    return DecoderStack(layers, model.norm.weight.data_ptr(), embedding.data_ptr(), head.data_ptr(), head.shape[0],
                        config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
                        config.head_dim, config.rms_norm_eps, config.head_dim ** -0.5, ops.DTYPES[dtype], max_rows)


class CpuDecoder:
    """Runs ``model``'s decoder stack through the CPU kernels (``isa``: 'auto' or one of
    kvtool.cpu_kernels.supported_isas(); ``num_threads``: the kernels' threads, torch's by default;
    ``row_products``: projections of up to ``row_product_rows`` rows through the kernels' row product,
    else oneDNN's, for comparing the two; ``tile_products``: bfloat16 projections of more rows on AMX
    tiles where the kernels have them (kvtool.cpu_kernels.tile_products), else oneDNN's)."""

    def __init__(self, model, *, isa: str = "auto", num_threads: int | None = None, row_products: bool = True,
                 tile_products: bool = True) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the CPU kernels cannot run this model: {reason}")
        if isa != "auto" and isa not in supported_isas():
            raise ValueError(f"isa {isa!r} does not run on this CPU; it runs {supported_isas()}")
        self.model = model
        self.kernels = CpuKernels(isa, num_threads or torch.get_num_threads())
        rows = self.kernels if row_products else None
        config = model.config
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.hidden_size, self.q_size, self.intermediate_size = config.hidden_size, config.q_size, \
            config.intermediate_size
        self.qkv_size = config.q_size + 2 * config.kv_size
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.dtype = model.embed_tokens.weight.dtype
        self.kernel_dtype = ops.DTYPES[self.dtype]
        self.max_row_product_rows = row_product_rows(self.dtype)  # each projection's (None: every row count)
        tiles = tile_products and self.kernels.has_tile_products and self.max_row_product_rows is not None
        # The projections whose products of more rows than the row product's run on tiles.
        self.tile_modules: list[torch.nn.Module] = []
        # The step's activations (the tile products' outputs among them; with tiles a prompt's gated gate_up
        # writes the activation silu_mul writes without them).
        self._buffers = outputs = StepBuffers(self.dtype)

        def layer_projection(module: torch.nn.Module, output: str) -> Projection:
            weight = tile_weight(module) if tiles else None
            if weight is not None:
                self.tile_modules.append(module)
            return projection(module, rows, max_rows=self.max_row_product_rows,
                              many=None if weight is None else tile_product(self.kernels, weight, outputs, output))

        def silu_gate_up(module: torch.nn.Module) -> Projection | None:
            weight = tile_weight(module, gated=True) if tiles else None
            if weight is None:
                return None
            self.tile_modules.append(module)
            return tile_product(self.kernels, weight, outputs, "activation")

        # o's and down's products share a buffer: o's is added to the residual before down's is written.
        self.layers = [_Layer(layer.input_norm.weight.data_ptr(), layer.post_attention_norm.weight.data_ptr(),
                              _address(None if layer.attention.q_norm is None else layer.attention.q_norm.weight),
                              _address(None if layer.attention.k_norm is None else layer.attention.k_norm.weight),
                              layer_projection(layer.attention.qkv_proj, "qkv"),
                              layer_projection(layer.attention.o_proj, "hidden"),
                              projection(layer.mlp.gate_up_proj, rows, max_rows=self.max_row_product_rows),
                              layer_projection(layer.mlp.down_proj, "hidden"),
                              silu_gate_up(layer.mlp.gate_up_proj))
                       for layer in model.layers]
        self.final_norm = model.norm.weight.data_ptr()
        stack_rows = MAX_ROW_PRODUCT_ROWS if self.max_row_product_rows is not None else MAX_UNPACKED_STACK_ROWS
        self.stack = decoder_stack(model, stack_rows) if row_products else None
        # A RoPE scaling that scales cos and sin too (yarn's attention factor), where the model has one.
        self.rope_scale = float(getattr(model, "rope_attention_factor", 1.0))
        self._cos_sin = ops.rope_cache(model.rope_inv_freq, 0, self.rope_scale)
        self._cache_layout_of: _CacheLayout | None = None  # _cache_layout's last
        # The logits' weight (the embedding table when tied), packed as the projections are: one
        # decode row through MKL took 7 ms on SmolLM2's 113 MB head, through oneDNN 3 (one core).
        head = self.lm_head_weight()
        head_module = PackedLinear(head, None, packed_row_limit(head.dtype)) if can_pack_dtype(head.dtype) \
            else SimpleNamespace(weight=head, bias=None, forward=lambda x: F.linear(x, head))
        self.lm_head = projection(head_module, rows, own_output=False, max_rows=self.max_row_product_rows)

    @property
    def isa(self) -> str:
        return self.kernels.isa

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids [num_tokens] -> hidden [num_tokens, hidden_size] (a view of a workspace buffer,
        valid until the next forward); writes each layer's KV into kv_caches[layer]."""
        kernels, dtype, eps = self.kernels, self.kernel_dtype, self.eps
        hidden, heads, kv_heads, head_dim = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        n = input_ids.shape[0]
        positions, slots = meta.positions, meta.slot_mapping
        for name, tensor in (("positions", positions), ("slot_mapping", slots)):
            if tensor.dtype != torch.int64 or not tensor.is_contiguous() or tensor.shape[0] != n:
                raise ValueError(f"AttentionMetadata.{name} must be int64 [{n}], got {tensor.dtype} "
                                 f"{tuple(tensor.shape)}")
        caches = self._cache_layout(kv_caches)
        cache_dtype, tokens_per_block = caches.dtype, caches.tokens_per_block
        block_stride, kv_stride, token_stride, head_stride = caches.strides
        buffers = self._buffers
        normed, attended = buffers.rows("normed", n, hidden), buffers.rows("attention", n, self.q_size)
        activation = buffers.rows("activation", n, self.intermediate_size)
        normed_ptr, attended_ptr, activation_ptr = normed.data_ptr(), attended.data_ptr(), activation.data_ptr()
        cos_sin = self._rope_table(meta.max_seq_len)
        plan = ops.plan_attention(kernels, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                  num_blocks=caches.num_blocks, num_heads=heads, num_kv_heads=kv_heads,
                                  head_dim=head_dim, tokens_per_block=tokens_per_block,
                                  sliding_window=self.model.sliding_window, dtype=self.dtype)
        residual = F.embedding(input_ids, self.model.embed_tokens.weight)  # the residual stream, updated in place
        residual_ptr = residual.data_ptr()
        if self.stack is not None and n <= self.stack.max_rows:
            self.stack.forward(kernels, plan, residual_ptr, normed_ptr, n, positions.data_ptr(), slots.data_ptr(),
                               cos_sin.data_ptr(), cos_sin.shape[0], caches.addresses, block_stride, kv_stride,
                               token_stride, head_stride, tokens_per_block, cache_dtype)
            return normed
        x_ptr = 0  # the last sublayer's output (contiguous [n, hidden]), not yet added to the residual
        for layer, kv_cache in zip(self.layers, kv_caches):
            cache_ptr = kv_cache.data_ptr()
            # normed = norm(x + residual), residual += x (the first layer: norm(residual)).
            kernels.rms_norm(x_ptr or residual_ptr, residual_ptr if x_ptr else 0, layer.input_norm, normed_ptr, n,
                             hidden, hidden, hidden, hidden, eps, dtype)
            qkv = layer.qkv(normed)
            kernels.rope_store_kv(qkv.data_ptr(), n, self.qkv_size, heads, kv_heads, head_dim, positions.data_ptr(),
                                  cos_sin.data_ptr(), cos_sin.shape[0], layer.q_norm, layer.k_norm, eps, cache_ptr,
                                  block_stride, kv_stride, token_stride, head_stride, slots.data_ptr(),
                                  tokens_per_block, dtype, cache_dtype)
            kernels.attention(plan, qkv.data_ptr(), self.qkv_size, attended_ptr, self.q_size, cache_ptr, block_stride,
                              kv_stride, token_stride, head_stride, self.scale, dtype, cache_dtype)
            x = layer.o(attended)
            kernels.rms_norm(x.data_ptr(), residual_ptr, layer.post_attention_norm, normed_ptr, n, hidden, hidden,
                             hidden, hidden, eps, dtype)
            if layer.silu_gate_up is not None and n > self.max_row_product_rows:
                x = layer.down(layer.silu_gate_up(normed))
            else:
                gate_up = layer.gate_up(normed)
                kernels.silu_mul(gate_up.data_ptr(), activation_ptr, n, self.intermediate_size,
                                 2 * self.intermediate_size, self.intermediate_size, dtype)
                x = layer.down(activation)
            x_ptr = x.data_ptr()
        kernels.rms_norm(x_ptr or residual_ptr, residual_ptr if x_ptr else 0, self.final_norm, normed_ptr, n, hidden,
                         hidden, hidden, hidden, eps, dtype)
        return normed

    def decodes(self, num_rows: int) -> bool:
        """Whether ``decode`` takes a step of ``num_rows`` one-token rows."""
        return self.stack is not None and num_rows <= self.stack.max_rows

    def decode(self, input_ids: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
               kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """A step of one new token per row (``decodes`` it) in one call of the stack, from the host arrays
        the engine flattens: input_ids and positions int64 [n], block_tables int32 [n, max_blocks] (-1
        where no block). Returns logits [n, vocab_size] float32; writes each layer's KV. What forward and
        compute_logits compute for the step, bit for bit (tests/test_cpu_decoder_stack.py)."""
        logits = torch.empty(len(input_ids), self.stack.vocab_size)  # [n, vocab_size]
        self._decode(input_ids, positions, block_tables, kv_caches, logits=logits.numpy())
        return logits

    def decode_picks(self, input_ids: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
                     kv_caches: list[torch.Tensor], picks: StepPicks | None = None) -> np.ndarray:
        """``decode``'s step, each row's token instead of its logits: int64 [n]. A row of temperature 0 (or
        all, picks None) its greedy pick, what NumPy's argmax of decode's logits picks (the first largest;
        a NaN the largest); any other a draw from softmax(logits / temperature) cut to its top_k and
        top_p, by inverse transform of its uniform number: what kvtool.layers.sampler.sample draws from
        decode's logits with that number (but for rounding at the edge of two tokens, and ties at the
        top-k's edge, all kept here). Picked in the step, by the threads that computed the logits: after
        the step NumPy's argmax found them cold (~0.1 ms of a ~7 ms bfloat16 SmolLM2-135M step), the
        sampler ~0.5 ms at a temperature and ~1.7 with top_p 0.9."""
        token_ids = np.empty(len(input_ids), dtype=np.int64)
        self._decode(input_ids, positions, block_tables, kv_caches, picked_token_ids=token_ids, picks=picks)
        return token_ids

    def _decode(self, input_ids: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
                kv_caches: list[torch.Tensor], *, logits: np.ndarray | None = None,
                picked_token_ids: np.ndarray | None = None, picks: StepPicks | None = None) -> None:
        caches = self._cache_layout(kv_caches)
        cos_sin = self._rope_table(int(positions.max()) + 1)
        self.stack.decode(self.kernels, input_ids, positions, block_tables, caches.num_blocks, cos_sin.data_ptr(),
                          cos_sin.shape[0], caches.addresses, *caches.strides, caches.tokens_per_block, caches.dtype,
                          self.model.sliding_window or 0, logits, picked_token_ids, *(picks or (None,) * 4))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32."""
        return self.lm_head(hidden).float()

    def lm_head_weight(self) -> torch.Tensor:
        model = self.model
        return model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight

    def _cache_layout(self, kv_caches: list[torch.Tensor]) -> _CacheLayout:
        """The caches as the kernels read them, checked and read again only for another list of caches (or
        one whose ends moved): reading 30 addresses took ~20 us of a decode step."""
        key = (len(kv_caches), kv_caches[0].data_ptr(), kv_caches[-1].data_ptr())
        layout = self._cache_layout_of
        if layout is None or layout.key[0] is not kv_caches or layout.key[1:] != key:
            cache = kv_caches[0]
            ops.check_cache(cache, self.num_kv_heads, self.head_dim)
            addresses = np.fromiter((c.data_ptr() for c in kv_caches), dtype=np.int64, count=len(kv_caches))
            layout = self._cache_layout_of = _CacheLayout((kv_caches, *key), addresses, tuple(cache.stride()[:4]),
                                                          cache.shape[0], cache.shape[2], ops.kernel_dtype(cache))
        return layout

    def _rope_table(self, max_seq_len: int) -> torch.Tensor:
        if self._cos_sin.shape[0] < max_seq_len:
            # Grown by doubling: a long model's full table can be tens of MB.
            size = max(max_seq_len, 2 * self._cos_sin.shape[0], 1024)
            self._cos_sin = ops.rope_cache(self.model.rope_inv_freq, size, self.rope_scale)
        return self._cos_sin


def enable(model, *, isa: str = "auto", num_threads: int | None = None) -> str | None:
    """Makes ``model`` (a LlamaModel) run its forward through the CPU kernels where they apply;
    returns the instruction set they use, or None (the model keeps its torch path)."""
    if unsupported_reason(model) is not None:
        return None
    decoder = model.cpu_decoder = CpuDecoder(model, isa=isa, num_threads=num_threads)
    for module in decoder.tile_modules:
        if isinstance(module, PackedLinear):
            module.drop_packed_weight()  # the tiles' copy replaces oneDNN's: the weight's bytes once more, not twice
    return decoder.isa
