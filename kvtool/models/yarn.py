"""YaRN RoPE scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language
Models"), as Qwen3's and Qwen2.5's model cards enable it for 128k tokens: ``rope_scaling =
{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}``.

Each rotary dimension pair keeps its frequency (extrapolates) when it turns many times within the
original context (more than ``beta_fast`` rotations), is divided by ``factor`` (interpolates) when it
turns less than ``beta_slow`` times, and blends linearly in between. The rotated q and k are scaled
by ``attention_factor`` (default 0.1 ln(factor) + 1), which scales attention logits by its square.
The optional keys are Hugging Face's: attention_factor, beta_fast, beta_slow, mscale,
mscale_all_dim, truncate.
"""

from __future__ import annotations

import math
from typing import Any

import torch

YARN_KEYS = ("factor", "original_max_position_embeddings")
YARN_OPTIONAL_KEYS = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """What the cos and sin tables are multiplied by."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _mscale(factor, float(mscale)) / _mscale(factor, float(mscale_all_dim))
    return _mscale(factor)


def yarn_inv_freq(head_dim: int, rope_theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies under YaRN scaling."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dimension_of(num_rotations: float) -> float:
        # The pair index whose wavelength fits num_rotations times into the original context.
        return head_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(rope_theta))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    # On the CPU even under torch.device("meta"): a plan's model is built there, this buffer is not loaded.
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    # 0 where a pair extrapolates (keeps its frequency), 1 where it interpolates (divided by factor).
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)
