"""`kvtool serve`'s flags: a mistake is a one-line error naming the flag, before any model is loaded."""

from __future__ import annotations

import socket

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from kvtool.bench.config import ENGINE_FLAG_NAMES
from kvtool.cli import app


def invoke(*args):
    return CliRunner().invoke(app, ["serve", *map(str, args)])


@pytest.mark.parametrize("args, message", [
    ([], "give --plan DIR (from `kvtool build`) or --model preset:NAME"),
    (["--plan", "p", "--model", "preset:tiny-llama"], "give --plan DIR or --model preset:NAME, not both"),
    (["--model", "preset:tiny-llama", "--port", 70000], "--port must be in 0..65535, got 70000"),
    (["--model", "preset:tiny-llama", "--drain_timeout", -1], "--drain_timeout must be >= 0 seconds"),
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
