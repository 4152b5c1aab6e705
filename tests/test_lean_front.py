"""The lean front (:mod:`gezel_trio.api.lean`) serves the hot completion routes with every
promise Quart's routes keep: the API key and the dialect's error shapes, the body's limits,
the request log line and metrics, the walk-away of a non-streamed request, and the count
of upstream connections; the front guard writes a whole answer at once. Real hypercorn,
real llama-server, the tiny model."""

from __future__ import annotations

import json
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gezel_trio.api.lean import HOT_PATHS
from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.client import CONNECT
from gezel_trio.front_guard import _body_follows
from gezel_trio.server import open_served

from .conftest import make_config
from .fault_tools import raw_http, slots_busy, wait_nothing_held, wait_until

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 2,
    "temperature": 0,
}
KEY = "sk-lean-test"


def _cfg(tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, **server: Any) -> Any:
    return make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=4096)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server=server,
    )


def _request_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        r.fields  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "gezel_trio.requests" and r.getMessage() == "request"
    ]


async def test_hot_routes_go_through_the_lean_front_with_auth_errors_and_the_log(
    tiny_model: Path,
    state_dir: Path,
    engine_binary: EngineBinary,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gezel_trio.requests")
    cfg = _cfg(tiny_model, state_dir, engine_binary, api_keys=[KEY], max_body_bytes=4096)
    auth = {"Authorization": f"Bearer {KEY}"}
    with trio.fail_after(120):
        async with (
            open_served(cfg) as served,
            httpx.AsyncClient(base_url=served.urls[0], timeout=60) as client,
        ):
            lean = served.lean
            # the answers
            r = await client.post("/v1/chat/completions", json=CHAT, headers=auth)
            assert r.status_code == 200, r.text
            assert r.json()["object"] == "chat.completion" and r.json()["model"] == "tiny"
            assert float(r.headers["X-Gezel-Queue-Wait-Ms"]) >= 0
            text = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
            r = await client.post("/v1/completions", json=text, headers=auth)
            assert r.status_code == 200 and r.json()["object"] == "text_completion"
            r = await client.post("/v1/messages", json=CHAT, headers=auth)
            assert r.status_code == 200 and r.json()["type"] == "message"
            served_before = lean.statistics().served
            assert served_before == 3
            # what is not hot goes to Quart
            assert (await client.get("/v1/models", headers=auth)).status_code == 200
            r = await client.get("/v1/chat/completions", headers=auth)
            assert r.status_code == 405
            assert lean.statistics().served == served_before

            # the API key, refused in each dialect's shape
            r = await client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key"
            r = await client.post("/v1/messages", json=CHAT, headers={"x-api-key": "wrong"})
            assert r.status_code == 401
            assert r.json()["type"] == "error" and r.json()["error"]["type"]

            # the body: its limit, its JSON, and the errors a route raises
            big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
            r = await client.post("/v1/chat/completions", json=big, headers=auth)
            assert r.status_code == 413
            message = r.json()["error"]["message"]
            assert "larger than the limit of 4096 bytes" in message
            assert "[server] max_body_bytes" in message
            r = await client.post(
                "/v1/chat/completions",
                content=b"{not json",
                headers={**auth, "Content-Type": "application/json"},
            )
            assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
            r = await client.post(
                "/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=auth
            )
            assert r.status_code == 404 and r.json()["error"]["type"]
            r = await client.post("/v1/messages", json={**CHAT, "model": "nope"}, headers=auth)
            assert r.status_code == 404 and r.json()["type"] == "error"

            # CORS as Quart's hook adds it
            cfg.server.cors_origins = ["http://app.example"]
            r = await client.post(
                "/v1/chat/completions",
                json=CHAT,
                headers={**auth, "Origin": "http://app.example"},
            )
            assert r.headers["Access-Control-Allow-Origin"] == "http://app.example"

            # metrics of the lean front's requests
            metrics = (await client.get("/metrics", headers=auth)).text
            assert 'model="tiny"' in metrics and 'model="(unresolved)"' in metrics

    lines = _request_lines(caplog)
    by_status: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        by_status.setdefault(line["status"], []).append(line)
    ok = by_status[200][0]
    assert ok["model"] == "tiny" and ok["path"] == "/v1/chat/completions"
    assert ok["slot"] == 0 and ok["queue_wait_ms"] is not None
    assert ok["completion_tokens"] == 2 and ok["prompt_tokens"] and ok["ttft_ms"] is not None
    assert {line["path"] for line in by_status[200]} >= {"/v1/completions", "/v1/messages"}
    for status in (401, 413, 400, 404):
        assert by_status[status], status
    assert all(line["model"] == "(unresolved)" for line in by_status[404])


async def test_a_unary_client_that_walks_away_frees_its_slot(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """A non-streamed request whose client leaves mid-generation: the lean front cancels
    it, so the slot is free and the engine idle at once (not after the whole answer)."""
    cfg = _cfg(tiny_model, state_dir, engine_binary)
    long = {**CHAT, "max_tokens": 3000, "ignore_eos": True}
    with trio.fail_after(120):
        async with (
            open_served(cfg) as served,
            httpx.AsyncClient(base_url=served.urls[0], timeout=60) as client,
        ):
            host = served.host
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            base_url = host.models["tiny"].engine.base_url
            assert base_url is not None

            async def busy() -> bool:
                return await slots_busy(base_url) == [0]

            async def idle() -> bool:
                return await slots_busy(base_url) == []

            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(client.post, "/v1/chat/completions", json=long))
                await wait_until(busy, within=10, what="the engine generating")
                nursery.cancel_scope.cancel()  # the client leaves
            t0 = time.monotonic()
            await wait_until(idle, within=3, what="the engine idle")
            await wait_nothing_held(host, within=3)
            assert time.monotonic() - t0 < 3
            assert served.lean.statistics().walked_away == 1


async def test_a_stream_the_front_could_not_send_ends_its_job_at_once(
    tiny_model: Path,
    state_dir: Path,
    engine_binary: EngineBinary,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream whose response could not be sent (here its first write fails; in life, the
    client left between the route's answer and that write) has its body closed by the
    front, the route's body under the metrics' wrapper included: the job, its slot and the
    engine's generation end at once, not after ``stream_start_timeout`` (30 s here), when
    the service's watchdog would end them."""
    import gezel_trio.api.lean as lean_module

    cfg = _cfg(tiny_model, state_dir, engine_binary, stream_start_timeout=30.0)
    long = {**CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    real_send = lean_module._send_response

    async def failing_send(send: Any, resp: Any) -> None:
        if resp.mimetype == "text/event-stream":
            raise RuntimeError("the first write failed")
        await real_send(send, resp)

    with trio.fail_after(120):
        async with (
            open_served(cfg) as served,
            httpx.AsyncClient(base_url=served.urls[0], timeout=60) as client,
        ):
            host = served.host
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            base_url = host.models["tiny"].engine.base_url
            assert base_url is not None
            monkeypatch.setattr(lean_module, "_send_response", failing_send)
            t0 = time.monotonic()
            r = await client.post("/v1/chat/completions", json=long)
            assert r.status_code == 500  # hypercorn's, for an app that failed before its head

            async def idle() -> bool:
                return await slots_busy(base_url) == []

            await wait_nothing_held(host, within=5)
            await wait_until(idle, within=5, what="the engine idle")
            assert time.monotonic() - t0 < 5


async def test_each_completion_opens_one_upstream_connection(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """llama-server closes the connection after every streamed answer, and every
    completion is streamed from it, on a connection of its own (the transport's lean
    path): the client counts one new connection per completion (``tcp_connect`` in its
    calls, as ``/api/status`` shows them), and none is left to the pool."""
    cfg = _cfg(tiny_model, state_dir, engine_binary)
    with trio.fail_after(120):
        async with (
            open_served(cfg) as served,
            httpx.AsyncClient(base_url=served.urls[0], timeout=60) as client,
        ):
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            engine_client = served.host.models["tiny"].client
            calls = engine_client.calls
            before = calls.copy()
            for _ in range(5):
                r = await client.post("/v1/chat/completions", json=CHAT)
                assert r.status_code == 200
            made = calls - before
            assert made["/v1/chat/completions"] == 5
            # each completion opened its own; a control call (slots, erase) meanwhile
            # may have opened one in the pool
            others = made.total() - made[CONNECT] - made["/v1/chat/completions"]
            assert 5 <= made[CONNECT] <= 5 + others, made
            status = (await client.get("/api/status")).json()
            assert status["engines"][0]["upstream_calls"][CONNECT] == calls[CONNECT]


def test_a_head_is_held_only_when_a_body_of_known_length_follows() -> None:
    head = b"HTTP/1.1 200 \r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n"
    assert _body_follows(head)
    assert not _body_follows(head.replace(b"length: 12", b"length: 0"))
    assert not _body_follows(head + b'{"a":1}')  # a head with its body: written as it is
    chunked = b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\n\r\n"
    assert not _body_follows(chunked)
    assert not _body_follows(b'{"content-length: 5\r\n\r\n')


async def test_whole_answers_and_head_requests_are_complete(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """With heads held for their bodies: a HEAD (a head announcing a body that never
    comes) still gets its head, and a unary answer comes whole."""
    cfg = _cfg(tiny_model, state_dir, engine_binary)
    with trio.fail_after(120):
        async with open_served(cfg) as served:
            url = served.urls[0]
            reply = await raw_http(url, b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n", read_for=2)
            assert reply.status == 200
            payload = json.dumps(CHAT).encode()
            reply = await raw_http(
                url,
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload,
            )
            assert reply.status == 200
            assert json.loads(reply.body)["object"] == "chat.completion"


def test_the_hot_paths_are_quart_routes() -> None:
    """Every hot path is also a route of the Quart app, which runs the same function."""
    from gezel_trio.api import anthropic, native, openai, responses

    routes = {
        rule.rule: rule.endpoint
        for bp in (openai.bp, native.bp, anthropic.bp, responses.bp)
        for rule in _rules(bp)
    }
    for path, route in HOT_PATHS.items():
        assert path in routes, path
        assert routes[path].endswith(route.__name__), (path, routes[path])


def _rules(bp: Any) -> list[Any]:
    from quart import Quart

    app = Quart(__name__)
    app.register_blueprint(bp)
    return list(app.url_map.iter_rules())
