"""AttentionBackend on kvtool's CUDA kernels (csrc/kernels), loaded and launched through CuPy.

Per layer and step: the KV append kernel stores the step's keys/values at ``slot_mapping``; the
paged context kernel (FlashAttention-2-style, tensor cores) attends the context chunks to their
cached prefix plus themselves; the paged decode kernel (split-K + reduce) attends the generating
tokens. Everything runs on torch's current stream with no host synchronization: the metadata's
host-side ints (``max_query_len``, ``max_decode_seq_len``, ``num_context_seqs``) size the grids.
When the model's fused prologue (csrc/kernels/rope_append.cu) has already stored the keys and
values, it calls ``attend`` instead of ``forward``.

Same semantics as :class:`kvtool.layers.attention.TorchPagedAttention` (the reference the GPU
tests compare against).
"""

from __future__ import annotations

import torch

from kvtool.kernels.kv_append import append_kv
from kvtool.kernels.tensors import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS
from kvtool.kernels.loader import KernelLibrary, require_cupy
from kvtool.kernels.paged_context_attention import paged_context_attention
from kvtool.kernels.paged_decode_attention import paged_decode_attention
from kvtool.layers.attention_metadata import AttentionMetadata


class CudaPagedAttention:
    """Paged attention with CUDA kernels (fp16 / bf16, head_dim 64 or 128, GQA, sliding windows).

    Other head dims or a float32 KV cache (tiny test presets) run on TorchPagedAttention instead.

    ``library`` holds the compiled kernels (one per specialization, compiled on first use and
    cached on disk); pass one to share it between backends or to point at a plan's kernel cache.
    Raises KernelToolchainError (an ImportError) at construction when CuPy or every CUDA compiler
    is missing, so callers can fall back to TorchPagedAttention before the first forward.
    """

    def __init__(self, library: KernelLibrary | None = None, *, decode_partition_size: int | None = None) -> None:
        """``decode_partition_size``: keys per split-K partition of the decode kernel; None chooses per
        launch (smaller partitions for small batches, ``partition_size_for``)."""
        require_cupy()
        self.library = library if library is not None else KernelLibrary()
        self.library.compiler.backends  # noqa: B018 - discovers nvcc / NVRTC now, not mid-forward
        self.decode_partition_size = decode_partition_size
        self._fallback = None  # TorchPagedAttention, created on first use

    @staticmethod
    def supports(kv_cache: torch.Tensor) -> bool:
        """True when the kernels cover this cache's dtype and head_dim."""
        return kv_cache.dtype in SUPPORTED_DTYPES and kv_cache.shape[-1] in SUPPORTED_HEAD_DIMS

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, *, scale: float, sliding_window: int | None) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads, head_dim],
        kv_cache [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim] (a strided layer view of
        the pool). Returns [num_tokens, num_heads, head_dim]."""
        if meta.tokens_per_block != kv_cache.shape[2]:
            raise ValueError(f"AttentionMetadata.tokens_per_block {meta.tokens_per_block} does not match the "
                             f"KV cache's {kv_cache.shape[2]}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
        if not self.supports(kv_cache):
            if self._fallback is None:
                from kvtool.layers.attention import TorchPagedAttention  # noqa: PLC0415

                self._fallback = TorchPagedAttention()
            return self._fallback.forward(query, key, value, kv_cache, meta, scale=scale,
                                          sliding_window=sliding_window)
        # A plan may keep its KV cache in another dtype than the model's: the kernels run in the
        # cache's dtype, but o_proj expects the attention output in the model's.
        out_dtype = query.dtype
        append_kv(self.library, key.to(kv_cache.dtype), value.to(kv_cache.dtype), kv_cache, meta.slot_mapping)
        out = self.attend(query.to(kv_cache.dtype), kv_cache, meta, scale=scale, sliding_window=sliding_window)
        return out if out.dtype == out_dtype else out.to(out_dtype)

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, *, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        """Attention of ``query`` [num_tokens, num_heads, head_dim] (the KV cache's dtype) over the cache,
        whose slots already hold this step's keys and values. Returns [num_tokens, num_heads, head_dim];
        rows no sequence owns (a CUDA graph's padding tokens) are left unwritten."""
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [num_tokens, num_heads, hd]
        num_context = meta.num_context_seqs
        num_decode = meta.num_seqs - num_context
        if num_context:
            paged_context_attention(self.library, query, kv_cache, meta.block_tables, meta.query_start_loc,
                                    meta.seq_lens, num_seqs=num_context, max_query_len=meta.max_query_len,
                                    max_seq_len=meta.max_seq_len, scale=scale, sliding_window=sliding_window,
                                    out=out)
        if num_decode:
            # Split-K partitions for the longest decode row, not a long prefill beside it.
            max_decode_seq_len = meta.max_seq_len if meta.max_decode_seq_len is None else meta.max_decode_seq_len
            paged_decode_attention(self.library, query, kv_cache, meta.block_tables, meta.query_start_loc,
                                   meta.seq_lens, seq_offset=num_context, num_seqs=num_decode,
                                   max_seq_len=max_decode_seq_len, scale=scale, sliding_window=sliding_window,
                                   out=out, partition_size=self.decode_partition_size)
        return out
