"""The floor proxy that ``proxy_overhead`` measures beside the host
(:mod:`benchmarks.floor_proxy`) relays llama-server's answers whole, or its figure would
be the figure of a proxy that does less than forward: a unary answer and a stream on one
keep-alive client connection, and an error, against a real llama-server.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import httpx
import trio

from benchmarks.floor_proxy import serve
from gezel_trio.engine.ports import free_port

from ._engine_bin import open_llama_server

CHAT = {
    "messages": [{"role": "user", "content": "The quick brown fox"}],
    "max_tokens": 8,
    "temperature": 0,
}
STREAM = {"prompt": "The quick brown fox", "n_predict": 8, "temperature": 0, "stream": True}


def _streamed_text(body: bytes) -> tuple[str, bool]:
    """(the text of a ``/completion`` stream, whether it ended with its ``stop`` event)."""
    text, stopped = "", False
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            text += event.get("content", "")
            stopped = stopped or bool(event.get("stop"))
    return text, stopped


async def test_the_floor_proxy_relays_answers_whole_on_one_client_connection(
    tiny_model: Path,
) -> None:
    port = free_port()
    connects = 0

    async def count(name: str, info: object) -> None:
        nonlocal connects
        connects += name == "connection.connect_tcp.complete"

    with trio.fail_after(120):
        async with (
            open_llama_server(tiny_model, parallel=1, ctx=1024) as engine,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(partial(serve, port, int(engine.base_url.rsplit(":", 1)[1])))
            async with httpx.AsyncClient(timeout=60) as client:
                direct = await client.post(engine.base_url + "/v1/chat/completions", json=CHAT)
                direct_stream = await client.post(engine.base_url + "/completion", json=STREAM)
                floor = f"http://127.0.0.1:{port}"
                while True:  # the listener is up once a connection is accepted
                    try:
                        await client.get(floor + "/health")
                        break
                    except httpx.ConnectError:
                        await trio.sleep(0.02)
                ext = {"trace": count}
                relayed = await client.post(
                    floor + "/v1/chat/completions", json=CHAT, extensions=ext
                )
                stream = await client.post(floor + "/completion", json=STREAM, extensions=ext)
                again = await client.post(floor + "/v1/chat/completions", json=CHAT, extensions=ext)
                # last: llama-server closes after an error, and its head is relayed as it is
                missing = await client.get(floor + "/no/such/route")
            nursery.cancel_scope.cancel()

    assert relayed.status_code == again.status_code == 200
    answers = [r.json()["choices"][0]["message"]["content"] for r in (direct, relayed, again)]
    assert answers[0] and answers[0] == answers[1] == answers[2]
    assert stream.headers["transfer-encoding"] == "chunked"
    text, stopped = _streamed_text(stream.content)
    assert (text, stopped) == _streamed_text(direct_stream.content) and text and stopped
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    assert connects == 0  # each 200 rode the connection the health check opened
