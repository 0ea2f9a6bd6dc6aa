"""A bad request gets an OpenAI-style error naming what is wrong, with status 400 (404 for a model the
server does not serve), and the server goes on serving the next request."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_helpers import TIMEOUT_S, running_server, tiny_llm


@pytest.fixture(scope="module")
def server(tiny_llama_plan):
    with running_server(tiny_llm(tiny_llama_plan, max_seq_len=256)) as running:
        yield running


# Greedy: a sampled token may be EOS (about 1 in 1,000 on the random tiny model), which ends the answer early.
GOOD = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}

BAD_REQUESTS = [
    # (what is sent, the field named, words of the message)
    ({"prompt": [5, 6, 7], "max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"prompt": [5, 6, 7], "temperature": "hot"}, "temperature", "valid number"),
    ({"prompt": 17}, "prompt", "prompt"),
    ({"max_tokens": 2}, "prompt", "field required"),
    ({"prompt": [5, 6, 7], "stream": "yes"}, "stream", "valid boolean"),
    ({"prompt": [1] * 256}, "prompt", "max_seq_len is 256"),
    ({"prompt": [5, 6, 1024]}, "prompt", "outside the model's vocabulary [0, 1024)"),
    ({"prompt": [5, 6, -1]}, "prompt", "outside the model's vocabulary"),
    ({"prompt": [5, 6, 7], "max_tokens": 0}, "max_tokens", "must be >= 1, got 0"),
    ({"prompt": [5, 6, 7], "temperature": -1.0}, "temperature", "must be >= 0"),
    ({"prompt": [5, 6, 7], "top_p": 0.0}, "top_p", "must be in (0, 1]"),
    ({"prompt": [5, 6, 7], "top_k": -2}, "top_k", "must be >= 0, or -1 (0 and -1: every token), got -2"),
    ({"prompt": [5, 6, 7], "priority": 101}, "priority", "must be in 0..100"),
    ({"prompt": [5, 6, 7], "presence_penalty": 0.5}, "presence_penalty",
     "presence_penalty=0.5: kvtool serve does not apply it (it samples by temperature, top_p and top_k); leave it "
     "out or send 0.0"),
    ({"prompt": [5, 6, 7], "repetition_penalty": 1.1}, "repetition_penalty", "leave it out or send 1.0"),
    ({"prompt": [5, 6, 7], "min_p": 0.05}, "min_p", "min_p=0.05: kvtool serve does not apply it"),
    ({"prompt": [5, 6, 7], "logit_bias": {"5": 10}}, "logit_bias", "leave it out or send null"),
    ({"prompt": [5, 6, 7], "n": 2}, "n", "one choice per request"),
    ({"prompt": ""}, "prompt", "empty"),
]


@pytest.mark.parametrize("body, field, words", BAD_REQUESTS, ids=[f"{f}:{w}" for _, f, w in BAD_REQUESTS])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_each_bad_request_gets_its_400_and_the_next_is_served(server, body, field, words, stream):
    if stream and "stream" not in body:
        body = {**body, "stream": True}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT_S)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == field and error["code"] == 400 and error["type"] == "invalid_request_error"
    assert words.lower() in error["message"].lower(), error["message"]
    assert "\n" not in error["message"]

    good = httpx.post(server.url + "/v1/completions", json=GOOD, timeout=TIMEOUT_S)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_other_engines_sampling_controls_are_accepted_where_they_change_nothing(server):
    body = {**GOOD, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "min_p": 0,
            "logit_bias": {}}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT_S)
    assert answer.status_code == 200, answer.text


def test_malformed_bodies_and_chat_messages(server):
    not_json = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=TIMEOUT_S)
    assert not_json.status_code == 400 and "not JSON" in not_json.json()["error"]["message"]
    a_list = httpx.post(server.url + "/v1/completions", json=[GOOD], timeout=TIMEOUT_S)
    assert a_list.status_code == 400 and "JSON object" in a_list.json()["error"]["message"]
    no_messages = httpx.post(server.url + "/v1/chat/completions", json={"messages": []}, timeout=TIMEOUT_S)
    assert no_messages.status_code == 400 and no_messages.json()["error"]["param"] == "messages"
    bad_role = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": 3, "content": "x"}]},
                          timeout=TIMEOUT_S)
    assert bad_role.status_code == 400 and bad_role.json()["error"]["param"] == "messages.role"
    assert httpx.post(server.url + "/v1/completions", json=GOOD, timeout=TIMEOUT_S).status_code == 200


def test_a_model_the_server_does_not_serve_is_404(server):
    answer = httpx.post(server.url + "/v1/completions", json={**GOOD, "model": "gpt-9"}, timeout=TIMEOUT_S)
    assert answer.status_code == 404
    assert "'gpt-9' does not exist" in answer.json()["error"]["message"]


def test_the_openai_client_raises_bad_request_with_the_servers_message(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_seq_len is 256"):
        client.completions.create(model="tiny", prompt=[1] * 300, max_tokens=2)
    assert client.completions.create(model="tiny", prompt=[1, 2], max_tokens=2).usage.completion_tokens == 2


def test_max_tokens_beyond_max_seq_len_generates_up_to_it(server):
    answer = httpx.post(server.url + "/v1/completions", json={"prompt": [1] * 250, "max_tokens": 100,
                                                                "ignore_eos": True}, timeout=TIMEOUT_S).json()
    assert answer["usage"]["completion_tokens"] == 6 and answer["choices"][0]["finish_reason"] == "length"
