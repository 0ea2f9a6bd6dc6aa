"""
kvtool's CPU kernels (fused RMSNorm, SiLU-and-mul, RoPE + KV append, paged attention), one build per instruction set, chosen at run time.
"""

from collections.abc import Sequence
import enum
from typing import Annotated

import numpy
from numpy.typing import NDArray


class DType(enum.Enum):
    """Element type of activations or of the KV cache."""

    FLOAT32 = 0

    BFLOAT16 = 1

def supported_isas() -> list[str]:
    """The instruction sets this CPU runs the kernels for, best first."""

class AttentionPlan:
    """
    One step's attention split into tasks (sequence, KV head, run of queries); every layer of the step uses it.
    """

    @property
    def num_tasks(self) -> int: ...

    @property
    def work(self) -> float:
        """Multiply-adds of all tasks."""

    @property
    def num_merges(self) -> int:
        """
        Outputs merged from shares: of decode tasks split by keys for the threads, and of the sequences of a shared prefix.
        """

    @property
    def num_shared_prefixes(self) -> int:
        """
        Groups of decode sequences whose common leading blocks are read once for all of them.
        """

class DecoderLayerWeights:
    """
    One decoder layer's weights by address (0: none): the norms' and the fused projections' [out_features, in_features] with their biases.
    """

    def __init__(self, input_norm: int, post_attention_norm: int, q_norm: int, k_norm: int, qkv: int, qkv_bias: int, o: int, o_bias: int, gate_up: int, gate_up_bias: int, down: int, down_bias: int) -> None: ...

class DecoderStack:
    """
    A decoder stack's step of a few rows in one call, on weights registered once by address (they must outlive it).
    """

    def __init__(self, layers: Sequence[DecoderLayerWeights], final_norm: int, embedding: int, lm_head: int, vocab_size: int, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rms_norm_eps: float, attention_scale: float, dtype: DType, max_rows: int) -> None:
        """
        embedding and lm_head: the [vocab_size, hidden_size] tables decode reads (the same one when tied).
        """

    @property
    def num_layers(self) -> int: ...

    @property
    def max_rows(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def forward(self, kernels: CpuKernels, plan: AttentionPlan, residual: int, out: int, num_rows: int, positions: int, slot_mapping: int, rope_cache: int, max_positions: int, kv_caches: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)], block_stride: int, kv_stride: int, token_stride: int, head_stride: int, tokens_per_block: int, cache_dtype: DType) -> None:
        """
        Every layer and the final norm for num_rows rows: residual [num_rows, hidden_size] (the embedded tokens) is the residual stream, out [num_rows, hidden_size] gets the final norm; writes each layer's KV (kv_caches: int64 addresses, one per layer).
        """

    def decode(self, kernels: CpuKernels, token_ids: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)], positions: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)], block_tables: Annotated[NDArray[numpy.int32], dict(shape=(None, None), order='C', device='cpu', writable=False)], num_blocks: int, rope_cache: int, max_positions: int, kv_caches: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)], block_stride: int, kv_stride: int, token_stride: int, head_stride: int, tokens_per_block: int, cache_dtype: DType, sliding_window: int, logits: Annotated[NDArray[numpy.float32], dict(shape=(None, None), order='C', device='cpu')] | None, picked_token_ids: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu')] | None = None, temperatures: Annotated[NDArray[numpy.float32], dict(shape=(None,), order='C', device='cpu', writable=False)] | None = None, top_ks: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)] | None = None, top_ps: Annotated[NDArray[numpy.float32], dict(shape=(None,), order='C', device='cpu', writable=False)] | None = None, uniforms: Annotated[NDArray[numpy.float64], dict(shape=(None,), order='C', device='cpu', writable=False)] | None = None) -> None:
        """
        A decode step of one new token per row (token_ids and positions int64 [n], block_tables int32 [n, max_blocks], -1 where no block) in one call: the tokens' embeddings, every layer (writing each layer's KV), the final norm and the LM head into logits float32 [n, vocab_size], and/or each row's token into picked_token_ids int64 [n]: its greedy pick (the first largest logit, a NaN the largest, as NumPy's argmax) where temperatures (float32 [n]) is None or its temperature 0, else a draw as CpuKernels.draw's at its temperature, top_ks (int64 [n]), top_ps (float32 [n]) and uniforms (float64 [n]); sliding_window 0: none.
        """

class TileWeight:
    """
    A bfloat16 weight laid out once for tile products (CpuKernels.tile_linear, amx).
    """

    def __init__(self, weight: int, num_weight_rows: int, in_features: int, stride: int, gated: bool = False) -> None:
        """
        weight: bfloat16 [num_weight_rows, in_features], rows stride elements apart (copied). gated: a gate_up weight (the gate's rows, then the up's), whose product is SiLU(gate) * up.
        """

    @staticmethod
    def fits(num_weight_rows: int, in_features: int, gated: bool = False) -> bool:
        """
        Whether such a weight can be laid out (in_features a multiple of 32; gated, rows of 32).
        """

    @property
    def in_features(self) -> int: ...

    @property
    def out_features(self) -> int:
        """The product's: the weight's rows, half if gated."""

    @property
    def gated(self) -> bool: ...

    @property
    def num_bytes(self) -> int: ...

