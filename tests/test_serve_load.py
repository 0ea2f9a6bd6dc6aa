"""kvtool serve under load and at its edges: many streams at once batched by one scheduler, and clients
that go away mid-answer (their blocks are freed). Ctrl-C / SIGTERM: test_serve_shutdown.py."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from serve_helpers import TIMEOUT_S, running_server, tiny_llm

NUM_STREAMS = 64


@pytest.fixture(scope="module")
def server(tiny_llama_plan):
    with running_server(tiny_llm(tiny_llama_plan)) as running:
        yield running


def no_blocks_held(server) -> None:
    """Nothing runs, no primary block is referenced, and the cache manager's invariants hold."""
    server.wait_idle()
    stats = server.call(lambda engine: engine.get_stats())
    assert stats["primary_used_blocks"] == 0
    assert server.call(lambda engine: engine.scheduler.cache_manager.check_invariants()) == []


def test_64_concurrent_streams_all_complete(server):
    async def one(client, index):
        body = {"prompt": [index % 7 + 1] * 20 + [index + 100], "max_tokens": 8, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        num_tokens, done, usage = 0, False, None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if event["choices"]:
                        num_tokens += 1 if event["choices"][0]["text"] is not None else 0
                    usage = event.get("usage") or usage
        return done, usage["completion_tokens"]

    async def all_streams():
        limits = httpx.Limits(max_connections=NUM_STREAMS)
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(NUM_STREAMS))), 120)

    results = asyncio.run(all_streams())
    assert results == [(True, 8)] * NUM_STREAMS
    no_blocks_held(server)


def num_aborted(server) -> int:
    """kvtool_aborted_requests_total, as /metrics reports it."""
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT_S).text
    return int(float(next(line.split()[1] for line in text.splitlines()
                          if line.startswith("kvtool_aborted_requests_total "))))


def test_a_client_that_drops_mid_stream_frees_its_blocks(server):
    aborted = num_aborted(server)
    body = {"prompt": list(range(1, 70)), "max_tokens": 800, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT_S) as response:
        events = response.iter_lines()
        assert next(line for line in events if line.startswith("data: "))
        running = server.call(lambda engine: engine.get_stats())["primary_used_blocks"]
        assert running >= 5  # the request holds its prompt's blocks while it streams
    # Leaving the block closed the connection after one event of 800.
    no_blocks_held(server)
    assert num_aborted(server) == aborted + 1
    assert httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2},
                      timeout=TIMEOUT_S).status_code == 200


def test_a_client_that_drops_while_waiting_for_a_whole_answer_frees_its_blocks(server):
    aborted = num_aborted(server)
    request = json.dumps({"prompt": list(range(1, 70)), "max_tokens": 800, "ignore_eos": True}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(request) + request)
        deadline = time.monotonic() + 10
        while not server.call(lambda engine: engine.scheduler.num_running_requests()):
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    no_blocks_held(server)
    assert num_aborted(server) == aborted + 1
