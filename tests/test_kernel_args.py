"""What the CUDA attention launchers refuse before anything reaches a GPU (checked on any machine)."""

from __future__ import annotations

import pytest
import torch

from kvtool.kernels.tensors import paged_attention_args

NUM_TOKENS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, TPB = 3, 4, 2, 64, 16


def args(*, query=None, kv_cache=None, out=None):
    query = torch.zeros(NUM_TOKENS, NUM_HEADS, HEAD_DIM, dtype=torch.float16) if query is None else query
    kv_cache = torch.zeros(5, 2, TPB, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float16) if kv_cache is None else kv_cache
    metadata = torch.zeros(2, dtype=torch.int32)
    return paged_attention_args(query, kv_cache, torch.empty_like(query) if out is None else out,
                                metadata.view(1, 2), metadata, metadata[:1])


@pytest.mark.parametrize("change,message", [
    (dict(query=torch.zeros(NUM_TOKENS, NUM_HEADS * HEAD_DIM, dtype=torch.float16)), "num_heads, head_dim"),
    (dict(query=torch.zeros(NUM_TOKENS, 3, HEAD_DIM, dtype=torch.float16)), "multiple of num_kv_heads 2"),
    (dict(out=torch.zeros(NUM_TOKENS, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16)), "must share a dtype"),
    (dict(query=torch.zeros(NUM_TOKENS, NUM_HEADS, HEAD_DIM), kv_cache=torch.zeros(5, 2, TPB, 2, HEAD_DIM)),
     "float16 or bfloat16"),
    (dict(query=torch.zeros(NUM_TOKENS, NUM_HEADS, 96, dtype=torch.float16),
          kv_cache=torch.zeros(5, 2, TPB, 2, 96, dtype=torch.float16)), "head_dim"),
    (dict(kv_cache=torch.zeros(5, 2, 24, 2, HEAD_DIM, dtype=torch.float16)), "power of two"),
    ({}, "must be a CUDA tensor"),  # everything else right: on a CPU the last check is the device
])
def test_launcher_refuses_inputs_its_kernels_cannot_take(change, message):
    with pytest.raises(ValueError, match=message):
        args(**change)
