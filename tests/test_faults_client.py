"""Client faults against a real engine: a client that goes away mid-stream, mid-request or
while its request is still queued.

The engine is polled directly (``GET /slots`` on its own port): when the client is
gone, llama-server must report the slot idle within a second. A queued request
must leave the queue. The slot the cancelled job ran on stays recorded as that
chat's (so the next chat to get it is erased first, and the same chat keeps its KV).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.host import Host
from gezel_trio.scheduler import hash_session

from .conftest import make_config, running
from .fault_tools import slots_busy, wait_nothing_held, wait_until

CHAT = {"messages": [{"role": "user", "content": "Tell me a long story."}], "temperature": 0}
# Long enough that the engine cannot finish before a test walks away, even when the
# client reads slowly and every token fits in the socket buffers.
LONG = {**CHAT, "max_tokens": 16000, "ignore_eos": True}


def _cfg(tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, *, parallel: int):  # type: ignore[no-untyped-def]
    return make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=parallel, ctx_per_slot=16384)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )


def _shown(host: Host, name: str) -> str:
    """The hash status shows for the local caller's session ``name``."""
    return hash_session(host.sessions.session(host.sessions.caller(None), name))


def _stats(host: Host) -> Any:
    assert host.scheduler is not None
    return host.scheduler.statistics()


async def _idle_within(base_url: str, seconds: float) -> float:
    """Seconds until the engine reports no busy slot (fails after ``seconds``)."""

    async def idle() -> bool:
        return not await slots_busy(base_url)

    return await wait_until(idle, within=seconds, interval=0.02, what="engine slots idle")


