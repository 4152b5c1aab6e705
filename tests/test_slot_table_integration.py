"""The slot table against a real llama-server.

- What each request costs upstream on its critical path (the calls sent for it
  before and including its own completion), read from the engine client's log
  of what it sent.
- A frozen engine (SIGSTOP) never gets an unpinned request: every completion
  the host sends names a slot.
- The response's ``model`` is the name the client asked for.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.client import EngineClient
from gezel_trio.host import Host

from .conftest import make_config, running
from .fault_tools import resume_and_kill, wait_nothing_held

CHAT_PATH = "/v1/chat/completions"
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Tell me about the sea, please."}],
    "temperature": 0,
    "max_tokens": 1,
}


def _cfg(
    tiny_model: Path,
    state_dir: Path,
    engine_binary: EngineBinary,
    *,
    parallel: int,
    keyless: str = "shared",
    save_idle_slots: bool = True,
    **model: Any,
) -> Any:
    return make_config(
        [
            ModelConfig(
                id="tiny", path=str(tiny_model), parallel=parallel, ctx_per_slot=2048, **model
            )
        ],
        state_dir=state_dir,
        engine_binary=engine_binary,
        # one caller's sessions would share a prefix (test_caller_prefix): these count
        # the calls of handoffs between owners that share nothing
        scheduler={
            "keyless": keyless,
            "save_idle_slots": save_idle_slots,
            "share_prefix_within_caller": False,
        },
    )


def _last_seq(client: EngineClient) -> int:
    return client.recent[-1].seq if client.recent else 0


async def _settled(host: Host) -> None:
    """Nothing held, and the background erase of an idle keyless slot is done."""
    assert host.scheduler is not None
    await trio.sleep(host.scheduler.settings.idle_erase_delay + 0.05)
    await wait_nothing_held(host)


async def _request(
    host: Host, client: httpx.AsyncClient, session: str | None, *, settle: bool = True
) -> tuple[list[str], list[str]]:
    """One chat turn: (calls up to and including its completion, calls after it until
    the host is idle again), as the engine client sent them."""
    upstream = host.models["tiny"].client
    since = _last_seq(upstream)
    body = dict(CHAT)
    if session is not None:
        body["prompt_cache_key"] = session
    resp = await client.post(CHAT_PATH, json=body)
    assert resp.status_code == 200, resp.text
    if settle:
        await _settled(host)
    calls = [c.action for c in upstream.recent if c.seq > since and c.action != "slots"]
    at = calls.index(CHAT_PATH)
    return calls[: at + 1], calls[at + 1 :]


async def test_upstream_calls_on_the_critical_path(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """In ``keyless = "blind"`` mode (keyless requests have no owner), every save at its
    handoff (``test_kv_copies_integration`` has the background saves)."""
    cfg = _cfg(
        tiny_model, state_dir, engine_binary, parallel=1, keyless="blind", save_idle_slots=False
    )
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            # keyless: the completion alone; its slot is erased once idle, off the path
            assert await _request(host, client, None) == ([CHAT_PATH], ["erase"])
            assert await _request(host, client, None) == ([CHAT_PATH], ["erase"])
            # back to back, the next keyless request takes the slot as it is (blind)
            assert await _request(host, client, None, settle=False) == ([CHAT_PATH], [])
            assert await _request(host, client, None) == ([CHAT_PATH], ["erase"])
            # keyed, on a clean slot, then on the slot the session already owns
            assert await _request(host, client, "chat-A") == ([CHAT_PATH], [])
            assert await _request(host, client, "chat-A") == ([CHAT_PATH], [])
            # keyed handoff: chat-A's KV is parked first, then chat-B's request is sent
            # with cache_prompt off (the engine empties the slot: no erase call); the
            # chat is the very same, and the engine reuses none of it
            assert await _request(host, client, "chat-B") == (["save", CHAT_PATH], [])
            # chat-A returns: chat-B is parked, chat-A's KV restored in place of an erase
            assert await _request(host, client, "chat-A") == (
                ["save", "restore", CHAT_PATH],
                [],
            )
            stats = host.scheduler.statistics() if host.scheduler else None
            assert stats is not None and stats.parking["restored"] == 1


async def test_a_keyless_request_reuses_nothing_the_slot_held(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """Two identical keyless prompts back to back on one slot: the second is not
    erased before, and the engine reports no cached token for it (it was sent with
    cache_prompt off), in ``keyless = "blind"`` mode. The same prompt keyed does get
    the cache."""
    cfg = _cfg(tiny_model, state_dir, engine_binary, parallel=1, keyless="blind")
    body = {**CHAT, "max_tokens": 2}
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            first = await client.post(CHAT_PATH, json=body)
            second = await client.post(CHAT_PATH, json=body)
            for resp in (first, second):
                assert resp.status_code == 200
                assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            await _settled(host)
            keyed = {**body, "prompt_cache_key": "chat-A"}
            await client.post(CHAT_PATH, json=keyed)
            again = (await client.post(CHAT_PATH, json=keyed)).json()
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("blind_handoff", [True, False])
async def test_keyed_handoff_without_parking_costs_one_call_or_two(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, blind_handoff: bool
) -> None:
    """Without parking a keyed handoff is the request alone, sent with ``cache_prompt``
    off, or (``blind_handoff = false``) an erase and the request. The same chat under
    another session reads no cached token either way: the engine's own count."""
    cfg = _cfg(tiny_model, state_dir, engine_binary, parallel=1)
    cfg.scheduler.kv_parking = False
    cfg.scheduler.blind_handoff = blind_handoff
    with trio.fail_after(120):
        async with running(cfg) as (host, client):
            assert await _request(host, client, "chat-A") == ([CHAT_PATH], [])
            assert await _request(host, client, "chat-B") == (
                ([] if blind_handoff else ["erase"]) + [CHAT_PATH],
                [],
            )
            again = await client.post(CHAT_PATH, json={**CHAT, "prompt_cache_key": "chat-C"})
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            back = await client.post(CHAT_PATH, json={**CHAT, "prompt_cache_key": "chat-C"})
            assert back.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_a_frozen_engine_never_gets_an_unpinned_request(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """SIGSTOP the engine for 3.5 s while 8 keyed and keyless requests queue: every
    completion the host sends names a slot, and every request is answered."""
    cfg = _cfg(tiny_model, state_dir, engine_binary, parallel=2)
    pid: int | None = None
    try:
        with trio.fail_after(120):
            async with running(cfg) as (host, client):
                resp = await client.post(CHAT_PATH, json=CHAT)
                assert resp.status_code == 200
                await wait_nothing_held(host)
                upstream = host.models["tiny"].client
                since = _last_seq(upstream)
                pid = host.models["tiny"].engine.pid
                assert pid is not None
                os.kill(pid, signal.SIGSTOP)
                statuses: list[int] = []

                async def one(i: int) -> None:
                    body: dict[str, Any] = {**CHAT, "max_tokens": 2}
                    if i % 2:
                        body["prompt_cache_key"] = f"chat-{i}"
                    statuses.append((await client.post(CHAT_PATH, json=body)).status_code)

                async with trio.open_nursery() as nursery:
                    for i in range(8):
                        nursery.start_soon(one, i)
                    await trio.sleep(3.5)
                    os.kill(pid, signal.SIGCONT)
                await wait_nothing_held(host)
                sent = [c for c in upstream.recent if c.seq > since and c.action == CHAT_PATH]
                assert sorted(statuses) == [200] * 8, statuses
                assert len(sent) == 8
                assert all(c.slot in (0, 1) for c in sent), sent
    finally:
        if pid is not None:
            resume_and_kill([pid])


async def test_the_response_names_the_model_the_client_asked_for(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = _cfg(tiny_model, state_dir, engine_binary, parallel=1, name="Tiny Demo")
    with trio.fail_after(120):
        async with running(cfg) as (_host, client):
            for asked in ("tiny", "Tiny Demo"):
                body = {**CHAT, "model": asked}
                unary = await client.post(CHAT_PATH, json=body)
                assert unary.status_code == 200 and unary.json()["model"] == asked
                text = await client.post(
                    "/v1/completions", json={"model": asked, "prompt": "Hi", "max_tokens": 1}
                )
                assert text.status_code == 200 and text.json()["model"] == asked
                models: set[str] = set()
                async with client.stream(
                    "POST", CHAT_PATH, json={**body, "stream": True, "max_tokens": 3}
                ) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            models.add(json.loads(line[6:]).get("model"))
                assert models == {asked}
            # no model named: the first model answers, under its id
            anonymous = await client.post(CHAT_PATH, json={**CHAT, "model": None})
            assert anonymous.json()["model"] == "tiny"
