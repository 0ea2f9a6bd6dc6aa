"""`kvtool serve`: an OpenAI-compatible HTTP server over kvtool's engine (kvtool/serve/)."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvtool.cli import app
from kvtool.cli.user_errors import user_errors
from kvtool.cli.help import KvtoolCommand
from kvtool.cli.typer_options import flag, flags_of, with_flags
from kvtool.config import ConfigError
from kvtool.flags import ENGINE_FLAGS, FlagValues, configs

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
@with_flags
def serve(
    ctx: typer.Context,
    engine: FlagValues = flags_of(ENGINE_FLAGS),
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
    plan, model = engine["plan"], engine["model"]
    with user_errors():
        if plan is not None and model is not None:
            raise ValueError("give --plan DIR or --model preset:NAME, not both")
        if plan is None and model is None:
            raise ValueError("give --plan DIR (from `kvtool build`) or --model preset:NAME")
        config, _ = configs(engine.config_flags())
        name = served_model_name or (Path(plan).name if plan is not None else str(model).removeprefix("preset:"))
        serve_config = _serve_config(ctx, host=host, port=port, served_model_name=name,
                                     shutdown_timeout=shutdown_timeout,
                                     api_key=api_key, max_request_bytes=max_request_bytes, ssl_keyfile=ssl_keyfile,
                                     ssl_certfile=ssl_certfile)
        serve_config.check_certificate()
        check_port_free(host, port)  # now, not after the model is loaded
        from kvtool import LLM
        from kvtool.plan.load import engine_plan
        from kvtool.serve import create_app
        from kvtool.serve.server import run_server

        llm = LLM(engine_plan(plan if plan is not None else model, config, cache_dir=engine["plan_cache_dir"]),
                  config=config)
    for line in (llm.pool_sizes.describe(llm.device_description.split(":")[0]), *llm.pool_sizes.notes):
        console.print(line, highlight=False, soft_wrap=True)
    console.print(f"serving {name!r} on {serve_config.scheme}://{host}:{port}/v1 ({serve_config.describe_limits()}; "
                  "Ctrl-C or SIGTERM drains and stops)", highlight=False, soft_wrap=True)
    try:
        with user_errors():
            run_server(create_app(llm, served_model_name=name, config=serve_config), serve_config)
    finally:
        llm.shutdown()