async def test_disconnect_mid_stream_stops_generation_and_records_the_owner(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    with trio.fail_after(90):
        async with running(_cfg(tiny_model, state_dir, engine_binary, parallel=2)) as (
            host,
            client,
        ):
            engine = host.models["tiny"].engine
            body = {**LONG, "stream": True, "prompt_cache_key": "chat-A"}
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                # Held in a name: an iterator dropped after its loop is closed by the
                # garbage collector, and closing it closes the response, racing the
                # check below.
                lines = resp.aiter_lines()
                n = 0
                async for line in lines:
                    n += line.startswith("data: ")
                    if n >= 3:
                        break
                assert engine.base_url is not None
                assert len(await slots_busy(engine.base_url)) == 1
            # the client is gone (the response was closed mid-stream)
            took = await _idle_within(engine.base_url, 1.0)
            await wait_nothing_held(host)
            owners = _stats(host).slot_owners["tiny"]
            assert _shown(host, "chat-A") in owners.values(), owners
            print(f"slot idle {took * 1000:.0f} ms after the stream was closed")

            # the same chat gets its slot back without an erase; the next one works
            erases_before = _stats(host).erases
            resp2 = await client.post(
                "/v1/chat/completions", json={**CHAT, "max_tokens": 4, "prompt_cache_key": "chat-A"}
            )
            assert resp2.status_code == 200, resp2.text
            assert _stats(host).erases["ok"] == erases_before["ok"]
            await wait_nothing_held(host)


def _cancelled_tasks(host: Host) -> int:
    """How many tasks llama-server cancelled (its log says ``cancel task``)."""
    return sum("cancel task" in line for line in host.models["tiny"].engine.log.tail(400))


async def _give_up_when_generating(client: httpx.AsyncClient, base_url: str, body: Any) -> None:
    """Post ``body`` and abandon it as soon as the engine is generating for it."""

    async def generating() -> bool:
        return len(await slots_busy(base_url)) >= 1

    async with trio.open_nursery() as nursery:

        async def give_up() -> None:
            await wait_until(generating, within=10, what="generation running")
            nursery.cancel_scope.cancel()

        nursery.start_soon(give_up)
        await client.post("/v1/chat/completions", json=body)
        raise AssertionError("the long request finished before it was cancelled")


async def test_disconnect_mid_request_stops_generation(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """A non-streaming client that gives up: the host closes the upstream request and
    llama-server cancels the task.

    llama-server notices a closed connection of a non-streaming request only when its
    result wait times out (``HTTP_POLLING_SECONDS`` = 1 s with no other result), so
    the engine is left alone meanwhile: polling ``/slots`` would itself delay it.
    """
    with trio.fail_after(90):
        async with running(_cfg(tiny_model, state_dir, engine_binary, parallel=2)) as (
            host,
            client,
        ):
            engine = host.models["tiny"].engine
            await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
            assert engine.base_url is not None
            cancelled_before = _cancelled_tasks(host)
            body = {**LONG, "prompt_cache_key": "chat-B"}
            await _give_up_when_generating(client, engine.base_url, body)
            took = await wait_until(
                lambda: _cancelled_tasks(host) > cancelled_before,
                within=3.0,
                what="llama-server cancelling the task",
            )
            assert not await slots_busy(engine.base_url)
            await wait_nothing_held(host)
            assert _shown(host, "chat-B") in _stats(host).slot_owners["tiny"].values()
            print(f"llama-server cancelled the task {took * 1000:.0f} ms after the client left")


async def test_disconnect_mid_request_stops_generation_under_load(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """As above, while another chat streams on the other slot: the abandoned request's
    slot must still go idle within a second. (llama-server checks a non-streaming
    request's connection only after 1 s without a result for any task, so the host
    streams every request upstream and assembles non-streaming answers itself.)"""
    with trio.fail_after(90):
        async with running(_cfg(tiny_model, state_dir, engine_binary, parallel=2)) as (
            host,
            client,
        ):
            engine = host.models["tiny"].engine
            await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
            assert engine.base_url is not None
            base_url = engine.base_url
            async with client.stream(
                "POST", "/v1/chat/completions", json={**LONG, "stream": True}
            ) as other:
                lines = other.aiter_lines()
                await lines.__anext__()

                async def two_busy() -> bool:
                    return len(await slots_busy(base_url)) == 2

                async with trio.open_nursery() as nursery:

                    async def give_up() -> None:
                        await wait_until(two_busy, within=10, what="both slots generating")
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(give_up)
                    await client.post("/v1/chat/completions", json=LONG)

                async def one_busy() -> bool:
                    return len(await slots_busy(base_url)) <= 1

                took = await wait_until(
                    one_busy, within=1.5, interval=0.05, what="abandoned slot idle"
                )
                print(f"abandoned slot idle {took * 1000:.0f} ms after the client left, under load")


async def test_disconnect_while_queued_leaves_the_queue(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """One slot, one long stream on it: queued requests (streaming and not) whose clients
    go away leave the queue at once, and never reach the engine."""
    with trio.fail_after(90):
        async with running(_cfg(tiny_model, state_dir, engine_binary, parallel=1)) as (
            host,
            client,
        ):
            engine = host.models["tiny"].engine
            async with client.stream(
                "POST", "/v1/chat/completions", json={**LONG, "stream": True}
            ) as holder:
                assert holder.status_code == 200
                lines = holder.aiter_lines()
                await lines.__anext__()
                admissions_before = _stats(host).admissions

                async with trio.open_nursery() as nursery:

                    async def queued(body: dict[str, Any]) -> None:
                        if body.get("stream"):
                            async with client.stream(
                                "POST", "/v1/chat/completions", json=body
                            ) as r:
                                await r.aread()
                        else:
                            await client.post("/v1/chat/completions", json=body)
                        raise AssertionError("a queued request was answered")

                    nursery.start_soon(queued, {**CHAT, "max_tokens": 4, "stream": True})
                    nursery.start_soon(queued, {**CHAT, "max_tokens": 4})
                    await wait_until(lambda: _stats(host).queued == 2, within=10, what="two queued")
                    nursery.cancel_scope.cancel()  # both clients disconnect
                took = await wait_until(
                    lambda: _stats(host).queued == 0, within=1.0, what="queue empty"
                )
                # nothing was admitted for them, and the long stream still runs
                assert _stats(host).admissions == admissions_before
                assert engine.base_url is not None
                assert len(await slots_busy(engine.base_url)) == 1
                print(f"queued jobs left the queue {took * 1000:.0f} ms after the disconnect")
            await _idle_within(engine.base_url, 1.0)
            await wait_nothing_held(host)
            resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
            assert resp.status_code == 200, resp.text


async def test_many_clients_vanish_mid_stream(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """Twenty streams on two slots, every client gone after its first chunk (or while
    queued): the engine goes idle, nothing stays held, the host still serves."""
    with trio.fail_after(120):
        async with running(_cfg(tiny_model, state_dir, engine_binary, parallel=2)) as (
            host,
            client,
        ):
            engine = host.models["tiny"].engine
            first_chunks = 0

            async def vanish(i: int) -> None:
                nonlocal first_chunks
                body = {**LONG, "stream": True, "prompt_cache_key": f"s{i % 5}"}
                # The first two wait for their first chunk however busy the machine is
                # (one per slot); the others leave after a while, streaming or queued.
                patience = math.inf if i < 2 else 0.05 * i + 0.3
                with trio.move_on_after(patience):
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                first_chunks += 1
                                return

            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(vanish, i)
            assert first_chunks >= 2
            assert engine.base_url is not None
            await _idle_within(engine.base_url, 1.0)
            await wait_nothing_held(host)
            resp = await client.post(
                "/v1/chat/completions", json={**CHAT, "max_tokens": 4, "prompt_cache_key": "s1"}
            )
            assert resp.status_code == 200, resp.text
            await wait_nothing_held(host)
            stats = _stats(host)
            assert stats.erases["failed"] == 0, stats.erases
