"""kvtool serve --api_key: every /v1 route wants 'Authorization: Bearer KEY', and answers 401 in OpenAI's
error format otherwise (the openai client raises AuthenticationError); /health and /metrics stay open.
Over https (--ssl_certfile/--ssl_keyfile), the openai client talks to it trusting only the server's
self-signed certificate."""

from __future__ import annotations

import ssl

import httpx
import openai
import pytest
from serve_helpers import TIMEOUT_S, running_server, self_signed_certificate, tiny_llm

KEY = "kvtool-test-key-1f2e3d"
V1_ROUTES = [("GET", "/v1/models", None),
             ("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2}),
             ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})]


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def server(tiny_llama_plan, certificate):
    cert, key = certificate
    llm = tiny_llm(tiny_llama_plan)
    with running_server(llm, api_key=KEY, ssl_certfile=str(cert), ssl_keyfile=str(key)) as running:
        yield running


@pytest.fixture(scope="module")
def trusted(certificate):
    """An SSL context that trusts the test certificate alone (not the system's CAs)."""
    return ssl.create_default_context(cafile=str(certificate[0]))


def send(server, trusted, method, path, body, headers):
    return httpx.request(method, server.url + path, json=body, headers=headers, verify=trusted, timeout=TIMEOUT_S)


@pytest.mark.parametrize("headers, code", [
    ({}, None),
    ({"Authorization": "Bearer not-the-key"}, "invalid_api_key"),
    ({"Authorization": f"Bearer {KEY}x"}, "invalid_api_key"),
    ({"Authorization": f"Basic {KEY}"}, None),
    ({"Authorization": "Bearer"}, None),
    ({"X-Api-Key": KEY}, None),
], ids=["none", "wrong", "longer", "basic", "empty", "other-header"])
@pytest.mark.parametrize("method, path, body", V1_ROUTES, ids=[path for _, path, _ in V1_ROUTES])
def test_every_v1_route_answers_401_without_the_key(server, trusted, method, path, body, headers, code):
    answer = send(server, trusted, method, path, body, headers)
    assert answer.status_code == 401
    assert answer.headers["www-authenticate"] == "Bearer"
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, code)
    assert "Authorization" in error["message"] or "--api_key" in error["message"]
    assert KEY not in error["message"]


@pytest.mark.parametrize("method, path, body", V1_ROUTES, ids=[path for _, path, _ in V1_ROUTES])
def test_every_v1_route_answers_with_the_key(server, trusted, method, path, body):
    for scheme in ("Bearer", "bearer"):
        assert send(server, trusted, method, path, body, {"Authorization": f"{scheme} {KEY}"}).status_code == 200


def test_health_and_metrics_stay_open(server, trusted):
    assert send(server, trusted, "GET", "/health", None, {}).json() == {"status": "ok"}
    metrics = send(server, trusted, "GET", "/metrics", None, {})
    assert metrics.status_code == 200 and "kvtool_reused_blocks_total" in metrics.text


def test_the_openai_client_over_https_with_the_key(server, trusted):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S,
                           http_client=openai.DefaultHttpxClient(verify=trusted))
    assert [model.id for model in client.models.list()] == ["tiny"]
    answer = client.completions.create(model="tiny", prompt="The KV cache", max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 3
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_the_openai_client_raises_authentication_error_without_the_right_key(server, trusted):
    for key in ("wrong-key", KEY[:-1]):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=TIMEOUT_S,
                               http_client=openai.DefaultHttpxClient(verify=trusted))
        with pytest.raises(openai.AuthenticationError) as raised:
            client.completions.create(model="tiny", prompt=[1, 2], max_tokens=2)
        assert raised.value.status_code == 401


def test_a_client_that_does_not_trust_the_certificate_is_refused(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S)
    with pytest.raises(openai.APIConnectionError):
        client.models.list()  # the system's CAs do not know a self-signed certificate
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(server.url + "/health", timeout=TIMEOUT_S)
