"""Launcher for csrc/kernels/kv_append.cu: stores new keys/values into the paged cache."""

from __future__ import annotations

import functools

import torch

from kvtool.kernels.compiler import KernelSpec
from kvtool.kernels.loader import KernelLibrary, device_arch, i32, i64, launch, ptr
from kvtool.kernels.tensors import cache_strides, row_strides

SOURCE = "kv_append.cu"
KERNEL = "kvt_kv_append"
NUM_THREADS = 128


@functools.lru_cache(maxsize=None)  # pure; called per layer per step
def kv_append_spec(arch: str) -> KernelSpec:
    """One specialization per architecture: sizes are runtime arguments, bytes are bytes."""
    return KernelSpec.create(SOURCE, arch)


def append_kv(library: KernelLibrary, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """kv_cache[slot // T, 0/1, slot % T] = key/value[token] for every token with slot >= 0.

    key/value: [num_tokens, num_kv_heads, head_dim] (any 16-byte aligned strides);
    kv_cache: [num_blocks, 2, T, num_kv_heads, head_dim] (e.g. ``pool[:, layer]``);
    slot_mapping: [num_tokens] block_id * T + offset. Launches on torch's current stream.
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    strides = cache_strides(kv_cache)
    _num_blocks, _two, tokens_per_block, num_kv_heads, head_dim = kv_cache.shape
    if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
        raise ValueError(f"key ({key.dtype}) and value ({value.dtype}) must have the KV cache dtype {kv_cache.dtype}")
    key_token_stride, key_head_stride = row_strides(key, "key", num_kv_heads, head_dim)
    value_token_stride, value_head_stride = row_strides(value, "value", num_kv_heads, head_dim)
    if value.shape[0] != num_tokens or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} must have the same number of tokens")
    device = kv_cache.device
    slots = slot_mapping.to(device=device, dtype=torch.int64).contiguous()
    kernel = library.kernel(kv_append_spec(device_arch(device)), KERNEL, device.index)
    args = (ptr(key), i64(key_token_stride), i64(key_head_stride),
            ptr(value), i64(value_token_stride), i64(value_head_stride), ptr(slots),
            ptr(kv_cache), i64(strides.block), i64(strides.kv), i64(strides.token), i64(strides.head),
            i32(num_kv_heads), i32(head_dim), i32(tokens_per_block))
    launch(kernel, (num_tokens,), (NUM_THREADS,), args, device_index=device.index)
