"""The spine end to end: a real llama-server behind a real hypercorn socket."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import trio
import trio.lowlevel

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.supervisor import EngineState

from ._engine_bin import ENGINE_LIMITS
from .conftest import make_config, pids_alive, running

CHAT = {
    "messages": [{"role": "user", "content": "Say something."}],
    "max_tokens": 16,
    "temperature": 0,
}


def _cfg(tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, **kw: object):  # type: ignore[no-untyped-def]
    return make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=2, ctx_per_slot=512)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        **kw,  # type: ignore[arg-type]
    )


async def _sse_events(resp: httpx.Response) -> list[str]:
    events = []
    async for line in resp.aiter_lines():
        if line.startswith("data: "):
            events.append(line[6:])
    return events


async def test_chat_completion_and_stream(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    with trio.fail_after(90):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, client):
            engine = host.models["tiny"].engine
            assert engine.state.value is EngineState.STOPPED  # lazy

            resp = await client.post("/v1/chat/completions", json={**CHAT, "model": "tiny"})
            assert resp.status_code == 200, resp.text
            body = resp.json()
            assert body["object"] == "chat.completion"
            assert body["usage"]["completion_tokens"] > 0
            assert engine.state.value is EngineState.READY

            # streaming: several chunks arrive, then [DONE]
            async with client.stream(
                "POST", "/v1/chat/completions", json={**CHAT, "model": "tiny", "stream": True}
            ) as sresp:
                assert sresp.status_code == 200
                assert sresp.headers["content-type"].startswith("text/event-stream")
                events = await _sse_events(sresp)
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert len(chunks) >= 3
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)

            # text completions go through too
            resp = await client.post(
                "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4}
            )
            assert resp.status_code == 200, resp.text
            assert resp.json()["object"] == "text_completion"

            models = (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["tiny"]
            assert models["data"][0]["state"] == "ready"


async def test_unknown_model_is_404_in_openai_shape(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, client):
        resp = await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
        assert resp.status_code == 404
        err = resp.json()["error"]
        assert err["code"] == "model_not_found"
        assert "nope" in err["message"] and "tiny" in err["message"]
        # nothing was started for it
        assert host.models["tiny"].engine.state.value is EngineState.STOPPED


async def test_kill_9_then_next_request_restarts(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    with trio.fail_after(120):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, client):
            engine = host.models["tiny"].engine
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            first_pid = engine.pid
            assert first_pid is not None
            os.kill(first_pid, signal.SIGKILL)
            await engine.state.wait_value(EngineState.FAILED)
            status = (await client.get("/api/status")).json()
            (eng,) = status["engines"]
            assert eng["state"] == "failed" and "SIGKILL" in eng["last_crash"]
            resp = await client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 200, resp.text
            assert engine.pid not in (None, first_pid)
            assert engine.crashes == 1 and engine.starts == 2


async def test_shutdown_leaves_no_process(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    pids: list[int] = []
    with trio.fail_after(90):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, client):
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            pids.append(host.models["tiny"].engine.pid or -1)
            assert pids_alive(pids) == pids
    assert pids_alive(pids) == []


async def test_cancellation_mid_stream_leaves_no_process(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    pids: list[int] = []
    with trio.fail_after(90), trio.move_on_after(60) as scope:
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, client):
            body = {**CHAT, "stream": True, "max_tokens": 400}
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                pids.append(host.models["tiny"].engine.pid or -1)
                async for _ in resp.aiter_lines():
                    scope.cancel()  # like Ctrl-C in the middle of a stream
                    await trio.lowlevel.checkpoint()
    assert scope.cancelled_caught
    assert pids and pids_alive(pids) == []


async def test_client_disconnect_stops_generation(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    with trio.fail_after(120):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, client):
            engine = host.models["tiny"].engine
            async with client.stream(
                "POST",
                "/v1/chat/completions",
                json={**CHAT, "stream": True, "max_tokens": 480, "ignore_eos": True},
            ) as resp:
                n = 0
                async for line in resp.aiter_lines():
                    n += line.startswith("data: ")
                    if n >= 3:
                        break
            # the client is gone: the engine's slots go idle within a second
            assert engine.base_url is not None
            deadline = trio.current_time() + 1.0
            async with httpx.AsyncClient(limits=ENGINE_LIMITS) as direct:
                while True:
                    slots = (await direct.get(engine.base_url + "/slots")).json()
                    if not any(s["is_processing"] for s in slots):
                        break
                    assert trio.current_time() < deadline, slots
                    await trio.sleep(0.05)
