"""Real redis-server processes for the remote tier's tests (Debian's redis-server package, which
`make setup` installs when missing). Each server runs on a free loopback port in the test's temporary
directory, persists nothing, and is killed at the end of the test (or in the middle, by the test)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server; ``url`` points at it."""

    def __init__(self, directory: Path, *, port: int | None = None, maxmemory: str = "256mb",
                 maxmemory_policy: str = "allkeys-lru") -> None:
        if REDIS_SERVER is None:
            pytest.skip("redis-server is not installed: `make setup` installs Debian's redis-server")
        self.directory = directory
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.maxmemory, self.maxmemory_policy = maxmemory, maxmemory_policy
        self.process = None
        self.start()

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory), "--maxmemory", self.maxmemory, "--maxmemory-policy",
             self.maxmemory_policy, "--loglevel", "warning", "--logfile", str(self.directory / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}: see {self.directory / 'redis.log'}")

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)

    def kill(self) -> None:
        """Kills the server at once (SIGKILL), as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        self.kill()
        self.process = None
