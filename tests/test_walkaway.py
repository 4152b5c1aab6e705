"""Clients that walk away at every point of a streaming request hold nothing afterwards.

A raw socket client (no HTTP library between the test and the wire) sends a
streaming chat completion to a real host in front of a real llama-server and
leaves: before the response head, right after the head, mid-stream, or by
simply no longer reading. Afterwards no pin, running job, lease or busy engine
is left, the engine's slots are idle, and the engine connection pool has no
request in flight.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from benchmarks._raw_client import post_json, reset
from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.transport import EngineTransport
from gezel_trio.host import Host

from .conftest import make_config, running
from .fault_tools import slots_busy, wait_nothing_held, wait_until

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "temperature": 0,
    "max_tokens": 16000,
    "ignore_eos": True,
    "stream": True,
}


def _cfg(tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, **server: Any) -> Any:
    return make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=16384)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server=server,
    )


async def _read_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    buf = b""
    while marker not in buf:
        chunk = await stream.receive_some(65536)
        assert chunk, f"closed before {marker!r}: {buf[:200]!r}"
        buf += chunk
    return buf


async def _nothing_left(host: Host, *, within: float) -> None:
    await wait_nothing_held(host, within=within)
    engine = host.models["tiny"].engine
    assert engine.base_url is not None
    base_url = engine.base_url

    async def idle() -> bool:
        return await slots_busy(base_url) == []

    await wait_until(idle, within=within, what="engine slots idle")
    transport = host.models["tiny"].client._transport
    assert isinstance(transport, EngineTransport)
    assert transport.open_once == 0  # every stream's connection was closed
    pool = transport.pool._pool  # type: ignore[attr-defined]

    def pool_idle() -> bool:  # a background save of the slot may still be on its way
        return all(c.is_idle() or c.is_closed() for c in pool.connections)

    await wait_until(pool_idle, within=within, what="the engine's pooled connections idle")


async def test_walkaways_at_every_point_of_a_stream_leave_nothing_held(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = _cfg(tiny_model, state_dir, engine_binary, stream_stall_timeout=1.0)
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            url = str(client.base_url).rstrip("/")
            warm = await client.post(
                "/v1/chat/completions", json={**CHAT, "stream": False, "max_tokens": 2}
            )
            assert warm.status_code == 200

            # 1. Before the head: the only slot is busy (a stream that keeps being
            # read), so the request is queued; it leaves the queue.
            async with (
                client.stream("POST", "/v1/chat/completions", json=CHAT) as busy,
                trio.open_nursery() as reader,
            ):

                async def keep_reading() -> None:
                    async for _ in busy.aiter_raw():
                        pass

                reader.start_soon(keep_reading)
                queued = await post_json(url, CHAT)
                try:
                    await wait_until(
                        lambda: _queued(host) == 1, within=5, what="the second request queued"
                    )
                finally:
                    await reset(queued)
                await wait_until(lambda: _queued(host) == 0, within=2, what="left the queue")
                reader.cancel_scope.cancel()
            await _nothing_left(host, within=3)

            # 2. Right after the head, before reading any event.
            stream = await post_json(url, CHAT)
            try:
                await _read_until(stream, b"\r\n\r\n")
            finally:
                await reset(stream)
            await _nothing_left(host, within=3)

            # 3. Mid-stream.
            stream = await post_json(url, CHAT)
            try:
                await _read_until(stream, b"data: ")
                await _read_until(stream, b"data: ")
            finally:
                await reset(stream)
            await _nothing_left(host, within=3)

            # 4. Still connected, but no longer reading: the stall timeout (1 s) ends it.
            stream = await post_json(url, CHAT)
            try:
                await _read_until(stream, b"data: ")
                await _nothing_left(host, within=10)
            finally:
                await reset(stream)

            # The host still serves.
            after = await client.post(
                "/v1/chat/completions", json={**CHAT, "stream": False, "max_tokens": 2}
            )
            assert after.status_code == 200


def _queued(host: Host) -> int:
    assert host.scheduler is not None
    return host.scheduler.statistics().queued
