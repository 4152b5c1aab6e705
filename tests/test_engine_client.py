"""EngineClient's one retry rule and one error map, against a real socket server.

The server is a few lines of trio over loopback that answers HTTP/1.1 exactly as
a test tells it to, so each case (a kept-alive connection the engine closed, a
fresh connection that fails, an answer cut after its head) is what the client
really meets on the wire.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import httpx
import pytest
import trio

from gezel_trio.engine.client import EngineClient
from gezel_trio.errors import EngineCrashed, EngineTimeout

from .fault_tools import read_http_request

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

# What the server does with the n-th request it reads (counted across connections):
# "answer", "close" (drop the connection without a byte of answer), "head" (send a
# head promising a body, then drop), "hang".
Plan = Callable[[int], str]


@dataclass
class Endpoint:
    base_url: str | None
    requests: int = 0
    connections: int = 0
    crashes: list[str] = field(default_factory=list)

    def crash_error(self, detail: str) -> EngineCrashed:
        self.crashes.append(detail)
        return EngineCrashed(f"crashed: {detail}")


@asynccontextmanager
async def serving(plan: Plan) -> AsyncIterator[Endpoint]:
    endpoint = Endpoint(base_url=None)

    async def handle(stream: trio.SocketStream) -> None:
        endpoint.connections += 1
        async with stream:
            while await read_http_request(stream) is not None:
                endpoint.requests += 1
                what = plan(endpoint.requests)
                if what == "close":
                    return
                if what == "head":
                    await stream.send_all(
                        b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"partial"'
                    )
                    return
                if what == "hang":
                    await trio.sleep_forever()
                await stream.send_all(OK)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        endpoint.base_url = f"http://127.0.0.1:{port}"
        yield endpoint
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def client_for(endpoint: Endpoint, read_timeout: float = 5.0) -> AsyncIterator[EngineClient]:
    async with httpx.AsyncHTTPTransport() as transport:
        yield EngineClient(transport, endpoint, read_timeout=read_timeout, model_id="m")


async def test_a_kept_alive_connection_the_engine_closed_is_retried_once() -> None:
    # Request 2 arrives on the kept-alive connection; the engine drops it unanswered.
    async with (
        serving(lambda n: "close" if n == 2 else "answer") as endpoint,
        client_for(endpoint) as client,
    ):
        first = await client.forward("POST", "/completion", body={"n": 1})
        second = await client.forward("POST", "/completion", body={"n": 2})
    assert first.head.status == second.head.status == 200
    assert endpoint.requests == 3 and endpoint.connections == 2  # one retry, on a new one
    assert client.calls["/completion"] == 2  # the caller sent two requests


async def test_a_fresh_connection_is_never_retried() -> None:
    async with serving(lambda n: "close") as endpoint, client_for(endpoint) as client:
        with pytest.raises(EngineCrashed):
            await client.forward("POST", "/completion", body={})
    assert endpoint.requests == 1 and endpoint.crashes


async def test_an_answer_cut_after_its_head_is_never_retried() -> None:
    async with (
        serving(lambda n: "head" if n == 2 else "answer") as endpoint,
        client_for(endpoint) as client,
    ):
        await client.forward("POST", "/completion", body={})
        with pytest.raises(EngineCrashed):
            await client.forward("POST", "/completion", body={})
    assert endpoint.requests == 2


async def test_silence_is_a_timeout_and_is_never_retried() -> None:
    async with (
        serving(lambda n: "hang" if n == 2 else "answer") as endpoint,
        client_for(endpoint, read_timeout=0.3) as client,
    ):
        await client.forward("POST", "/completion", body={})
        with pytest.raises(EngineTimeout):
            await client.forward("POST", "/completion", body={})
    assert endpoint.requests == 2


async def test_a_stopped_engine_is_a_crash_error_and_nothing_is_sent() -> None:
    endpoint = Endpoint(base_url=None)
    async with client_for(endpoint) as client:
        with pytest.raises(EngineCrashed):
            await client.slot_action(0, "erase")
    assert client.calls["erase"] == 0