class ArgMax:
    """
    The largest of a range of values and the index of its first occurrence.
    """

    @property
    def value(self) -> float: ...

    @property
    def index(self) -> int: ...

class CpuKernels:
    """The kernels of one instruction set and the threads that run them."""

    def __init__(self, isa: str = 'auto', num_threads: int = 1) -> None:
        """
        isa: 'auto' (the best this CPU runs) or one of supported_isas(); num_threads counts the caller.
        """

    @property
    def isa(self) -> str: ...

    @property
    def width(self) -> int:
        """Float lanes of a vector."""

    @property
    def num_threads(self) -> int: ...

    def rms_norm(self, x: int, residual: int, weight: int, out: int, num_rows: int, dim: int, x_stride: int, residual_stride: int, out_stride: int, eps: float, dtype: DType) -> None:
        """
        out[r] = rms_norm(x[r] + residual[r]) * weight, residual[r] becoming the sum (residual 0: none).
        """

    def silu_mul(self, gate_up: int, out: int, num_rows: int, dim: int, in_stride: int, out_stride: int, dtype: DType) -> None:
        """out[r] = silu(gate_up[r, :dim]) * gate_up[r, dim:]."""

    def rope_store_kv(self, qkv: int, num_tokens: int, qkv_stride: int, num_heads: int, num_kv_heads: int, head_dim: int, positions: int, rope_cache: int, max_positions: int, q_norm_weight: int, k_norm_weight: int, norm_eps: float, kv_cache: int, block_stride: int, kv_stride: int, token_stride: int, head_stride: int, slot_mapping: int, tokens_per_block: int, dtype: DType, cache_dtype: DType) -> None:
        """
        Rotates q and k of each token in place (after the optional per-head q/k RMSNorm; weight 0: none) and stores k and v at slot_mapping[t] of the layer's KV cache.
        """

    def plan_attention(self, query_start_loc: Annotated[NDArray[numpy.int32], dict(order='C', device='cpu', writable=False)], seq_lens: Annotated[NDArray[numpy.int32], dict(order='C', device='cpu', writable=False)], block_tables: Annotated[NDArray[numpy.int32], dict(order='C', device='cpu', writable=False)], num_blocks: int, num_heads: int, num_kv_heads: int, head_dim: int, tokens_per_block: int, sliding_window: int, dtype: DType) -> AttentionPlan:
        """
        The step's attention tasks (int32 arrays as in AttentionMetadata; sliding_window 0: none), shaped for queries and a cache of dtype.
        """

    def attention(self, plan: AttentionPlan, query: int, query_stride: int, out: int, out_stride: int, kv_cache: int, block_stride: int, kv_stride: int, token_stride: int, head_stride: int, scale: float, dtype: DType, cache_dtype: DType) -> None:
        """
        One layer's attention for the planned step: query [tokens, heads, head_dim] -> out (same shape), over the paged KV cache.
        """

    def linear(self, x: int, weight: int, bias: int, out: int, num_rows: int, in_features: int, out_features: int, x_stride: int, weight_stride: int, out_stride: int, dtype: DType) -> None:
        """
        out[m, n] = x[m] . weight[n] (+ bias[n]; bias 0: none) for a few rows: each weight row is read once for all of them, the output features shared by the threads.
        """

    @property
    def has_tile_products(self) -> bool:
        """Whether tile_linear runs here (the amx kernels)."""

    def tile_linear(self, weight: TileWeight, x: int, num_rows: int, x_stride: int, out: int, out_stride: int) -> None:
        """
        out [num_rows, weight.out_features] = x [num_rows, weight.in_features] . weight^T (gated: SiLU(gate) * up), bfloat16, on AMX tiles (has_tile_products); strides in elements.
        """

    def sum(self, data: int, num_floats: int) -> float:
        """
        The sum of num_floats float32 values, each thread reading a share: a streaming read, to time memory bandwidth with.
        """

    def argmax(self, data: int, dtype: DType, begin: int, end: int) -> ArgMax:
        """
        The largest of data[begin:end] and the index of its first occurrence (a NaN the largest, its first taken, as NumPy's argmax), on the calling thread.
        """

    def draw(self, data: int, dtype: DType, size: int, temperature: float, top_k: int, top_p: float, u: float) -> int:
        """
        A draw from softmax(data[:size] / temperature), cut to its top_k largest (0: all) and then the fewest of those whose mass reaches top_p (1: all; ties with the last kept are kept), by inverse transform in the order of data: the first index whose running sum of the kept exp((x - max) / temperature) exceeds u (in [0, 1)) times their total, on the calling thread; argmax's index where the largest value is NaN or infinite.
        """
