"""`kvtool serve` stopped by SIGTERM (Kubernetes, Slurm, CI) as a user runs it, in a process of its own:
running requests finish within --shutdown_timeout while new ones get 503; a request still running at
the end gets an error (a stream: OpenAI's error object as an event, then [DONE]); one line is logged,
no traceback (for that or for any client mistake before it), and the process exits 0."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from serve_helpers import TIMEOUT_S, read_http_response, serve_process

LONG = {"prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True}  # seconds of decoding on a CPU


def stream_of(url: str, body: dict):
    return httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT_S)


def first_event_then_rest(response, process) -> list[str]:
    """Reads the first event, sends SIGTERM, and returns the data of the events after it."""
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data: "))
    process.send_signal(signal.SIGTERM)
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def wait_until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def num_running(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT_S).text
    return int(float(re.search(r"^kvtool_num_requests_running (\S+)$", text, re.M).group(1)))


def assert_clean_log(log: str) -> None:
    """No traceback, no error line, and exactly one line about the drain."""
    assert "Traceback" not in log and "Exception in ASGI" not in log and "ERROR" not in log, log
    assert len(re.findall(r"^INFO: +SIGTERM: drained in ", log, re.M)) == 1, log


def test_sigterm_lets_running_requests_finish_and_answers_new_ones_503(tiny_llama_plan, tmp_path):
    log_path = tmp_path / "serve.log"
    with serve_process(tiny_llama_plan, log_path, "--shutdown_timeout", 60) as (process, url):
        port = int(url.rsplit(":", 1)[1])
        # A request whose body is still on its way keeps the drain open for as long as this test needs.
        body = json.dumps({"prompt": [4, 5, 6], "max_tokens": 3, "ignore_eos": True}).encode()
        uploading = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
        uploading.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:10]))
        with stream_of(url, LONG) as response:  # still running when the drain begins, finished within it
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            sent = time.monotonic()
            process.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(url + "/health", timeout=TIMEOUT_S).status_code == 503, "/health stayed 200")
            refused = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 1}, timeout=TIMEOUT_S)
            assert refused.status_code == 503
            assert refused.json()["error"]["message"].startswith("the server is shutting down")
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        uploading.sendall(body[10:])
        status, answer = read_http_response(uploading)
        uploading.close()
        assert status == 200 and answer["usage"]["completion_tokens"] == 3
        assert process.wait(timeout=15) == 0
        assert time.monotonic() - sent < 15  # the drain ended when the last request did, not after 60 s
    log = log_path.read_text()
    assert_clean_log(log)
    assert "2 of 2 requests in flight finished, 0 ended with an error" in log and "; 1 new requests refused" in log


def test_requests_still_running_after_the_grace_period_end_with_an_error_and_done(tiny_llama_plan, tmp_path):
    log_path = tmp_path / "serve.log"
    with serve_process(tiny_llama_plan, log_path, "--shutdown_timeout", 0) as (process, url):
        port = int(url.rsplit(":", 1)[1])
        make_client_mistakes(url, port)
        uploading = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)  # its body never ends
        uploading.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        whole = {}
        waiting = threading.Thread(target=lambda: whole.update(
            answer=httpx.post(url + "/v1/completions", json=LONG, timeout=TIMEOUT_S)))
        waiting.start()
        with stream_of(url, LONG) as response:
            wait_until(lambda: num_running(url) == 2, "the two requests never ran together")
            rest = first_event_then_rest(response, process)
        waiting.join(TIMEOUT_S)
        assert read_http_response(uploading) == (503, {"error": error_of(whole["answer"])})
        uploading.close()
        assert process.wait(timeout=15) == 0
    # The stream: the tokens so far, then OpenAI's error object, then [DONE].
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["code"] == 503 and error["message"].startswith("the server is shutting down: the request was ended")
    assert all(json.loads(data)["choices"][0]["finish_reason"] is None for data in rest[:-2])
    # The whole answer: a 503 with the same error object; the request still uploading its body: a 503.
    assert whole["answer"].status_code == 503 and error_of(whole["answer"]) == error
    log = log_path.read_text()
    assert_clean_log(log)
    assert "0 of 3 requests in flight finished, 3 ended with an error after the 0 s grace period" in log


def error_of(answer: httpx.Response) -> dict:
    return answer.json()["error"]


def make_client_mistakes(url: str, port: int) -> None:
    """What clients get wrong, each answered without a traceback in the server's log."""
    assert httpx.post(url + "/v1/completions", content=b"{not json", timeout=TIMEOUT_S).status_code == 400
    wrong_type = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": "5"}, timeout=TIMEOUT_S)
    assert wrong_type.status_code == 400
    chat = {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=TIMEOUT_S).status_code == 404
    assert httpx.get(url + "/v1/nothing-here", timeout=TIMEOUT_S).status_code == 404
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:  # a body over the limit
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n")
        assert read_http_response(sock)[0] == 413
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:  # gone in the middle of the body
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        time.sleep(0.2)
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:  # not HTTP at all
        sock.sendall(b"\x16\x03\x01 hello?\r\n\r\n")
        sock.recv(65536)
    with stream_of(url, LONG) as response:
        next(response.iter_lines())  # gone in the middle of the answer
    wait_until(lambda: num_running(url) == 0, "the abandoned stream still runs")


def test_ctrl_c_drains_as_sigterm_does_and_the_openai_client_raises_the_error(tiny_llama_plan, tmp_path):
    log_path = tmp_path / "serve.log"
    with serve_process(tiny_llama_plan, log_path, "--shutdown_timeout", 0) as (process, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        stream = client.completions.create(model=tiny_llama_plan.name, prompt=[1, 2, 3], max_tokens=1000, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        assert next(chunks).choices[0].finish_reason is None
        process.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError, match="the server is shutting down: the request was ended"):
            for _ in chunks:
                pass
        assert process.wait(timeout=15) == 0
    log = log_path.read_text()
    assert "Traceback" not in log and "SIGINT: drained in " in log
