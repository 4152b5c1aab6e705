"""The floor proxy that ``proxy_overhead`` measures beside the host
(:mod:`benchmarks._floor_proxy`) relays llama-server's answers whole, or its figure would
be the figure of a proxy that does less than forward: whole chat and text completions and
a stream on one keep-alive client connection, and an error, against a real llama-server;
relayed, with ``--streamed`` (a whole answer asked of the engine as a stream and
assembled: the same text, finish reason and token count as the engine's own), and with
``--hypercorn`` and ``--front`` (the same, as an ASGI app that hypercorn serves, stock or
as the host serves its own).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from benchmarks._floor_proxy import serve, serve_hypercorn
from gezel_trio.engine.ports import free_port

from ._engine_bin import open_llama_server

CHAT = {
    "messages": [{"role": "user", "content": "The quick brown fox"}],
    "max_tokens": 8,
    "temperature": 0,
}
BAD_CHAT = {"messages": "not a list", "max_tokens": 8}
"""Refused by llama-server, with a JSON error and a ``Content-Length``, streamed or not."""
TEXT = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
WHOLE = (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT))
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


@pytest.mark.parametrize("mode", ["relayed", "streamed", "hypercorn", "front"])
async def test_the_floor_proxy_forwards_answers_whole_on_one_client_connection(
    tiny_model: Path, mode: str
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
            upstream = int(engine.base_url.rsplit(":", 1)[1])
            if mode in ("hypercorn", "front"):
                nursery.start_soon(partial(serve_hypercorn, port, upstream, front=mode == "front"))
            else:
                nursery.start_soon(partial(serve, port, upstream, streamed=mode == "streamed"))
            async with httpx.AsyncClient(timeout=60) as client:
                direct = [
                    await client.post(engine.base_url + path, json=body)
                    for path, body in (*WHOLE, ("/completion", STREAM))
                ]
                floor = f"http://127.0.0.1:{port}"
                while True:  # the listener is up once a connection is accepted
                    try:
                        await client.get(floor + "/health")
                        break
                    except httpx.ConnectError:
                        await trio.sleep(0.02)
                ext = {"trace": count}
                forwarded = [
                    await client.post(floor + path, json=body, extensions=ext)
                    for path, body in (*WHOLE, ("/completion", STREAM), *WHOLE)
                ]
                # last: llama-server closes after an error, and its head is relayed as it is
                refused = await client.post(floor + "/v1/chat/completions", json=BAD_CHAT)
                direct_refused = await client.post(
                    engine.base_url + "/v1/chat/completions", json=BAD_CHAT
                )
                missing = await client.get(floor + "/no/such/route")
            nursery.cancel_scope.cancel()

    chat, text, stream, *again = forwarded
    for answer in (chat, text, *again):
        assert answer.status_code == 200, answer.text
        # an assembled answer has the proxy's own head; a relayed one, the engine's
        server = {"relayed": "llama.cpp", "streamed": None}.get(mode, "hypercorn-h11")
        assert answer.headers.get("server") == server
    for got, want in zip((chat, text, *again), direct[:2] * 2, strict=True):
        assert _whole(got.json()) == _whole(want.json()) and _whole(want.json())[0]
    assert stream.headers["transfer-encoding"] == "chunked"
    streamed_text, stopped = _streamed_text(stream.content)
    assert (streamed_text, stopped) == _streamed_text(direct[2].content)
    assert streamed_text and stopped
    assert 400 <= refused.status_code < 600 and refused.json()["error"]["message"]
    assert (refused.status_code, refused.json()) == (
        direct_refused.status_code,
        direct_refused.json(),
    )
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    assert connects == 0  # each 200 rode the connection the health check opened


def _whole(answer: dict[str, Any]) -> tuple[str, str, int]:
    """(text, finish reason, completion tokens) of a whole chat or text completion."""
    choice = answer["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, choice["finish_reason"], answer["usage"]["completion_tokens"]
