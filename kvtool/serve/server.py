"""Running kvtool serve: where it listens (http or https), what it accepts, and how it stops.

uvicorn serves the app. On Ctrl-C or SIGTERM the app drains first (kvtool.serve.drain): new API
requests get 503 while running ones finish, for up to ``drain_timeout_s`` seconds (the flag
--shutdown_timeout); the requests still open then end with an error (a stream: an error event and
``data: [DONE]``), and one line is logged. Then uvicorn closes the listener and the idle connections
and the engine task stops (the app's lifespan). A second Ctrl-C ends the drain at once.
"""

from __future__ import annotations

import copy
import signal
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.config import check
from kvtool.units import format_bytes

# The largest request body read: a 128K-token prompt is under 1 MiB of JSON (token ids or text); a
# body 8 times that is a mistake or an attack, answered 413 before it is read (--max_request_bytes).
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
# After the grace period, how long the answers ended then have to be written (then uvicorn cancels them).
FLUSH_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ServeConfig:
    """Where the server listens, what it calls its model, what it accepts and how long it drains."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the plan's directory name
    drain_timeout_s: float = 5.0  # --shutdown_timeout: the grace period running requests get on SIGTERM
    log_level: str = "info"
    # Every /v1 route requires "Authorization: Bearer <api_key>"; None: no authentication.
    api_key: str | None = field(default=None, repr=False)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    ssl_keyfile: str | None = None  # with ssl_certfile: serve https
    ssl_certfile: str | None = None

    def __post_init__(self) -> None:
        check(bool(self.host), self, "host", "is empty: give an address to listen on, e.g. 127.0.0.1 or 0.0.0.0")
        check(0 <= self.port <= 65535, self, "port", f"must be in 0..65535, got {self.port}")
        check(self.served_model_name is None or bool(self.served_model_name.strip()), self, "served_model_name",
              "is empty: give the name clients send as `model`, or leave it out")
        check(self.drain_timeout_s >= 0, self, "drain_timeout_s", f"must be >= 0 seconds, got {self.drain_timeout_s}")
        levels = ("critical", "error", "warning", "info", "debug")
        check(self.log_level in levels, self, "log_level", f"{self.log_level!r} is unknown: use one of {list(levels)}")
        if self.api_key is not None:
            check(self.api_key != "", self, "api_key", "is empty: give the key clients must send, or leave it out "
                  "to serve without authentication")
            # A header carries printable ASCII; a space would split the "Bearer <key>" it is sent in.
            check(all("!" <= c <= "~" for c in self.api_key), self, "api_key",
                  "must be printable ASCII without spaces (e.g. from `openssl rand -hex 32`)")
        check(self.max_request_bytes >= 1024, self, "max_request_bytes",
              f"must be at least 1 KiB, got {self.max_request_bytes} bytes")
        check(self.ssl_keyfile is None or self.ssl_certfile is not None, self, "ssl_keyfile",
              "needs --ssl_certfile too: give the certificate the key belongs to")
        for name in ("ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            check(path is None or Path(path).is_file(), self, name, f"{path}: no such file: give a PEM file")

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile is not None else "http"

    def check_certificate(self) -> None:
        """A ValueError naming the flags when the certificate and key do not load (before a model loads)."""
        if self.ssl_certfile is None:
            return
        def no_password():  # instead of OpenSSL asking for one on the terminal
            raise ValueError(f"--ssl_keyfile {self.ssl_keyfile or self.ssl_certfile}: the private key is encrypted: "
                             "give it unencrypted (openssl pkey -in KEY -out key.pem) in a file only the server reads")

        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.ssl_certfile, self.ssl_keyfile,
                                                                               password=no_password)
        except (ssl.SSLError, OSError) as error:
            key = f" --ssl_keyfile {self.ssl_keyfile}" if self.ssl_keyfile else ""
            raise ValueError(f"--ssl_certfile {self.ssl_certfile}{key}: cannot load the certificate and its key "
                             f"({error.strerror or error}): give a PEM certificate and the PEM private key it was made "
                             "for") from None

    def describe_limits(self) -> str:
        auth = "an API key is required on /v1" if self.api_key is not None else "no API key"
        return f"{auth}; request bodies up to {format_bytes(self.max_request_bytes)}"


def uvicorn_server(app, config: ServeConfig):
    """The uvicorn server of ``app``; for a kvtool app (create_app) it drains before shutting down."""
    import uvicorn

    state = getattr(getattr(app, "state", None), "serve", None)  # kvtool.serve.app.ServeState

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            if state is not None:
                signals = getattr(self, "_captured_signals", ())
                reason = signal.Signals(signals[-1]).name if signals else "shutdown"
                await state.drain.run(timeout_s=config.drain_timeout_s, flush_timeout_s=FLUSH_TIMEOUT_S, reason=reason,
                                      cut_now=lambda: self.force_exit)
                _close_idle_tls(self.server_state.connections)
            await super().shutdown(sockets)

    return DrainingServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, log_config=_log_config(config.log_level),
        timeout_graceful_shutdown=FLUSH_TIMEOUT_S if state is not None else config.drain_timeout_s, access_log=False,
        ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile))


def _close_idle_tls(connections) -> None:
    """Closes the TLS connections with nothing left to write at once (after the drain, that is all but a
    client that stopped reading). Closed politely, as uvicorn does, one waits for the client's
    close_notify, up to 30 s, which an idle keep-alive client never sends."""
    for connection in list(connections):
        transport = getattr(connection, "transport", None)
        if transport is not None and transport.get_extra_info("sslcontext") is not None \
                and not transport.get_write_buffer_size():
            transport.abort()


def _log_config(level: str) -> dict:
    """uvicorn's log format ("INFO:     ..."), for kvtool.serve's lines too."""
    from uvicorn.config import LOGGING_CONFIG

    log_config = copy.deepcopy(LOGGING_CONFIG)
    log_config["loggers"]["kvtool.serve"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return log_config


def run_server(app, config: ServeConfig) -> None:
    """Serves until Ctrl-C or SIGTERM, then drains and returns."""
    server = uvicorn_server(app, config)
    # uvicorn raises the signal it caught again once it has shut down; by then there is nothing left to do.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
