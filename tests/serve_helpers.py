"""kvtool serve in the test process: an app over a kvtool.LLM, served by uvicorn on a free port of
127.0.0.1 in a thread, so tests can talk HTTP to it and still look inside (the engine's cache manager).

    with running_server(llm) as server:      # server.url = "http://127.0.0.1:PORT"
        httpx.post(server.url + "/v1/completions", json={...})
        server.call(lambda engine: engine.scheduler.cache_manager.check_invariants())

ServeConfig's other fields pass through: running_server(llm, api_key="k", ssl_certfile=..., ssl_keyfile=...)
serves https (server.url = "https://127.0.0.1:PORT"); ``self_signed_certificate`` makes the files.
``serve_process`` runs `kvtool serve` itself, in a process of its own (signals, exit codes, its log).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

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
    def __init__(self, app, server, thread, url: str, name: str) -> None:
        self.app, self._server, self._thread = app, server, thread
        self.url = url
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
def running_server(llm: LLM, name: str = "tiny", **options) -> Iterator[RunningServer]:
    """``options``: ServeConfig's fields (api_key, ssl_certfile, max_request_bytes, ...)."""
    port = free_port()
    config = ServeConfig(**{"port": port, "served_model_name": name, "log_level": "warning", "drain_timeout_s": 2.0,
                            **options})
    app = create_app(llm, served_model_name=name, config=config)
    server = uvicorn_server(app, config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("kvtool serve did not start")
        time.sleep(0.01)
    try:
        yield RunningServer(app, server, thread, f"{config.scheme}://127.0.0.1:{port}", name)
    finally:
        server.should_exit = True
        thread.join(15)


def self_signed_certificate(directory: Path, name: str = "kvtool test") -> tuple[Path, Path]:
    """(cert.pem, key.pem): a certificate for 127.0.0.1 and localhost that signs itself, so it is its own CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    directory.mkdir(parents=True, exist_ok=True)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@contextlib.contextmanager
def serve_process(plan: Path, log_path: Path, *args) -> Iterator[tuple[subprocess.Popen, str]]:
    """`kvtool serve --plan PLAN ARGS` in a process of its own, once /health answers: (the process, its URL).
    Its stdout and stderr go to ``log_path``; a process still running at the end is killed."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "kvtool"), "serve", "--plan", str(plan), "--port", str(port),
               "--max_tokens_in_paged_kv_cache", "4096", *map(str, args)]
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def read_http_response(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of one HTTP/1.1 response with a Content-Length, read from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        received = sock.recv(65536)
        assert received, f"the server closed the connection after {data!r}"
        data += received
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body)
