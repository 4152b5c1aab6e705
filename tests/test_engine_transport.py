"""EngineTransport: a request that uses its connection once goes over a connection of
its own (its bytes written and read by engine.wire); every other one goes to httpx's
pool. Against a real socket server, a few lines of trio that answer as each test tells
them, so that each case (a chunked stream, a close before the head, an answer cut
midway, silence, a caller that leaves) is what the transport meets on the wire; and
against llama-server.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from gezel_trio.engine.client import CONNECT, EngineClient, UpstreamHead
from gezel_trio.engine.transport import EngineTransport
from gezel_trio.errors import EngineCrashed, EngineTimeout

from ._engine_bin import open_llama_server
from .fault_tools import read_http_request

CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
EVENTS = [b'data: {"n":1}\n\n', b'data: {"n":2}\n\n', b"data: [DONE]\n\n"]


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


Answer = Callable[[trio.SocketStream], Awaitable[None]]


@dataclass
class Server:
    base_url: str | None = None
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    closed_by_client = 0
    """Connections whose client closed them once the server had answered."""
    _closed: trio.Event = field(default_factory=trio.Event)

    def crash_error(self, detail: str) -> EngineCrashed:
        return EngineCrashed(f"crashed: {detail}")

    def note_closed(self) -> None:
        self.closed_by_client += 1
        self._closed.set()
        self._closed = trio.Event()

    async def wait_closed_by_client(self, n: int) -> None:
        while self.closed_by_client < n:
            await self._closed.wait()


@asynccontextmanager
async def serving(answer: Answer) -> AsyncIterator[Server]:
    server = Server()

    async def handle(stream: trio.SocketStream) -> None:
        server.connections += 1
        async with stream:
            try:
                while (request := await read_http_request(stream)) is not None:
                    server.requests.append(request)
                    await answer(stream)
            except trio.ClosedResourceError:
                return  # the answer closed it
            server.note_closed()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        server.base_url = f"http://127.0.0.1:{port}"
        yield server
        nursery.cancel_scope.cancel()


class CountingPool(httpx.AsyncHTTPTransport):
    """httpx's pool, counting the requests that reach it."""

    handled = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.handled += 1
        return await super().handle_async_request(request)


@asynccontextmanager
async def client_for(server: Server, read_timeout: float = 5.0) -> AsyncIterator[EngineClient]:
    pool = CountingPool()
    async with EngineTransport(pool) as transport:
        client = EngineClient(transport, server, read_timeout=read_timeout, model_id="m")
        client.pool = pool  # type: ignore[attr-defined]
        yield client


class Collect:
    def __init__(self) -> None:
        self.items: list[UpstreamHead | bytes] = []

    async def send(self, value: UpstreamHead | bytes, /) -> None:
        self.items.append(value)

    @property
    def body(self) -> bytes:
        return b"".join(i for i in self.items if isinstance(i, bytes))


async def _stream_events(stream: trio.SocketStream) -> None:
    await stream.send_all(CHUNKED_HEAD)
    for event in EVENTS:
        await stream.send_all(_chunk(event))
        await trio.sleep(0.01)
    await stream.send_all(b"0\r\n\r\n")


async def test_a_stream_goes_over_a_connection_of_its_own_that_it_closes() -> None:
    async with serving(_stream_events) as server, client_for(server) as client:
        for _ in range(2):
            out = Collect()
            head = await client.stream("/completion", {"prompt": "hi"}, out)
            assert head.status == 200 and out.items[0] == head
            assert out.body == b"".join(EVENTS)  # de-chunked, every byte, in order
        with trio.fail_after(5):
            await server.wait_closed_by_client(2)
    assert server.connections == 2 and client.calls[CONNECT] == 2
    assert client.pool.handled == 0  # type: ignore[attr-defined]
    first = server.requests[0]
    assert b"\r\nconnection: close\r\n" in first.lower()
    assert json.loads(first.partition(b"\r\n\r\n")[2]) == {"prompt": "hi"}


async def test_other_requests_keep_their_connection_in_the_pool() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

    async def answer(stream: trio.SocketStream) -> None:
        await stream.send_all(ok)

    async with serving(answer) as server, client_for(server) as client:
        for _ in range(3):
            result = await client.forward("POST", "/completion", body={})
            assert result.content == b"{}"
    assert server.connections == 1 and client.calls[CONNECT] == 1
    assert client.pool.handled == 3  # type: ignore[attr-defined]


async def test_idle_connections_are_closed_before_the_engine_is_told_to_stop() -> None:
    """``drop_idle`` closes the pool's idle keep-alive connection to the engine (an
    engine holding one is slow to exit after SIGTERM), and the next request opens
    another: nothing is lost but the connection."""
    ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

    async def answer(stream: trio.SocketStream) -> None:
        await stream.send_all(ok)

    async with serving(answer) as server, client_for(server) as client:
        assert (await client.forward("POST", "/slots/0", body={})).content == b"{}"
        assert server.connections == 1 and server.closed_by_client == 0
        await client.drop_idle()
        with trio.fail_after(5):
            await server.wait_closed_by_client(1)
        assert (await client.forward("POST", "/slots/0", body={})).content == b"{}"
        assert server.connections == 2


