"""Loading plans: `load_plan` validates a plan directory; `resolve_model` turns a plan directory, a
checkpoint directory, a GGUF file or ``preset:NAME`` into a Plan; `engine_plan` is the plan an engine
runs: built as its EngineConfig asks (the block size, limits above a default build's)."""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtool.config import ConfigError, EngineConfig
from kvtool.errors import KvtoolError, PlanError
from kvtool.layers.attention import AttentionBackend
from kvtool.models.gguf import GGUF_PREFIX, is_gguf_source, resolve_gguf
from kvtool.models.llama import LlamaModel
from kvtool.models.presets import PRESET_PREFIX, preset_config
from kvtool.models.model_config import ModelConfig, torch_dtype, weight_shapes
from kvtool.models.tokenizer import Tokenizer, load_tokenizer
from kvtool.plan.build_options import BuildOptions
from kvtool.plan.builder import build_plan
from kvtool.plan.cache import default_cache_dir
from kvtool.plan.format import (FORMAT_VERSION, PLAN_FILE, file_checksum, has_verified_checksum, manifest_digest,
                                record_verified_checksum)
from kvtool.runtime.device import default_dtype
from kvtool.runtime.host_allocator import in_huge_pages

_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass
class Plan:
    """A validated plan directory. ``manifest`` is plan.json as a dict."""

    path: Path
    model_config: ModelConfig
    build_options: BuildOptions
    manifest: dict[str, Any] = field(repr=False)

    @property
    def weights_path(self) -> Path:
        return self.path / self.manifest["weights"]["file"]

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.build_options.dtype)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return torch_dtype(self.build_options.resolved_kv_cache_dtype)

    @property
    def supports_kv_reuse(self) -> bool:
        """Reusing cached KV needs context attention that reads the paged cache (TensorRT-LLM's rule)."""
        return self.build_options.use_paged_context_fmha

    @property
    def source(self) -> dict[str, Any]:
        return self.manifest["source"]

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        info = self.manifest["tokenizer"]
        return load_tokenizer(self.path / info["dir"], info["kind"], vocab_size=self.model_config.vocab_size,
                              eos_token_ids=self.model_config.eos_token_ids)

    def load_model(self, device: torch.device | str, backend: AttentionBackend, attention_window: int | None = None,
                   dtype: torch.dtype | None = None) -> LlamaModel:
        """The model with the plan's weights on ``device`` (cast to ``dtype`` when given), in eval mode."""
        from safetensors.torch import load_file

        device = torch.device(device)
        # Build on the meta device: no random init, no second copy of the weights.
        with torch.device("meta"):
            model = LlamaModel(self.model_config, backend, attention_window)
        if device.type == "cpu":
            # Out of the file's mapping, into huge pages (why: kvtool.runtime.host_allocator).
            state = in_huge_pages(load_file(str(self.weights_path)), dtype)
        else:
            state = load_file(str(self.weights_path), device=str(device))
            if dtype is not None:
                state = {name: tensor.to(dtype) for name, tensor in state.items()}
        model.load_state_dict(state, strict=True, assign=True)
        return model.to(device).eval().requires_grad_(False)


def _rebuild_hint(plan_dir: Path, manifest: dict[str, Any] | None = None) -> str:
    source = "<HF checkpoint dir | FILE.gguf | gguf:NAME | preset:NAME>"
    if manifest is not None:
        info = manifest.get("source") or {}
        if info.get("kind") == "preset":
            source = f"preset:{info.get('name')}"
        elif info.get("kind") == "gguf":
            source = f"{GGUF_PREFIX}{info['name']}" if info.get("name") else str(info.get("path"))
        elif info.get("kind") == "checkpoint":
            source = str(info.get("path"))
    return f"rebuild it with `kvtool build --model {source} --output {plan_dir}`"


