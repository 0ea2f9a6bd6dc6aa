"""`build_plan`: convert a Hugging Face checkpoint or a GGUF file, or generate a preset, into a plan directory.

Weights are streamed tensor by tensor into weights.safetensors in kvtool's fused layout and the
target dtype, so building needs memory for a few tensors, not the whole model. Checkpoints are read
through safetensors only: pickled weights (*.bin, *.pt) are never loaded. A GGUF file is first
dequantized into a float32 checkpoint beside the plan (kvtool.models.gguf), then built like one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kvtool.errors import PlanError
from kvtool.files import staging_dir
from kvtool.models.model_config import ModelConfig, torch_dtype, weight_shapes
from kvtool.models.gguf import dequantize_gguf, is_gguf_source, resolve_gguf
from kvtool.models.presets import PRESET_PREFIX, preset_config
from kvtool.models.tokenizer import write_tokenizer
from kvtool.plan.format import (CHECKSUM_ALGORITHM, FORMAT_VERSION, TOKENIZER_DIR, WEIGHTS_FILE,
                                record_verified_checksum, write_manifest, write_safetensors_streaming)
from kvtool.kernels.tensors import kernels_apply
from kvtool.plan.kernels import compile_plan_kernels
from kvtool.plan.build_options import BuildOptions
from kvtool.version import __version__

_PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_INIT_STD = 0.02  # transformers' initializer_range for these families


def build_plan(source: str, output_dir: Path, options: BuildOptions, *, compile_kernels: bool | None = None) -> Path:
    """Build ``source`` (a Hugging Face checkpoint directory, a .gguf file, ``gguf:NAME`` or
    ``preset:NAME``) into the plan directory ``output_dir`` and return it. An existing plan there
    is replaced.

    ``compile_kernels``: compile the plan's CUDA kernels into it (None: when this machine has a
    GPU and the kernels cover the model's dtype and head_dim)."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not (output_dir / "plan.json").is_file() and any(output_dir.iterdir()):
        raise ValueError(f"output directory {output_dir} exists and is not a plan: choose an empty or new directory")
    if is_gguf_source(source):
        gguf = resolve_gguf(source)
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        # The dequantized checkpoint is an intermediate: it lives beside the plan only while building.
        with tempfile.TemporaryDirectory(prefix=f".{output_dir.name}.gguf-", dir=output_dir.parent) as scratch:
            checkpoint_dir = dequantize_gguf(gguf.path, Path(scratch))
            source_info = {"kind": "gguf", "path": str(gguf.path.resolve()), "name": gguf.name}
            return _build_checkpoint(checkpoint_dir, output_dir, options, source_info, compile_kernels)
    if source.startswith(PRESET_PREFIX):
        config = preset_config(source)
        options = options.resolved(config.max_position_embeddings)
        tensors = _preset_tensors(config, options)
        source_info: dict[str, Any] = {"kind": "preset", "name": source[len(PRESET_PREFIX):], "seed": options.seed}
        return _write_plan(output_dir, config, options, tensors, None, source_info, compile_kernels)
    return _build_checkpoint(Path(source), output_dir, options, None, compile_kernels)


def _build_checkpoint(checkpoint_dir: Path, output_dir: Path, options: BuildOptions,
                      source_info: dict[str, Any] | None, compile_kernels: bool | None) -> Path:
    config = read_checkpoint_config(checkpoint_dir)
    options = options.resolved(config.max_position_embeddings)
    reader = _CheckpointReader(checkpoint_dir)
    config = reader.check_tied_embeddings(config)
    tensors = reader.tensors(config, torch_dtype(options.dtype))
    if source_info is None:
        source_info = {"kind": "checkpoint", "path": str(checkpoint_dir.resolve()),
                       "files": sorted(path.name for path in reader.files)}
    return _write_plan(output_dir, config, options, tensors, checkpoint_dir, source_info, compile_kernels)


