"""kvtool/bench/http_stream.py reuses keep-alive connections; a server closes idle ones (uvicorn after 5 s).
A request sent on a connection the server closed meanwhile is sent again on a new one, even when every
other idle connection was closed too (a bench --endpoint trace replay with pauses between arrivals)."""

from __future__ import annotations

import asyncio

from kvtool.bench.http_stream import StreamingClient

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


async def _serve_then_close_idle():
    """A server answering one request per connection's turn, and the writers of the connections it holds."""
    writers = []

    async def handle(reader, writer):
        writers.append(writer)
        while True:
            line = await reader.readline()
            if not line:
                return
            length = 0
            while line not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
                line = await reader.readline()
            await reader.readexactly(length)
            writer.write(ANSWER)
            await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, writers


def test_a_request_on_connections_the_server_closed_while_idle_is_sent_on_a_new_one():
    async def scenario():
        server, writers = await _serve_then_close_idle()
        port = server.sockets[0].getsockname()[1]
        client = StreamingClient(f"http://127.0.0.1:{port}")
        answers = []

        async def read(response):
            answers.append((response.status, await response.read()))

        # Three requests at once: three connections, idle once answered.
        await asyncio.gather(*(client.post("/x", b"{}", read) for _ in range(3)))
        for writer in writers:  # the server closes every idle connection
            writer.close()
        await asyncio.sleep(0.05)
        await client.post("/x", b"{}", read)
        await client.aclose()
        server.close()
        return answers

    assert asyncio.run(scenario()) == [(200, b"ok")] * 4
