"""`kvtool build`: compile a Hugging Face checkpoint or a preset into a plan directory."""

from __future__ import annotations

import enum
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvtool.cli import app
from kvtool.cli.user_errors import user_errors
from kvtool.cli.help import KvtoolCommand
from kvtool.cli.typer_options import either, flag, toggle
from kvtool.cli.paths import check_replaceable_dir
from kvtool.plan.build_options import BuildOptions
from kvtool.units import format_bytes

DEFAULTS = BuildOptions()  # the flags' defaults are BuildOptions'


class Toggle(str, enum.Enum):
    enable = "enable"
    disable = "disable"


class DType(str, enum.Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


MODEL, KV_CACHE, LIMITS, OUTPUT = "Model", "KV cache", "Runtime limits (a bench may ask for less)", "Output"


@app.command(cls=KvtoolCommand)
def build(
    model: Annotated[str, typer.Option("--model", "-m", help="A local Hugging Face checkpoint directory, a "
                                       ".gguf file, gguf:NAME (gguf:smollm2-135m) or preset:NAME.",
                                       rich_help_panel=MODEL)],
    output: Annotated[Path, typer.Option("--output", "--output_dir", "-o", help="The plan directory to write.",
                                         rich_help_panel=OUTPUT)],
    dtype: Annotated[DType, flag("dtype", "Weight and activation dtype.", MODEL)] = DType(DEFAULTS.dtype),
    seed: Annotated[int, flag("seed", "Seed of a preset's random weights.", MODEL)] = DEFAULTS.seed,
    tokens_per_block: Annotated[int, flag("tokens_per_block", "KV cache block size in tokens (a power of 2).",
                                          KV_CACHE)] = DEFAULTS.tokens_per_block,
    kv_cache_dtype: Annotated[DType | None, flag("kv_cache_dtype", "KV cache dtype (default: --dtype).",
                                                 KV_CACHE)] = None,
    use_paged_context_fmha: Annotated[Toggle, flag(
        "use_paged_context_fmha", "Context attention over the paged cache; 'disable' forbids KV reuse.",
        KV_CACHE)] = Toggle.enable if DEFAULTS.use_paged_context_fmha else Toggle.disable,
    max_batch_size: Annotated[int, flag("max_batch_size", "Requests per step.",
                                        LIMITS)] = DEFAULTS.max_batch_size,
    max_seq_len: Annotated[int | None, flag("max_seq_len", "Longest prompt + output (default: "
                                            "min(max_position_embeddings, 4096)).", LIMITS)] = None,
    max_num_tokens: Annotated[int, flag("max_num_tokens", "Tokens per step.",
                                        LIMITS)] = DEFAULTS.max_num_tokens,
    compile_kernels: Annotated[bool | None, toggle(
        "compile_kernels", "Compile the plan's CUDA kernels (sm_90) into it (default: when this machine has a "
        "GPU).", OUTPUT)] = None,
    no_compile_kernels: Annotated[bool | None, toggle("no_compile_kernels", "Leave them to the first run on a "
                                                      "GPU.", OUTPUT)] = None,
) -> None:
    """Build a model (HF checkpoint directory, .gguf file, gguf:NAME or preset:NAME) into a plan directory."""
    with user_errors():
        from kvtool.plan import build_plan, load_plan

        compile_kernels = either(compile_kernels, no_compile_kernels, "compile_kernels", "no_compile_kernels")
        options = BuildOptions(tokens_per_block=tokens_per_block,
                               use_paged_context_fmha=use_paged_context_fmha is Toggle.enable,
                               max_batch_size=max_batch_size, max_seq_len=max_seq_len, max_num_tokens=max_num_tokens,
                               dtype=dtype.value, kv_cache_dtype=kv_cache_dtype.value if kv_cache_dtype else None,
                               seed=seed)
        check_replaceable_dir(output, "--output")
        start = time.perf_counter()
        build_plan(model, output, options, compile_kernels=compile_kernels)
        plan = load_plan(output)
        _print_summary(plan, time.perf_counter() - start)


def _print_summary(plan, seconds: float) -> None:
    config, options, weights = plan.model_config, plan.build_options, plan.manifest["weights"]
    table = Table(title=f"Plan written to {plan.path}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    source = plan.source
    if source["kind"] == "preset":
        table.add_row("source", f"preset:{source['name']} (seed {source['seed']})")
    elif source["kind"] == "gguf":
        where = f"gguf:{source['name']} ({Path(source['path']).name})" if source.get("name") else source["path"]
        table.add_row("source", f"{where}, dequantized to {plan.build_options.dtype}")
    else:
        table.add_row("source", source["path"])
    table.add_row("model", f"{config.family}: {config.num_layers} layers, hidden {config.hidden_size}, "
                           f"{config.num_heads} heads / {config.num_kv_heads} KV heads x {config.head_dim}, "
                           f"vocab {config.vocab_size}")
    extras = [name for name, on in (("qkv bias", config.attention_bias), ("q/k norm", config.qk_norm),
                                    ("tied embeddings", config.tie_word_embeddings)) if on]
    if config.rope_scaling:
        extras.append(f"{config.rope_scaling['rope_type']} rope scaling")
    if config.sliding_window:
        extras.append(f"sliding window {config.sliding_window}")
    if extras:
        table.add_row("features", ", ".join(extras))
    table.add_row("parameters", f"{weights['num_parameters'] / 1e6:,.1f} M")
    table.add_row("weights", f"{format_bytes(weights['size_bytes'])} {options.dtype}")
    table.add_row("KV cache", f"{options.resolved_kv_cache_dtype}, {options.tokens_per_block} tokens per block, "
                              f"{format_bytes(config.num_kv_bytes_per_token(plan.kv_cache_dtype))} per token")
    table.add_row("limits", f"max_batch_size {options.max_batch_size}, max_seq_len {options.max_seq_len}, "
                            f"max_num_tokens {options.max_num_tokens}")
    table.add_row("paged context FMHA", "enabled (KV reuse possible)" if options.use_paged_context_fmha
                  else "disabled (KV reuse not possible)")
    table.add_row("tokenizer", plan.manifest["tokenizer"]["kind"])
    kernels = plan.manifest.get("kernel_artifacts") or []
    table.add_row("CUDA kernels", f"{len(kernels)} compiled for {plan.manifest['kernel_target']}" if kernels
                  else "compiled on first use on a GPU")
    table.add_row("build time", f"{seconds:.1f} s")
    Console().print(table)
