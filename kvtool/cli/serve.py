"""`kvtool serve`: an OpenAI-compatible HTTP server over kvtool's engine (kvtool/serve/)."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvtool.bench.config import ENGINE_FLAG_NAMES, BenchConfig
from kvtool.cli import app, engine_flags
from kvtool.cli.errors import user_errors
from kvtool.cli.help import KvtoolCommand
from kvtool.cli.options import flag
from kvtool.config import ConfigError

SERVER = "Server"
_FLAG_OF_FIELD = {"drain_timeout_s": "drain_timeout"}  # ServeConfig fields named otherwise than their flags


def check_port_free(host: str, port: int) -> None:
    """A ValueError naming the address when something already listens there."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as error:
        reason = os.strerror(error.errno).lower() if error.errno else str(error)
        fix = ("stop what listens there, or choose another --port" if error.errno == errno.EADDRINUSE else
               "give an address of this machine (127.0.0.1, 0.0.0.0) and a port you may open")
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({reason}): {fix}") from None


@app.command(cls=KvtoolCommand)
def serve(
    ctx: typer.Context,
    plan: engine_flags.Plan = None,
    model: engine_flags.Model = None,
    tokens_per_block: engine_flags.TokensPerBlock = None,
    plan_cache_dir: engine_flags.PlanCacheDir = None,
    enable_kv_cache_reuse: engine_flags.EnableKvCacheReuse = None,
    disable_kv_cache_reuse: engine_flags.DisableKvCacheReuse = None,
    max_tokens_in_paged_kv_cache: engine_flags.MaxTokensInPagedKvCache = None,
    kv_cache_free_gpu_mem_fraction: engine_flags.KvCacheFreeGpuMemFraction = None,
    kv_host_cache_bytes: engine_flags.KvHostCacheBytes = None,
    max_attention_window_size: engine_flags.MaxAttentionWindowSize = None,
    scheduler_policy: engine_flags.SchedulerPolicy = None,
    enable_chunked_context: engine_flags.EnableChunkedContext = None,
    disable_chunked_context: engine_flags.DisableChunkedContext = None,
    context_chunking_policy: engine_flags.ContextChunkingPolicy = None,
    max_batch_size: engine_flags.MaxBatchSize = None,
    max_num_tokens: engine_flags.MaxNumTokens = None,
    max_seq_len: engine_flags.MaxSeqLen = None,
    enforce_eager: engine_flags.EnforceEager = None,
    host: Annotated[str, flag("host", "Address to listen on (0.0.0.0: every interface).", SERVER)] = "127.0.0.1",
    port: Annotated[int, flag("port", "TCP port.", SERVER)] = 8000,
    served_model_name: Annotated[str | None, flag("served_model_name", "The model name clients send (default: "
                                                  "the plan's directory or the preset's name).", SERVER)] = None,
    drain_timeout: Annotated[float, flag("drain_timeout", "Seconds running requests may finish in after Ctrl-C "
                                         "or SIGTERM; the rest are aborted.", SERVER)] = 5.0,
) -> None:
    """Serve a plan over OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)."""
    from kvtool.serve import ServeConfig

    console = Console(stderr=True)
    with user_errors():
        flags = engine_flags.engine_flag_values(ctx.params, ENGINE_FLAG_NAMES)
        if plan is not None and model is not None:
            raise ValueError("give --plan DIR or --model preset:NAME, not both")
        if plan is None and model is None:
            raise ValueError("give --plan DIR (from `kvtool build`) or --model preset:NAME")
        config = BenchConfig.from_flags(flags)
        name = served_model_name or (Path(plan).name if plan is not None else str(model).removeprefix("preset:"))
        try:
            serve_config = ServeConfig(host=host, port=port, served_model_name=name, drain_timeout_s=drain_timeout)
        except ConfigError as error:
            raise ValueError(f"--{_FLAG_OF_FIELD.get(error.field, error.field)} {error.problem}") from None
        check_port_free(host, port)  # now, not after the model is loaded
        from kvtool.bench.runner import create_llm
        from kvtool.serve import create_app
        from kvtool.serve.server import run_server

        llm = create_llm(str(plan if plan is not None else model), config, cache_dir=plan_cache_dir)
    for line in (llm.pool_sizes.describe(llm.device_description.split(":")[0]), *llm.pool_sizes.notes):
        console.print(line, highlight=False, soft_wrap=True)
    console.print(f"serving {name!r} on http://{host}:{port}/v1 (Ctrl-C drains and stops)", highlight=False)
    try:
        with user_errors():
            run_server(create_app(llm, served_model_name=name), serve_config)
    finally:
        llm.shutdown()
