"""kvtool serve speaks OpenAI's API: completions and chat, streamed or whole, token ids or text in,
the reuse of each request in its usage, the models, health and Prometheus metrics routes; the
official `openai` client works against it unchanged."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serve_helpers import TIMEOUT_S, running_server, tiny_llm

from kvtool import SamplingParams

PROMPT_IDS = list(range(3, 3 + 40))  # two full 16-token blocks and a partial one


@pytest.fixture(scope="module")
def llm(tiny_llama_plan):
    return tiny_llm(tiny_llama_plan)


@pytest.fixture(scope="module")
def server(llm):
    with running_server(llm) as running:
        yield running


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=TIMEOUT_S)


def sse_events(server, path, body) -> list:
    """The data of every server-sent event, '[DONE]' included, in order."""
    events = []
    with httpx.stream("POST", server.url + path, json=body, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_a_completion_of_token_ids_matches_the_llm_api_and_reports_its_reuse(server, llm):
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    first = post(server, "/v1/completions", body).json()
    again = post(server, "/v1/completions", body).json()

    choice = first["choices"][0]
    expected = llm.generate(PROMPT_IDS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert choice["token_ids"] == expected.outputs[0].token_ids
    assert choice["text"] == expected.outputs[0].text
    assert choice["finish_reason"] == "length"
    assert first["object"] == "text_completion" and first["model"] == "tiny"
    assert first["usage"]["prompt_tokens"] == 40 and first["usage"]["completion_tokens"] == 6
    # The second request finds both full prompt blocks cached.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert again["choices"][0]["token_ids"] == choice["token_ids"]


def test_a_text_prompt_is_tokenized_with_the_plans_tokenizer(server, llm):
    answer = post(server, "/v1/completions", {"prompt": "Hello, kvtool", "max_tokens": 3, "temperature": 0,
                                              "ignore_eos": True, "return_token_ids": True}).json()
    assert answer["choices"][0]["prompt_token_ids"] == llm.tokenizer.encode("Hello, kvtool")
    assert answer["usage"]["completion_tokens"] == 3


def test_streamed_completion_sends_one_event_per_token_then_usage_then_done(server):
    events = sse_events(server, "/v1/completions", {
        "prompt": PROMPT_IDS, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True})
    assert events[-1] == "[DONE]"
    usage_event, token_events = events[-2], events[:-2]
    assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] == 5
    assert "cached_tokens" in usage_event["usage"]["prompt_tokens_details"]
    assert sum(len(e["choices"][0]["token_ids"]) for e in token_events) == 5
    assert [e["choices"][0]["finish_reason"] for e in token_events][-1] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in token_events[:-1])


def test_chat_completion_uses_a_plain_template_for_a_model_without_one(server, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    answer = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "ignore_eos": True,
                                                   "temperature": 0, "return_token_ids": True}).json()
    expected_prompt = llm.tokenizer.encode("system: Be brief.\nuser: Hi\nassistant: ")
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["choices"][0]["prompt_token_ids"] == expected_prompt
    assert answer["usage"]["prompt_tokens"] == len(expected_prompt)

    events = sse_events(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "ignore_eos": True,
                                                         "temperature": 0, "stream": True})
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == \
        answer["choices"][0]["message"]["content"]


def test_models_health_and_metrics(server):
    models = httpx.get(server.url + "/v1/models", timeout=TIMEOUT_S).json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["owned_by"] == "kvtool"
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200
    post(server, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 2})
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT_S).text
    for name in ("kvtool_reused_blocks_total", "kvtool_missed_blocks_total", "kvtool_cache_hit_rate",
                 "kvtool_offloaded_blocks_total", "kvtool_onboarded_bytes_total", "kvtool_num_requests_running",
                 "kvtool_num_requests_waiting", "kvtool_time_to_first_token_seconds_bucket",
                 "kvtool_e2e_request_latency_seconds_count"):
        assert f"\n{name}" in text, name
    counts = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("kvtool_")}
    assert counts["kvtool_time_to_first_token_seconds_count"] >= 1
    assert counts["kvtool_num_requests_running"] == 0


def test_the_official_openai_client_streaming_and_not(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT_S)
    completion = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 4
    assert completion.usage.prompt_tokens_details.cached_tokens >= 32  # earlier tests computed this prompt

    chunks = list(client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == completion.choices[0].text
    assert chunks[-1].usage.completion_tokens == 4

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=3, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_top_k_minus_one_is_every_token_as_vllm_and_sglang_spell_it(server):
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 1.0, "seed": 4, "ignore_eos": True}
    answers = [post(server, "/v1/completions", {**body, "top_k": top_k}) for top_k in (-1, 0)]
    assert [answer.status_code for answer in answers] == [200, 200]
    assert answers[0].json()["choices"][0]["text"] == answers[1].json()["choices"][0]["text"]


def test_a_cache_salt_keeps_tenants_apart_and_a_priority_is_accepted(server):
    base = {"prompt": [7] * 48, "max_tokens": 1, "temperature": 0}
    assert post(server, "/v1/completions", {**base, "cache_salt": "tenant-a", "priority": 90}).status_code == 200
    other_tenant = post(server, "/v1/completions", {**base, "cache_salt": "tenant-b"}).json()
    same_tenant = post(server, "/v1/completions", {**base, "cache_salt": "tenant-a"}).json()
    assert other_tenant["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # All but the last prompt token: two full blocks, and 15 tokens copied from the third (partial reuse).
    assert same_tenant["usage"]["prompt_tokens_details"]["cached_tokens"] == 47


def test_a_stop_string_ends_the_text_before_it(server, llm):
    # The stop string is a piece of what greedy decoding generates anyway.
    full = post(server, "/v1/completions", {"prompt": "abc", "max_tokens": 12, "temperature": 0,
                                            "ignore_eos": True}).json()["choices"][0]["text"]
    stop = full[3:5]
    if not stop or stop in full[:3]:
        pytest.skip("this seed's output has no usable stop string")
    cut = post(server, "/v1/completions", {"prompt": "abc", "max_tokens": 12, "temperature": 0,
                                           "stop": stop}).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full[:full.find(stop)]


def test_chat_uses_the_plans_chat_template(tmp_path_factory):
    pytest.importorskip("gguf", reason="the GGUF fixture needs the optional extra kvtool[gguf]")
    pytest.importorskip("accelerate", reason="the GGUF fixture needs the optional extra kvtool[gguf]")
    from gguf_files import write_tiny_llama_gguf

    from kvtool.plan import BuildOptions, build_plan

    gguf = write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "chat.gguf")
    plan = build_plan(str(gguf.path), tmp_path_factory.mktemp("plan") / "chat", BuildOptions(tokens_per_block=8,
                                                                                               max_seq_len=256))
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Where is it?"}]
    llm = tiny_llm(plan)
    with running_server(llm, name="chat") as server:
        answer = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 3, "temperature": 0,
                                                       "return_token_ids": True}).json()
    assert answer["choices"][0]["prompt_token_ids"] == llm.tokenizer.apply_chat_template(messages)
