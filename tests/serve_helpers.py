"""kvtool serve in the test process: an app over a kvtool.LLM, served by uvicorn on a free port of
127.0.0.1 in a thread, so tests can talk HTTP to it and still look inside (the engine's cache manager).

    with running_server(llm) as server:      # server.url = "http://127.0.0.1:PORT"
        httpx.post(server.url + "/v1/completions", json={...})
        server.call(lambda engine: engine.scheduler.cache_manager.check_invariants())
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

from kvtool import LLM, KvCacheConfig
from kvtool.serve import ServeConfig, create_app
from kvtool.serve.server import uvicorn_server

TIMEOUT_S = 60.0  # any one HTTP exchange of a test


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_llm(plan, **kwargs) -> LLM:
    """A small pool: tests that count blocks read small numbers."""
    kwargs.setdefault("kv_cache_config", KvCacheConfig(max_tokens=4096))
    return LLM(model=plan, **kwargs)


class RunningServer:
    def __init__(self, app, server, thread, port: int, name: str) -> None:
        self.app, self._server, self._thread = app, server, thread
        self.url = f"http://127.0.0.1:{port}"
        self.name = name

    @property
    def engine_loop(self):
        return self.app.state.serve.engine_loop

    def call(self, function):
        """``function(engine)`` on the server's event loop between two steps, from the test's thread."""
        engine_loop = self.engine_loop
        done = asyncio.run_coroutine_threadsafe(engine_loop.call(lambda: function(engine_loop.engine)), engine_loop.loop)
        return done.result(TIMEOUT_S)

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Until the scheduler holds no request (an aborted one is freed once the server notices)."""
        deadline = time.monotonic() + timeout_s
        while self.call(lambda engine: engine.scheduler.has_unfinished_requests()):
            if time.monotonic() > deadline:
                raise AssertionError(f"the server still runs requests after {timeout_s} s")
            time.sleep(0.02)


@contextlib.contextmanager
def running_server(llm: LLM, name: str = "tiny") -> Iterator[RunningServer]:
    port = free_port()
    app = create_app(llm, served_model_name=name)
    server = uvicorn_server(app, ServeConfig(port=port, served_model_name=name, log_level="warning",
                                             drain_timeout_s=2.0))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("kvtool serve did not start")
        time.sleep(0.01)
    try:
        yield RunningServer(app, server, thread, port, name)
    finally:
        server.should_exit = True
        thread.join(15)