def load_plan(plan_dir: Path | str, *, verify_checksum: bool = True) -> Plan:
    """Open and validate a plan directory; any problem is a PlanError saying why and how to rebuild.

    Checks: plan.json parses and was not edited (digest), its format version is ours, the weights
    file has the recorded size and checksum, its tensors have the shapes and dtype the config
    implies, and every recorded kernel artifact is present and intact. Hashing reads the whole
    weights file (about 0.1-0.3 s per 100 MB), so a verified checksum is recorded beside it
    (weights.verified.json, also written by build_plan) and the file is hashed again only once it
    changed (size, times, inode) or the record is missing; ``verify_checksum=False`` skips only that.
    """
    plan_dir = Path(plan_dir)
    if not plan_dir.is_dir():
        raise PlanError(f"plan directory {plan_dir} does not exist: {_rebuild_hint(plan_dir)}")
    plan_file = plan_dir / PLAN_FILE
    if not plan_file.is_file():
        raise PlanError(f"{plan_dir} has no {PLAN_FILE}, so it is not a plan: {_rebuild_hint(plan_dir)}")
    try:
        manifest = json.loads(plan_file.read_text())
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as error:
        raise PlanError(f"{plan_file} does not parse ({error}): {_rebuild_hint(plan_dir)}") from None
    hint = _rebuild_hint(plan_dir, manifest)
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise PlanError(f"{plan_dir} has plan format version {version!r}, this kvtool reads version "
                        f"{FORMAT_VERSION}: {hint}")
    if manifest.get("plan_digest") != manifest_digest(manifest):
        raise PlanError(f"{plan_file} was edited after it was built (its digest does not match): {hint}")
    try:
        config = ModelConfig.from_dict(manifest["model_config"])
        options = BuildOptions.from_dict(manifest["build_options"])
        weights = manifest["weights"]
        weights_path = plan_dir / weights["file"]
        expected_size, expected_checksum = int(weights["size_bytes"]), weights["checksum"]
        manifest["tokenizer"]["kind"]
    except ConfigError as error:  # a rule this kvtool adds (a block size it no longer takes): named by its flag
        raise PlanError(f"{plan_file} records a build option this kvtool refuses (--{error.field} {error.problem}): "
                        f"{hint}") from None
    except (KeyError, TypeError, ValueError) as error:
        raise PlanError(f"{plan_file} is incomplete or invalid ({error!r}): {hint}") from None
    _verify_file(weights_path, expected_size, expected_checksum if verify_checksum else None, hint,
                 remember=True)
    _verify_weight_shapes(weights_path, config, options.dtype, hint)
    for artifact in manifest.get("kernel_artifacts") or []:
        _verify_file(plan_dir / artifact["file"], int(artifact["size_bytes"]), artifact["checksum"], hint)
    return Plan(path=plan_dir, model_config=config, build_options=options, manifest=manifest)


def _verify_file(path: Path, expected_size: int, expected_checksum: str | None, hint: str, *,
                 remember: bool = False) -> None:
    """``remember``: trust and keep a record of a verified checksum (worth it for the weights only:
    kernel artifacts hash in milliseconds)."""
    if not path.is_file():
        raise PlanError(f"{path} is missing: {hint}")
    size = path.stat().st_size
    if size != expected_size:
        raise PlanError(f"{path} has {size} bytes, the plan recorded {expected_size} (truncated or replaced): {hint}")
    if expected_checksum is None or (remember and has_verified_checksum(path, expected_checksum)):
        return
    if file_checksum(path) != expected_checksum:
        raise PlanError(f"{path} does not match its recorded checksum (modified or corrupted): {hint}")
    if remember:
        record_verified_checksum(path, expected_checksum)


def _verify_weight_shapes(weights_path: Path, config: ModelConfig, dtype: str, hint: str) -> None:
    header = _safetensors_header(weights_path, hint)
    expected = weight_shapes(config)
    found = {name: entry for name, entry in header.items() if name != "__metadata__"}
    if set(found) != set(expected):
        missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        raise PlanError(f"{weights_path} does not hold the tensors its config needs (missing {missing[:3]}, "
                        f"unexpected {extra[:3]}): {hint}")
    for name, shape in expected.items():
        entry = found[name]
        if tuple(entry["shape"]) != shape or _SAFETENSORS_DTYPES.get(entry["dtype"]) != dtype:
            raise PlanError(f"{weights_path}: tensor {name} is {entry['dtype']} {entry['shape']}, the config needs "
                            f"{dtype} {list(shape)}: {hint}")