def _write_plan(output_dir: Path, config: ModelConfig, options: BuildOptions,
                tensors: Iterator[tuple[str, torch.Tensor]], checkpoint_dir: Path | None,
                source_info: dict[str, Any], compile_kernels: bool | None) -> Path:
    # Build beside the target, then swap it in: an interrupted build never leaves a half plan.
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(output_dir, "building")
    try:
        dtype = torch_dtype(options.dtype)
        specs = {name: (shape, dtype) for name, shape in weight_shapes(config).items()}
        size_bytes, checksum = write_safetensors_streaming(
            staging / WEIGHTS_FILE, specs, tensors, metadata={"format": "pt", "producer": "kvtool"})
        tokenizer_kind = write_tokenizer(staging / TOKENIZER_DIR, checkpoint_dir=checkpoint_dir,
                                         vocab_size=config.vocab_size, bos_token_id=config.bos_token_id,
                                         eos_token_ids=config.eos_token_ids)
        kernel_artifacts, kernel_target = [], None
        kv_cache_dtype = torch_dtype(options.resolved_kv_cache_dtype)
        if compile_kernels is None:
            compile_kernels = torch.cuda.is_available() and kernels_apply(config.head_dim, kv_cache_dtype)
        if compile_kernels:
            kernel_artifacts, kernel_target = compile_plan_kernels(staging, config, options.tokens_per_block,
                                                                   kv_cache_dtype)
        manifest = {
            "format_version": FORMAT_VERSION,
            "kvtool_version": __version__,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model_config": config.to_dict(),
            "build_options": options.to_dict(),
            "source": source_info,
            "weights": {"file": WEIGHTS_FILE, "size_bytes": size_bytes, "checksum_algorithm": CHECKSUM_ALGORITHM,
                        "checksum": checksum, "dtype": options.dtype, "num_parameters": config.num_parameters()},
            "tokenizer": {"kind": tokenizer_kind, "dir": TOKENIZER_DIR},
            # Filled by the CUDA build: [{"file", "size_bytes", "checksum", ...}] verified on load.
            "kernel_artifacts": kernel_artifacts,
            "kernel_target": kernel_target,
        }
        write_manifest(staging, manifest)
        # The checksum was computed while writing: the first load need not hash the file again.
        record_verified_checksum(staging / WEIGHTS_FILE, checksum)
        if output_dir.exists():
            shutil.rmtree(output_dir)
        staging.rename(output_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return output_dir


def read_checkpoint_config(checkpoint_dir: Path) -> ModelConfig:
    """The ModelConfig of a local Hugging Face checkpoint, EOS ids merged from generation_config.json."""
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"model {str(checkpoint_dir)!r} is not a directory: give a Hugging Face "
                                f"checkpoint directory (config.json + *.safetensors) or preset:NAME")
    config_path = checkpoint_dir / "config.json"
    if not config_path.is_file():
        raise PlanError(f"{checkpoint_dir} has no config.json: it is not a Hugging Face checkpoint directory")
    try:
        hf = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise PlanError(f"{config_path} is not valid JSON ({error})") from None
    config = ModelConfig.from_hf_config(hf)
    # Chat models often list extra stop ids (e.g. <|eot_id|>) only in generation_config.json.
    generation_path = checkpoint_dir / "generation_config.json"
    if generation_path.is_file():
        try:
            eos = json.loads(generation_path.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            eos = None
        extra = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        config.eos_token_ids += [t for t in extra if t not in config.eos_token_ids and 0 <= t < config.vocab_size]
    return config


class _CheckpointReader:
    """Lazily reads a (possibly sharded) safetensors checkpoint tensor by tensor."""

    def __init__(self, checkpoint_dir: Path) -> None:
        index = checkpoint_dir / "model.safetensors.index.json"
        if index.is_file():
            # Sharded: only the shards the index names (repos may also ship e.g. consolidated.safetensors).
            try:
                shard_names = set(json.loads(index.read_text())["weight_map"].values())
            except (ValueError, KeyError, AttributeError) as error:
                raise PlanError(f"{index} is not a valid safetensors index ({error!r})") from None
            missing = sorted(name for name in shard_names if not (checkpoint_dir / name).is_file())
            if missing:
                raise PlanError(f"{checkpoint_dir} lacks the weight shards {missing} listed in {index.name}")
            self.files = sorted(checkpoint_dir / name for name in shard_names)
        else:
            self.files = sorted(checkpoint_dir.glob("*.safetensors"))
        if not self.files:
            pickled = sorted(p.name for p in checkpoint_dir.iterdir() if p.suffix in _PICKLED_SUFFIXES)
            hint = (f" (found pickled weights {pickled}: kvtool never unpickles weights; convert them with "
                    "transformers' save_pretrained(..., safe_serialization=True))") if pickled else ""
            raise PlanError(f"{checkpoint_dir} has no *.safetensors weights{hint}")
        from safetensors import safe_open

        self._handles = [safe_open(str(path), framework="pt") for path in self.files]
        self._where = {name: handle for handle in self._handles for name in handle.keys()}
        self._prefix = "model." if "model.embed_tokens.weight" in self._where else ""

    def check_tied_embeddings(self, config: ModelConfig) -> ModelConfig:
        if not config.tie_word_embeddings and "lm_head.weight" not in self._where:
            raise PlanError("the checkpoint has no lm_head.weight but config.json says tie_word_embeddings=false")
        return config

    def _get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        full = name if name == "lm_head.weight" else self._prefix + name
        if full not in self._where:
            raise PlanError(f"the checkpoint has no tensor {full!r}: it does not match its config.json")
        return self._where[full].get_tensor(full).to(dtype)

    def tensors(self, config: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors in the order of ``weight_shapes``: HF names mapped, q/k/v and gate/up fused."""
        get = self._get
        for name in weight_shapes(config):
            if name.startswith("layers."):
                _, index, rest = name.split(".", 2)
                hf = f"layers.{index}."
                if rest == "attention.qkv_proj.weight" or rest == "attention.qkv_proj.bias":
                    kind = rest.rsplit(".", 1)[1]
                    parts = [get(f"{hf}self_attn.{p}_proj.{kind}", dtype) for p in ("q", "k", "v")]
                    yield name, torch.cat(parts, dim=0)
                elif rest == "mlp.gate_up_proj.weight":
                    yield name, torch.cat([get(f"{hf}mlp.gate_proj.weight", dtype),
                                           get(f"{hf}mlp.up_proj.weight", dtype)], dim=0)
                else:
                    renamed = (rest.replace("input_norm", "input_layernorm")
                               .replace("post_attention_norm", "post_attention_layernorm")
                               .replace("attention.", "self_attn."))
                    yield name, get(hf + renamed, dtype)
            else:
                yield name, get(name, dtype)


def _preset_tensors(config: ModelConfig, options: BuildOptions,
                    max_workers: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random weights in the target dtype, as transformers initialises these models:
    N(0, 0.02) matrices, unit norms, zero biases. Each tensor has its own seed (base seed +
    its index), so a tensor's values do not depend on the order they are generated in.

    Sampling is the bulk of a large preset's build (normal_ with a CPU generator runs on one
    core), so up to ``max_workers`` (default: the CPU count) tensors are generated at once on
    threads (normal_ releases the GIL); they are yielded in file order, as the streaming writer
    needs, with at most that many waiting, so memory stays bounded."""
    dtype = torch_dtype(options.dtype)
    shapes = list(weight_shapes(config).items())
    max_workers = max_workers or os.cpu_count() or 1

    def make(index: int) -> torch.Tensor:
        name, shape = shapes[index]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype)
        if name.endswith(".bias"):
            return torch.zeros(shape, dtype=dtype)
        generator = torch.Generator().manual_seed(options.seed * 1_000_003 + index)
        return torch.empty(shape, dtype=dtype).normal_(0.0, _INIT_STD, generator=generator)

    if max_workers == 1:
        for index, (name, _) in enumerate(shapes):
            yield name, make(index)
        return
    executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvtool-preset")
    try:
        pending: deque[tuple[str, Future[torch.Tensor]]] = deque()
        for index, (name, _) in enumerate(shapes):
            pending.append((name, executor.submit(make, index)))
            if len(pending) >= max_workers:
                done_name, future = pending.popleft()
                yield done_name, future.result()
        for done_name, future in pending:
            yield done_name, future.result()
    finally:
        # Also when the writer stops early (an error, a closed generator): drop the queued work.
        executor.shutdown(wait=True, cancel_futures=True)
