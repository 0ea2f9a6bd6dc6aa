"""`kvtool serve`'s flags: a mistake is a one-line error naming the flag, before any model is loaded."""

from __future__ import annotations

import socket

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from kvtool.flags import ENGINE_FLAG_NAMES
from kvtool.cli import app


def invoke(*args):
    return CliRunner().invoke(app, ["serve", *map(str, args)])


@pytest.mark.parametrize("args, message", [
    ([], "give --plan DIR (from `kvtool build`) or --model preset:NAME"),
    (["--plan", "p", "--model", "preset:tiny-llama"], "give --plan DIR or --model preset:NAME, not both"),
    (["--model", "preset:tiny-llama", "--port", 70000], "--port must be in 0..65535, got 70000"),
    (["--model", "preset:tiny-llama", "--shutdown_timeout", -1], "--shutdown_timeout must be >= 0 seconds"),
    (["--model", "preset:tiny-llama", "--api_key", ""], "--api_key is empty"),
    (["--model", "preset:tiny-llama", "--api_key", "two words"], "--api_key must be printable ASCII without spaces"),
    (["--model", "preset:tiny-llama", "--max_request_bytes", 0], "--max_request_bytes must be at least 1 KiB"),
    (["--model", "preset:tiny-llama", "--max_request_bytes", "8XB"], "--max_request_bytes byte size '8XB' is not"),
    (["--model", "preset:tiny-llama", "--ssl_keyfile", __file__], "--ssl_keyfile needs --ssl_certfile too"),
    (["--model", "preset:tiny-llama", "--ssl_certfile", "no/cert.pem"], "--ssl_certfile no/cert.pem: no such file"),
    (["--model", "preset:tiny-llama", "--served_model_name", " "], "--served_model_name is empty"),
    (["--model", "preset:tiny-llama", "--max_batch_size", 0], "--max_batch_size must be a positive integer"),
    (["--model", "preset:tiny-llama", "--enable_kv_cache_reuse", "--disable_kv_cache_reuse"], "contradict"),
])
def test_serve_mistakes_are_one_line_errors(args, message):
    result = invoke(*args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_a_port_in_use_is_refused_before_the_model_loads():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = invoke("--model", "preset:no-such-preset", "--port", port)
    assert result.exit_code == 2
    assert f"--host 127.0.0.1 --port {port}: cannot listen there (address already in use)" in result.output


def test_serve_and_bench_declare_the_engine_flags_once():
    commands = get_command(app).commands
    bench = {p.name: p for p in commands["bench"].params}
    serve = {p.name: p for p in commands["serve"].params}
    for name in (*ENGINE_FLAG_NAMES, "plan", "model", "plan_cache_dir", "disable_kv_cache_reuse"):
        assert (serve[name].opts, serve[name].help) == (bench[name].opts, bench[name].help), name


def test_a_certificate_that_does_not_load_is_refused_before_the_model_loads(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("not a certificate\n")
    result = invoke("--model", "preset:no-such-preset", "--ssl_certfile", cert, "--ssl_keyfile", cert)
    assert result.exit_code == 2
    assert f"--ssl_certfile {cert} --ssl_keyfile {cert}: cannot load the certificate and its key" in \
        " ".join(result.output.split())


def test_the_api_key_comes_from_kvtool_api_key_and_is_never_shown(monkeypatch):
    monkeypatch.setenv("KVTOOL_API_KEY", "two words")
    result = invoke("--model", "preset:tiny-llama")
    assert result.exit_code == 2 and "$KVTOOL_API_KEY must be printable ASCII" in " ".join(result.output.split())
    monkeypatch.setenv("KVTOOL_API_KEY", "")
    result = invoke("--model", "preset:tiny-llama")
    assert result.exit_code == 2 and "$KVTOOL_API_KEY is set but empty" in " ".join(result.output.split())
    monkeypatch.setenv("KVTOOL_API_KEY", "s3cret-key")
    assert "s3cret-key" not in invoke("--help").output


def test_an_encrypted_key_is_refused_instead_of_asking_for_its_password(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from serve_helpers import self_signed_certificate

    cert, key = self_signed_certificate(tmp_path)
    private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.BestAvailableEncryption(b"passphrase")))
    result = invoke("--model", "preset:no-such-preset", "--ssl_certfile", cert, "--ssl_keyfile", key)
    assert result.exit_code == 2
    assert f"--ssl_keyfile {key}: the private key is encrypted" in " ".join(result.output.split())