def _safetensors_header(path: Path, hint: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        prefix = f.read(8)
        header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if header_len <= 0 or header_len > path.stat().st_size - 8:
            raise PlanError(f"{path} is not a safetensors file: {hint}")
        try:
            return json.loads(f.read(header_len))
        except ValueError:
            raise PlanError(f"{path} has a corrupt safetensors header: {hint}") from None


def is_built_plan(model) -> bool:
    """True for a Plan or a plan directory (used as built); False for what resolve_model builds."""
    return isinstance(model, Plan) or (not str(model).startswith(PRESET_PREFIX) and (Path(model) / PLAN_FILE).is_file())


def resolve_model(model: str | Plan, *, options: BuildOptions | None = None, cache_dir: Path | None = None) -> Plan:
    """A Plan or a plan directory is used as is (``options`` are baked into it and ignored); a Hugging
    Face checkpoint directory, a GGUF file (``FILE.gguf`` or ``gguf:NAME``) or ``preset:NAME`` is built
    once into ``cache_dir`` (keyed by source and options; a changed checkpoint or an invalid cached
    plan is rebuilt) and loaded from there."""
    if isinstance(model, Plan):
        return model
    model = str(model)
    if is_built_plan(model):
        return load_plan(model)
    options = options or BuildOptions()
    plan_dir = cached_plan_dir(model, options, cache_dir)
    if not model.startswith(PRESET_PREFIX) and not is_gguf_source(model):
        model = str(Path(model).resolve())
    if (plan_dir / PLAN_FILE).is_file():
        try:
            return load_plan(plan_dir)
        except PlanError:
            shutil.rmtree(plan_dir, ignore_errors=True)
    build_plan(model, plan_dir, options)
    return load_plan(plan_dir)


def on_the_fly_build_options(config: EngineConfig, build_options: BuildOptions | None = None, *,
                             dtype: str | None = None) -> BuildOptions:
    """What a model built on the fly is built with: ``build_options`` (default: BuildOptions() in
    ``dtype``, else the device's: bfloat16 on a GPU, float32 on a CPU), with the block size the config
    asks for and its runtime limits where they exceed those options."""
    if build_options is None:
        build_options = BuildOptions(dtype=dtype or default_dtype())
    wanted, given = config.tokens_per_block, build_options.tokens_per_block
    if wanted is not None and wanted != given and given != BuildOptions().tokens_per_block:
        # The LLM API's spelling of the block size asked for (EngineConfig takes it from KvCacheConfig).
        raise KvtoolError(f"KvCacheConfig.tokens_per_block={wanted} and BuildOptions.tokens_per_block={given} "
                          "disagree: give the block size once")
    return build_options.admitting(tokens_per_block=wanted, max_batch_size=config.max_batch_size,
                                   max_seq_len=config.max_seq_len, max_num_tokens=config.max_num_tokens)


def engine_plan(model: str | Path | Plan, config: EngineConfig, *, build_options: BuildOptions | None = None,
                cache_dir: Path | None = None) -> Plan:
    """A Plan or plan directory as built (kvtool.runtime.assemble checks the config against it); a
    checkpoint, GGUF file or preset built on the fly into ``cache_dir`` (see on_the_fly_build_options)."""
    if is_built_plan(model):
        return resolve_model(model)
    return resolve_model(str(model), options=on_the_fly_build_options(config, build_options), cache_dir=cache_dir)


def _cache_path(source_key: dict[str, Any], options: BuildOptions, cache_dir: Path | None) -> Path:
    key_text = json.dumps({"format_version": FORMAT_VERSION, "source": source_key, "options": options.to_dict()},
                          sort_keys=True)
    return Path(cache_dir or default_cache_dir()) / hashlib.sha256(key_text.encode()).hexdigest()[:24]


def _source_key(model: str) -> dict[str, Any]:
    """What identifies a source that resolve_model builds: a preset's name; a GGUF file's or a checkpoint's
    location and file stats (editing or replacing it forces a rebuild)."""
    if model.startswith(PRESET_PREFIX):
        preset_config(model)  # unknown preset: ValueError listing the presets, before any work
        return {"preset": model[len(PRESET_PREFIX):]}
    if is_gguf_source(model):
        gguf = resolve_gguf(model)  # a missing file or package: the error says how to get it
        stat = gguf.path.stat()
        return {"gguf": str(gguf.path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    path = Path(model)
    if not (path / "config.json").is_file():
        raise PlanError(f"model {model!r} is neither a plan directory (plan.json), a Hugging Face checkpoint "
                        "directory (config.json + *.safetensors), a .gguf file, gguf:NAME nor preset:NAME")
    return _checkpoint_key(path)


def cached_plan_dir(model: str, options: BuildOptions, cache_dir: Path | None = None) -> Path:
    """Where resolve_model keeps (or would build) the plan of a preset, GGUF file or checkpoint with ``options``."""
    return _cache_path(_source_key(str(model)), options, cache_dir)


def _checkpoint_key(path: Path) -> dict[str, Any]:
    # Identify the checkpoint by location and file stats: editing or replacing it forces a rebuild.
    files = []
    for entry in sorted(path.iterdir()):
        if entry.is_file():
            stat = entry.stat()
            files.append([entry.name, stat.st_size, stat.st_mtime_ns])
    return {"path": str(path.resolve()), "files": files}
