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
API_KEY_ENV = "KVTOOL_API_KEY"


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


def _serve_config(ctx: typer.Context, *, host: str, port: int, served_model_name: str, shutdown_timeout: float,
                  api_key: str | None, max_request_bytes: str | None, ssl_keyfile: Path | None,
                  ssl_certfile: Path | None):
    """The ServeConfig of the flags; a mistake is a ValueError naming the flag (or $KVTOOL_API_KEY)."""
    from kvtool.serve import ServeConfig
    from kvtool.serve.server import DEFAULT_MAX_REQUEST_BYTES
    from kvtool.units import parse_bytes

    source = ctx.get_parameter_source("api_key")  # typer's own click: compared by name
    from_env = source is not None and source.name == "ENVIRONMENT"
    if api_key is None and os.environ.get(API_KEY_ENV) == "":
        # Click reads an empty variable as unset: serving without a key must not follow from a typo in a script.
        raise ValueError(f"${API_KEY_ENV} is set but empty: set it to the key clients must send, or unset it to serve "
                         "without authentication")
    try:
        body_limit = DEFAULT_MAX_REQUEST_BYTES if max_request_bytes is None else parse_bytes(max_request_bytes)
    except ValueError as error:
        raise ValueError(f"--max_request_bytes {error}") from None
    try:
        return ServeConfig(host=host, port=port, served_model_name=served_model_name, drain_timeout_s=shutdown_timeout,
                           api_key=api_key, max_request_bytes=body_limit,
                           ssl_keyfile=None if ssl_keyfile is None else str(ssl_keyfile),
                           ssl_certfile=None if ssl_certfile is None else str(ssl_certfile))
    except ConfigError as error:
        # ServeConfig fields named otherwise than their flags.
        names = {"drain_timeout_s": "--shutdown_timeout", "api_key": f"${API_KEY_ENV}" if from_env else "--api_key"}
        raise ValueError(f"{names.get(error.field, '--' + error.field)} {error.problem}") from None


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
    shutdown_timeout: Annotated[float, flag("shutdown_timeout", "Seconds running requests may finish in after "
                                            "Ctrl-C or SIGTERM (new ones get 503); the rest end with an error.",
                                            SERVER)] = 5.0,
    api_key: Annotated[str | None, flag("api_key", f"Require 'Authorization: Bearer KEY' on every /v1 route "
                                       f"(/health and /metrics stay open). ${API_KEY_ENV} keeps it out of `ps`.",
                                       SERVER, envvar=API_KEY_ENV, show_default=False)] = None,
    max_request_bytes: Annotated[str | None, flag("max_request_bytes", "Largest request body: bytes or 16MiB; a "
                                                  "larger one gets 413 unread (default 8 MiB).", SERVER)] = None,
    ssl_keyfile: Annotated[Path | None, flag("ssl_keyfile", "PEM private key of --ssl_certfile.", SERVER)] = None,
    ssl_certfile: Annotated[Path | None, flag("ssl_certfile", "PEM certificate: serve https.", SERVER)] = None,
) -> None:
    """Serve a plan over OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)."""
    console = Console(stderr=True)
    with user_errors():
        flags = engine_flags.engine_flag_values(ctx.params, ENGINE_FLAG_NAMES)
        if plan is not None and model is not None:
            raise ValueError("give --plan DIR or --model preset:NAME, not both")
        if plan is None and model is None:
            raise ValueError("give --plan DIR (from `kvtool build`) or --model preset:NAME")
        config = BenchConfig.from_flags(flags)
        name = served_model_name or (Path(plan).name if plan is not None else str(model).removeprefix("preset:"))
        serve_config = _serve_config(ctx, host=host, port=port, served_model_name=name,
                                     shutdown_timeout=shutdown_timeout,
                                     api_key=api_key, max_request_bytes=max_request_bytes, ssl_keyfile=ssl_keyfile,
                                     ssl_certfile=ssl_certfile)
        serve_config.check_certificate()
        check_port_free(host, port)  # now, not after the model is loaded
        from kvtool.bench.runner import create_llm
        from kvtool.serve import create_app
        from kvtool.serve.server import run_server

        llm = create_llm(str(plan if plan is not None else model), config, cache_dir=plan_cache_dir)
    for line in (llm.pool_sizes.describe(llm.device_description.split(":")[0]), *llm.pool_sizes.notes):
        console.print(line, highlight=False, soft_wrap=True)
    console.print(f"serving {name!r} on {serve_config.scheme}://{host}:{port}/v1 ({serve_config.describe_limits()}; "
                  "Ctrl-C or SIGTERM drains and stops)", highlight=False, soft_wrap=True)
    try:
        with user_errors():
            run_server(create_app(llm, served_model_name=name, config=serve_config), serve_config)
    finally:
        llm.shutdown()
