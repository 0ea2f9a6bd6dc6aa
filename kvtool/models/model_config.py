"""ModelConfig: the architecture of a Llama-family decoder, read from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

_HF_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # the dtypes kvtool runs, by name


def check_dtype_name(dtype: str) -> None:
    """ValueError unless ``dtype`` names a dtype kvtool runs ('float32', 'float16', 'bfloat16')."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not supported: use one of {list(_DTYPE_BYTES)}")


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` or ``torch.bfloat16`` -> ``torch.bfloat16``; anything else is a ValueError."""
    import torch  # here, not at the top: the CLI reads model configs without loading torch (kvtool --help)

    if isinstance(dtype, torch.dtype):
        return dtype
    check_dtype_name(dtype)
    return getattr(torch, dtype)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass
class ModelConfig:
    """Shapes and numerics of a Llama-family model (Llama, Mistral, Qwen2, Qwen3).

    ``attention_bias`` is the q/k/v projection bias (Qwen2); ``attention_output_bias`` the o_proj
    bias (Llama/Qwen3 checkpoints with ``attention_bias: true`` have both). ``qk_norm`` is Qwen3's
    per-head RMSNorm of q and k before RoPE. ``rope_scaling`` is None or a dict with ``rope_type``
    in ``ROPE_TYPES`` (llama3: factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings; linear: factor; yarn: factor, original_max_position_embeddings
    and Hugging Face's optional keys, kvtool.models.yarn).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    attention_output_bias: bool = False

    def __post_init__(self) -> None:
        _check(self.family in FAMILIES,
               f"ModelConfig.family {self.family!r} is not supported: use one of {list(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0,
                   f"ModelConfig.{name} must be a positive integer, got {value!r}")
        _check(self.num_heads % self.num_kv_heads == 0,
               f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
               f"({self.num_kv_heads}) for grouped-query attention")
        _check(self.head_dim % 2 == 0, f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        _check(self.rms_norm_eps > 0, f"ModelConfig.rms_norm_eps must be positive, got {self.rms_norm_eps}")
        _check(self.rope_theta > 0, f"ModelConfig.rope_theta must be positive, got {self.rope_theta}")
        _check(self.sliding_window is None or (isinstance(self.sliding_window, int) and self.sliding_window > 0),
               f"ModelConfig.sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        self.eos_token_ids = [int(token_id) for token_id in self.eos_token_ids]
        for token_id in [*self.eos_token_ids, *([self.bos_token_id] if self.bos_token_id is not None else [])]:
            _check(0 <= token_id < self.vocab_size,
                   f"ModelConfig: special token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
            rope_type = self.rope_scaling.get("rope_type")
            _check(rope_type in ROPE_TYPES,
                   f"ModelConfig.rope_scaling type {rope_type!r} is not supported: use one of {list(ROPE_TYPES)} "
                   "(or None for plain RoPE)")
            if rope_type == "default":
                self.rope_scaling = None
            elif rope_type == "linear":
                _check(float(self.rope_scaling.get("factor", 0)) > 0,
                       f"ModelConfig.rope_scaling: linear scaling needs a positive 'factor', got {self.rope_scaling}")
            elif rope_type == "yarn":
                missing = [key for key in ("factor", "original_max_position_embeddings")
                           if not isinstance(self.rope_scaling.get(key), (int, float)) or self.rope_scaling[key] <= 0]
                _check(not missing, f"ModelConfig.rope_scaling: yarn scaling needs a positive {missing}, got "
                       f"{self.rope_scaling}")
            else:
                missing = [key for key in _LLAMA3_KEYS if key not in self.rope_scaling]
                _check(not missing,
                       f"ModelConfig.rope_scaling: llama3 scaling needs {missing}, got {self.rope_scaling}")
                _check(self.rope_scaling["high_freq_factor"] > self.rope_scaling["low_freq_factor"],
                       "ModelConfig.rope_scaling: llama3 high_freq_factor must exceed low_freq_factor, "
                       f"got {self.rope_scaling}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_kv_bytes_per_token(self, dtype: str | torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers: sizes the KV pools."""
        element_size = _DTYPE_BYTES[dtype] if isinstance(dtype, str) and dtype in _DTYPE_BYTES \
            else torch_dtype(dtype).itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    def num_parameters(self) -> int:
        """Parameter count of the converted weights (fused layout, tied embeddings counted once)."""
        return sum(_numel(shape) for shape in weight_shapes(self).values())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        _check(not unknown, f"ModelConfig.from_dict: unknown keys {unknown}; known keys are {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout)."""
        model_type = hf.get("model_type")
        _check(model_type in FAMILIES,
               f"config.json model_type {model_type!r} is not supported: kvtool runs {list(FAMILIES)}")
        missing = [key for key in _HF_REQUIRED_KEYS if key not in hf]
        _check(not missing, f"config.json lacks {missing}: it is not a complete {model_type} config")
        for key in _HF_REQUIRED_KEYS:
            _check(isinstance(hf[key], int) and hf[key] > 0,
                   f"config.json {key} must be a positive integer, got {hf[key]!r}")
        hidden_act = hf.get("hidden_act", "silu")
        _check(hidden_act == "silu", f"config.json hidden_act {hidden_act!r} is not supported: only 'silu'")
        _check(not hf.get("mlp_bias", False), "config.json mlp_bias=true is not supported")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope_theta, rope_scaling = _read_rope(hf)
        # transformers' "attention_bias" means bias on q, k, v and o for Llama/Mistral/Qwen3;
        # Qwen2 hard-codes a q/k/v bias and no o_proj bias.
        if model_type == "qwen2":
            attention_bias, attention_output_bias = True, False
        else:
            attention_bias = attention_output_bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            family=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            attention_output_bias=attention_output_bias,
            qk_norm=model_type == "qwen3",
            sliding_window=_read_sliding_window(hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
        )


def _read_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 writes "rope_parameters" (theta inside); 4.x writes "rope_theta" + "rope_scaling".
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    for candidate in (params, scaling):
        rope_type = candidate.get("rope_type", candidate.get("type", "default"))
        if rope_type != "default":
            kept = {k: v for k, v in candidate.items() if k not in ("rope_theta", "type", "rope_type")}
            return rope_theta, {"rope_type": rope_type, **kept}
    return rope_theta, None


def _read_sliding_window(hf: dict[str, Any]) -> int | None:
    window = hf.get("sliding_window")
    if hf["model_type"] in ("qwen2", "qwen3"):
        # Qwen only slides when asked, and then possibly on some layers only.
        if not hf.get("use_sliding_window", False) or window is None:
            return None
        layer_types = hf.get("layer_types")
        if layer_types and set(layer_types) != {"sliding_attention"}:
            raise ValueError("config.json mixes sliding and full attention layers (layer_types); kvtool "
                             "supports one window for all layers: set use_sliding_window=false")
        return int(window)
    if hf["model_type"] == "mistral":
        return None if window is None else int(window)
    return None


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a plan's weights.safetensors (kvtool's fused layout)."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        prefix = f"layers.{i}."
        shapes[prefix + "input_norm.weight"] = (c.hidden_size,)
        shapes[prefix + "attention.qkv_proj.weight"] = (c.q_size + 2 * c.kv_size, c.hidden_size)
        if c.attention_bias:
            shapes[prefix + "attention.qkv_proj.bias"] = (c.q_size + 2 * c.kv_size,)
        if c.qk_norm:
            shapes[prefix + "attention.q_norm.weight"] = (c.head_dim,)
            shapes[prefix + "attention.k_norm.weight"] = (c.head_dim,)
        shapes[prefix + "attention.o_proj.weight"] = (c.hidden_size, c.q_size)
        if c.attention_output_bias:
            shapes[prefix + "attention.o_proj.bias"] = (c.hidden_size,)
        shapes[prefix + "post_attention_norm.weight"] = (c.hidden_size,)
        shapes[prefix + "mlp.gate_up_proj.weight"] = (2 * c.intermediate_size, c.hidden_size)
        shapes[prefix + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    shapes["norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes
