"""`kvtool bench --endpoint` against secured and hosted servers: the API key goes as a Bearer token
(from --api_key or $OPENAI_API_KEY) and is never printed or written, --header reaches the server on
every request, https checks the server's certificate (--ca_cert for a private authority), and a
refused key or a failed check is one line before the replay starts.

The servers here are the test's own (tests/endpoint_servers.py): kvtool serve's app behind a small
Bearer check, served by uvicorn over http or https (a self-signed certificate made in the test), so
these tests do not depend on how `kvtool serve` itself checks keys.
"""

from __future__ import annotations

import csv

import pytest
from endpoint_servers import BearerCheck, self_signed_certificate, serving
from serve_helpers import tiny_llm
from typer.testing import CliRunner

from kvtool import KvCacheConfig
from kvtool.workloads.datasets import write_jsonl
from kvtool.bench.endpoint import EndpointOptions
from kvtool.bench.endpoint_access import EndpointAccess
from kvtool.cli import app
from kvtool.serve import create_app

KEY = "sk-test-0123456789abcdef"
POOL = KvCacheConfig(max_tokens=1024)


def invoke(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def one_line(output: str) -> str:
    return " ".join(output.split())


@pytest.fixture
def dataset(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", [{"input_ids": list(range(40, 72)) + [i], "output_tokens": 3}
                                              for i in range(3)])


@pytest.fixture(scope="module")
def secured(tiny_llama_plan):
    """kvtool serve's app behind a Bearer check of KEY on every /v1 route (the URL, the check)."""
    check = BearerCheck(create_app(tiny_llm(tiny_llama_plan, kv_cache_config=POOL), served_model_name="tiny"), KEY)
    with serving(check) as url:
        yield url, check


@pytest.fixture(scope="module")
def https_server(tiny_llama_plan, tmp_path_factory):
    """kvtool serve's app over https with a self-signed certificate: (URL, cert.pem)."""
    cert_file, key_file = self_signed_certificate(tmp_path_factory.mktemp("tls"))
    with serving(create_app(tiny_llm(tiny_llama_plan, kv_cache_config=POOL), served_model_name="tiny"),
                 (cert_file, key_file)) as url:
        yield url, cert_file


def files_under(directory):
    return {path: path.read_text() for path in directory.rglob("*") if path.is_file()}


def test_a_server_that_wants_a_key_is_refused_in_one_line_before_the_replay(secured, dataset, tmp_path, monkeypatch):
    url, check = secured
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    check.seen.clear()
    result = invoke("bench", "--endpoint", url, "--dataset", dataset, "--output", tmp_path / "o")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert ("HTTP 401: the server refused the API key (none was given): give --api_key KEY or set OPENAI_API_KEY"
            in one_line(result.output))
    assert check.paths() == ["/v1/models"]  # nothing was replayed
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("given", ["flag", "environment"])
def test_the_key_goes_as_a_bearer_token_with_the_headers_and_is_never_shown(secured, dataset, tmp_path, monkeypatch,
                                                                          given):
    url, check = secured
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    if given == "environment":
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
    key_flag = ["--api_key", KEY] if given == "flag" else []
    check.seen.clear()
    result = invoke("bench", "--endpoint", url, *key_flag, "--header", "X-Org-Id: acme", "--header", "x-trace:a:b",
                    "--dataset", dataset, "--mode", "sequential", "--output", tmp_path / "o")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader((tmp_path / "o" / "requests.csv").open()))
    assert len(rows) == 3 and not any(row["error"] for row in rows)
    paths = check.paths()
    assert paths.count("/v1/completions") == 3 and "/v1/models" in paths and "/metrics" in paths
    for path, headers in check.seen:
        assert (headers.get("authorization"), headers.get("x-org-id"), headers.get("x-trace")) == (
            f"Bearer {KEY}", "acme", "a:b"), path
    assert KEY not in result.output
    assert not [path for path, text in files_under(tmp_path / "o").items() if KEY in text]


def test_a_wrong_key_is_named_by_where_it_came_from_and_not_shown(secured, dataset, tmp_path, monkeypatch):
    url, _ = secured
    wrong = "sk-wrong-key-42"
    monkeypatch.setenv("OPENAI_API_KEY", wrong)
    result = invoke("bench", "--endpoint", url, "--dataset", dataset, "--output", tmp_path / "o")
    assert result.exit_code == 2
    assert ("HTTP 401: the server refused the API key from $OPENAI_API_KEY: check it, or give another with "
            "--api_key KEY or OPENAI_API_KEY") in one_line(result.output)
    assert wrong not in result.output


def test_a_key_refused_only_by_the_completions_route_fails_every_request_with_that_line(tiny_llama_plan, dataset,
                                                                                      tmp_path, monkeypatch):
    """A server whose model list is open: the replay runs, every request is an error row saying why
    (the server's message, which quotes the key, is not kept), and the bench exits 3."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    check = BearerCheck(create_app(tiny_llm(tiny_llama_plan, kv_cache_config=POOL), served_model_name="tiny"), KEY,
                        protected=("/v1/completions",))
    wrong = "sk-wrong-key-42"
    with serving(check) as url:
        result = invoke("bench", "--endpoint", url, "--api_key", wrong, "--dataset", dataset,
                        "--output", tmp_path / "o")
    assert result.exit_code == 3, result.output
    text = one_line(result.output)
    assert "3 of 3 requests failed; their error:" in text
    assert "3 × HTTP 401: the server refused the API key from --api_key: check it" in text
    assert wrong not in result.output
    assert not [path for path, content in files_under(tmp_path / "o").items() if wrong in content]


@pytest.mark.parametrize("args, message", [
    (["--header", "X-Org-Id acme"], "--header 'X-Org-Id' ... has no ':': give NAME:VALUE"),
    (["--header", "Bad Name: x"], "--header name 'Bad Name' is not a header name"),
    (["--header", "Content-Length: 5"], "--header Content-Length is written by kvtool itself"),
    (["--header", "X-A: b\r\nX-Injected: c"], "--header X-A's value holds a line break"),
    (["--api_key", ""], "--api_key is empty"),
    (["--ca_cert", "missing.pem"], "--ca_cert missing.pem is not a file"),
    (["--endpoint", "http://user:secret@127.0.0.1:9"], "--endpoint holds credentials (user:password@)"),
])
def test_access_mistakes_are_one_line_errors_naming_the_flag(tmp_path, dataset, args, message):
    if "--endpoint" not in args:
        args = ["--endpoint", "https://127.0.0.1:9", *args]
    result = invoke("bench", *args, "--dataset", dataset, "--output", tmp_path / "o")
    assert result.exit_code == 2
    assert message in one_line(result.output)
    assert "Traceback" not in result.output and "secret" not in result.output


def test_access_flags_without_an_endpoint_are_refused(tmp_path, dataset):
    result = invoke("bench", "--model", "preset:tiny-llama", "--header", "X: y", "--dataset", dataset)
    assert result.exit_code == 2
    assert "--header goes with --endpoint URL" in one_line(result.output)


def test_https_checks_the_certificate_and_ca_cert_trusts_a_private_one(https_server, dataset, tmp_path):
    url, cert_file = https_server
    unchecked = invoke("bench", "--endpoint", url, "--dataset", dataset, "--output", tmp_path / "no")
    assert unchecked.exit_code == 2
    assert ("the server's certificate failed the check (self-signed certificate): give --ca_cert FILE"
            in one_line(unchecked.output))
    assert not (tmp_path / "no").exists()

    result = invoke("bench", "--endpoint", url, "--ca_cert", cert_file, "--dataset", dataset, "--output",
                    tmp_path / "ok")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader((tmp_path / "ok" / "requests.csv").open()))
    assert len(rows) == 3 and not any(row["error"] for row in rows) and rows[0]["endpoint"] == url + "/v1"
    summary, = csv.DictReader((tmp_path / "ok" / "summary.csv").open())
    assert summary["reused_blocks"] != ""  # /metrics was read over https too

    other_cert, _ = self_signed_certificate(tmp_path / "other", name="another authority")
    wrong = invoke("bench", "--endpoint", url, "--ca_cert", other_cert, "--dataset", dataset, "--output",
                   tmp_path / "wrong")
    assert wrong.exit_code == 2
    assert f"the server's certificate failed the check against --ca_cert {other_cert}" in one_line(wrong.output)


def test_scheme_and_certificate_file_mistakes_say_what_to_do(https_server, secured, dataset, tmp_path):
    https_url, _ = https_server
    http_url, _ = secured
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    cases = [
        (["--endpoint", https_url, "--ca_cert", not_pem], f"--ca_cert {not_pem} holds no PEM certificate"),
        (["--endpoint", http_url, "--ca_cert", not_pem], f"--ca_cert {not_pem} checks an https server's "
                                                         f"certificate, but --endpoint {http_url}/v1 is plain http"),
        (["--endpoint", http_url.replace("http:", "https:")], "the TLS handshake failed"),
        (["--endpoint", https_url.replace("https:", "http:")], "without sending a response.): if it serves https, "
                                                          "use https://"),
    ]
    for args, message in cases:
        result = invoke("bench", *args, "--dataset", dataset, "--output", tmp_path / "o")
        assert result.exit_code == 2, (args, result.output)
        assert message in one_line(result.output), (args, result.output)
        assert "Traceback" not in result.output


def test_the_key_is_kept_out_of_the_options_repr_and_out_of_what_a_server_echoes():
    access = EndpointAccess(api_key=KEY, headers=(("X-Secret", "s3cr3t"),))
    options = EndpointOptions(url="https://example.com", access=access)
    assert KEY not in repr(options) and "s3cr3t" not in repr(options)
    assert access.redact(f"Incorrect API key provided: {KEY}.") == "Incorrect API key provided: <api key>."
    assert access.request_headers() == {"Authorization": f"Bearer {KEY}", "X-Secret": "s3cr3t"}
    # A header of the same name (in any case) replaces the key's Authorization.
    assert EndpointAccess(api_key=KEY, headers=(("authorization", "Basic eA=="),)).request_headers() == {
        "authorization": "Basic eA=="}