async def test_an_engine_that_closes_before_its_head_is_a_crash_and_not_retried() -> None:
    async def close(stream: trio.SocketStream) -> None:
        await stream.aclose()

    async with serving(close) as server, client_for(server) as client:
        with pytest.raises(EngineCrashed, match="disconnected"):
            await client.stream("/completion", {}, Collect())
    assert len(server.requests) == 1  # a fresh connection is never retried


async def test_an_answer_cut_midway_is_a_crash_after_what_came() -> None:
    async def cut(stream: trio.SocketStream) -> None:
        await stream.send_all(CHUNKED_HEAD + _chunk(EVENTS[0]) + b"40\r\ndata: {")
        await stream.aclose()

    async with serving(cut) as server, client_for(server) as client:
        out = Collect()
        with pytest.raises(EngineCrashed):
            await client.stream("/completion", {}, out)
    assert isinstance(out.items[0], UpstreamHead)
    assert out.body.startswith(EVENTS[0])
    assert client._transport.open_once == 0  # type: ignore[attr-defined]
    assert len(server.requests) == 1


async def test_silence_is_a_timeout() -> None:
    async def hang(stream: trio.SocketStream) -> None:
        await stream.send_all(CHUNKED_HEAD)
        await trio.sleep_forever()

    async with serving(hang) as server, client_for(server, read_timeout=0.3) as client:
        with trio.fail_after(5), pytest.raises(EngineTimeout):
            await client.stream("/completion", {}, Collect())
    assert len(server.requests) == 1


async def test_an_engine_that_is_not_listening_is_a_crash() -> None:
    async with serving(_stream_events) as server:
        pass  # the listener is closed now
    async with client_for(server) as client:
        with pytest.raises(EngineCrashed):
            await client.stream("/completion", {}, Collect())


async def test_a_caller_that_leaves_closes_the_connection_at_once() -> None:
    async def slow(stream: trio.SocketStream) -> None:
        await stream.send_all(CHUNKED_HEAD + _chunk(EVENTS[0]))
        with trio.move_on_after(30):  # the rest never comes; wait for the client's close
            while await stream.receive_some(1024):
                pass

    async with serving(slow) as server, client_for(server) as client:
        out = Collect()
        with trio.move_on_after(30) as scope:

            async def leave_after_first_event(value: UpstreamHead | bytes, /) -> None:
                await out.send(value)
                if isinstance(value, bytes):
                    scope.cancel()

            out_sink = Collect()
            out_sink.send = leave_after_first_event  # type: ignore[method-assign]
            await client.stream("/completion", {}, out_sink)
        assert scope.cancelled_caught
        assert client._transport.open_once == 0  # type: ignore[attr-defined]
        with trio.fail_after(5):  # the server sees the close at once, not after 30 s
            await server.wait_closed_by_client(1)
    assert out.body == EVENTS[0]


async def test_a_stream_from_llama_server_is_the_engines_bytes(tiny_model: Path) -> None:
    """The lean path against the real engine: the same bytes a plain httpx client reads,
    on one connection per stream."""
    body = {"prompt": "The quick brown fox", "n_predict": 8, "temperature": 0, "stream": True}
    with trio.fail_after(120):
        async with open_llama_server(tiny_model, parallel=1, ctx=1024) as engine:
            base_url = engine.base_url
            server = Server(base_url=base_url)
            async with client_for(server) as client:
                out = Collect()
                head = await client.stream("/completion", body, out)
                again = Collect()
                await client.stream("/completion", body, again)
            async with httpx.AsyncClient() as plain:
                direct = await plain.post(base_url + "/completion", json=body)
    assert head.status == 200 and dict(head.headers)["content-type"].startswith("text/event-stream")
    assert client.calls[CONNECT] == 2
    contents = [_contents(o.body) for o in (out, again)]
    assert contents[0] == contents[1] == _contents(direct.content) and contents[0]


def _contents(stream: bytes) -> list[str]:
    out = []
    for line in stream.split(b"\n"):
        if line.startswith(b"data: {"):
            out.append(json.loads(line[6:]).get("content", ""))
    return out


async def test_a_head_request_goes_to_the_pool_even_when_it_closes() -> None:
    """A HEAD's answer announces a body that never comes: only the pool reads it right."""
    head_answer = b"HTTP/1.1 200 OK\r\nContent-Length: 42\r\n\r\n"

    async def answer(stream: trio.SocketStream) -> None:
        await stream.send_all(head_answer)

    async with serving(answer) as server, client_for(server) as client:
        request = httpx.Request(
            "HEAD", f"{server.base_url}/health", headers={"Connection": "close"}
        )
        with trio.fail_after(5):
            resp = await client._transport.handle_async_request(request)  # type: ignore[attr-defined]
            await resp.aread()
        await resp.aclose()
    assert resp.status_code == 200 and resp.content == b""
    assert client.pool.handled == 1  # type: ignore[attr-defined]
