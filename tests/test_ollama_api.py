"""The official ``ollama`` Python client against the host, on a real socket, in front of
a real llama-server: every route of Ollama's API that the host serves, its errors,
``keep_alive``, and a client that walks away mid-stream.

The sync client runs in a worker thread while Trio serves. Every answer (and every
streamed line) is checked against the client's own pydantic types, and every field
it carries must be one Ollama documents (:data:`DOCUMENTED`).
"""

from __future__ import annotations

import base64
import json
import math
import re
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import ollama
import pydantic
import pytest
import trio

from gezel_trio.api.ollama_translate import OLLAMA_API_VERSION
from gezel_trio.config.schema import ModelConfig, validate
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.supervisor import EngineState
from gezel_trio.errors import ConfigError
from gezel_trio.host import Host
from gezel_trio.scheduler import hash_session
from gezel_trio.server import ListenError, open_server

from .conftest import make_config, running
from .fault_tools import slots_busy, wait_nothing_held, wait_until

KEY = "sk-test-ollama"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES: Any = [{"role": "user", "content": "Tell me a story."}]
OPTIONS: Any = {"num_predict": 8, "temperature": 0, "seed": 1}
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 32).decode()


def _cfg(
    tiny_model: Path,
    state_dir: Path,
    engine_binary: EngineBinary,
    *,
    parallel: int = 2,
    ctx_per_slot: int = 512,
    **sections: dict[str, object],
) -> Any:
    return make_config(
        [
            ModelConfig(
                id="tiny", path=str(tiny_model), parallel=parallel, ctx_per_slot=ctx_per_slot
            ),
            ModelConfig(
                id="tiny-embed",
                path=str(tiny_model),
                parallel=1,
                ctx_per_slot=256,
                embeddings=True,
                args=["--pooling", "mean"],
            ),
        ],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server={"api_keys": [KEY]},
        **sections,
    )


def _base(http: httpx.AsyncClient) -> str:
    return str(http.base_url).rstrip("/")


# --------------------------------------------------------------------------- schemas

# Fields Ollama's docs/api.md and api/types.go document that the client's types leave
# out (the types ignore unknown fields, so they would pass unseen).
DOCUMENTED: dict[str, set[str]] = {
    "ListResponse.Model": {"name", "capabilities"},
    "ModelDetails": {"context_length", "embedding_length"},
    "ProcessResponse.Model": set(),
    "ShowResponse": {"model_info"},
}
VERSION_FIELDS = {"version"}
ERROR_FIELDS = {"error"}


def _fields(cls: type[pydantic.BaseModel]) -> set[str]:
    names = set()
    for name, info in cls.model_fields.items():
        names.add(info.alias or name)
    return names


def _model_type(annotation: Any) -> type[pydantic.BaseModel] | None:
    """The pydantic model inside an annotation (``Optional[X]``, ``Sequence[X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_type(arg)
        if found is not None:
            return found
    return None


def check_schema(cls: type[pydantic.BaseModel], data: Any) -> Any:
    """``data`` parses as ``cls`` and carries no field that neither ``cls`` nor
    Ollama's docs name, recursively. Returns the parsed object."""
    parsed = cls.model_validate(data)
    _check_keys(cls, data)
    return parsed


def _check_keys(cls: type[pydantic.BaseModel], data: Any) -> None:
    if isinstance(data, list):
        for item in data:
            _check_keys(cls, item)
        return
    assert isinstance(data, dict), (cls, data)
    name = cls.__qualname__
    allowed = _fields(cls) | DOCUMENTED.get(name, set())
    assert set(data) <= allowed, f"{name}: undocumented fields {set(data) - allowed}"
    for field_name, info in cls.model_fields.items():
        key = info.alias or field_name
        inner = _model_type(info.annotation)
        if inner is not None and data.get(key) is not None and key != "model_info":
            _check_keys(inner, data[key])


def _ndjson(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _check_final(part: Mapping[str, Any], *, figures: bool = True) -> None:
    """A ``done: true`` answer, with the engine's own figures."""
    assert part["done"] is True and part["done_reason"] in ("stop", "length"), part
    assert isinstance(part["created_at"], str) and part["created_at"].endswith("Z")
    assert part["total_duration"] > 0
    if figures:
        assert part["prompt_eval_count"] > 0 and part["eval_count"] > 0, part
        assert part["prompt_eval_duration"] > 0 and part["eval_duration"] > 0, part
        assert part["total_duration"] >= part["eval_duration"], part


# --------------------------------------------------------------------------- the client


async def test_ollama_client_every_route(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    with trio.fail_after(120):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, http):
            base = _base(http)

            def scenario() -> dict[str, Any]:
                out: dict[str, Any] = {}
                client = ollama.Client(host=base, headers=AUTH, timeout=60)
                out["version"] = client._client.get("/api/version").json()
                out["list"] = client.list()
                out["show"] = client.show("tiny:latest")
                out["show_embed"] = client.show("tiny-embed")
                out["chat"] = client.chat(model="tiny", messages=MESSAGES, options=OPTIONS)
                out["chat_stream"] = list(
                    client.chat(
                        model="tiny:latest", messages=MESSAGES, options=OPTIONS, stream=True
                    )
                )
                out["ps"] = client.ps()
                out["generate"] = client.generate(
                    model="tiny", prompt="Once upon a time", system="Be brief.", options=OPTIONS
                )
                out["generate_stream"] = list(
                    client.generate(
                        model="tiny", prompt="Once upon a time", options=OPTIONS, stream=True
                    )
                )
                out["raw"] = client.generate(
                    model="tiny", prompt="<|im_start|>user\nHi", raw=True, options=OPTIONS
                )
                out["raw_stream"] = list(
                    client.generate(
                        model="tiny", prompt="Once", raw=True, options=OPTIONS, stream=True
                    )
                )
                out["infill"] = client.generate(
                    model="tiny",
                    prompt="def add(a, b):\n    ",
                    suffix="\n    return c",
                    options=OPTIONS,
                )
                out["infill_stream"] = list(
                    client.generate(
                        model="tiny", prompt="x = ", suffix=";", options=OPTIONS, stream=True
                    )
                )
                out["json"] = client.chat(
                    model="tiny", messages=MESSAGES, format="json", think=False, options=OPTIONS
                )
                out["embed"] = client.embed(model="tiny-embed", input=["hello", "world"])
                out["embed_one"] = client.embed(
                    model="tiny-embed:latest", input="hello", dimensions=8
                )
                out["embeddings"] = client.embeddings(model="tiny-embed", prompt="hello")
                out["load"] = client.chat(model="tiny", messages=[])
                errors: dict[str, ollama.ResponseError] = {}
                # served with the slot's context, as Ollama lowers it (tests/test_limits.py)
                out["num_ctx"] = client.chat(
                    model="tiny", messages=MESSAGES, options={**OPTIONS, "num_ctx": 100_000}
                )
                attempts: dict[str, Callable[[], object]] = {
                    "unknown": lambda: client.chat(model="nope", messages=MESSAGES),
                    "unknown_stream": lambda: list(
                        client.chat(model="nope:latest", messages=MESSAGES, stream=True)
                    ),
                    "unknown_show": lambda: client.show("nope"),
                    "images": lambda: client.chat(
                        model="tiny",
                        messages=[{"role": "user", "content": "What is this?", "images": [PNG]}],
                    ),
                    "embed_on_chat_model": lambda: client.embed(model="tiny", input="hello"),
                    "chat_on_embed_model": lambda: client.chat(
                        model="tiny-embed", messages=MESSAGES
                    ),
                    "template": lambda: client.generate(
                        model="tiny", prompt="x", template="{{ .Prompt }}"
                    ),
                    "bad_key": lambda: ollama.Client(
                        host=base, headers={"Authorization": "Bearer wrong"}
                    ).list(),
                    "no_key": lambda: ollama.Client(host=base).chat(
                        model="tiny", messages=MESSAGES
                    ),
                    "pull": lambda: client.pull("llama3"),
                    "push": lambda: client.push("tiny"),
                    "create": lambda: client.create(model="x", from_="tiny"),
                    "copy": lambda: client.copy("tiny", "tiny2"),
                    "delete": lambda: client.delete("tiny"),
                }
                for name, attempt in attempts.items():
                    with pytest.raises(ollama.ResponseError) as caught:
                        attempt()
                    errors[name] = caught.value
                out["errors"] = errors
                out["after"] = client.chat(model="tiny", messages=MESSAGES, options=OPTIONS)
                client.close()
                return out

            out = await trio.to_thread.run_sync(scenario)
            await wait_nothing_held(host)

    assert out["version"] == {"version": OLLAMA_API_VERSION}
    names = {m.model for m in out["list"].models}
    assert names == {"tiny:latest", "tiny-embed:latest"}, names
    listed = out["list"].models[0]
    assert listed.size > 0 and len(listed.digest) == 64 and listed.details.format == "gguf"
    assert listed.details.family == "llama" and listed.modified_at is not None

    show = out["show"]
    assert show.details.family == "llama" and "completion" in show.capabilities
    assert "insert" in show.capabilities  # the demo model has FIM tokens
    assert "vision" not in show.capabilities
    assert show.modelinfo["general.architecture"] == "llama"
    assert "num_ctx" in show.parameters and show.template
    assert out["show_embed"].capabilities == ["embedding"]

    chat = out["chat"]
    assert chat.model == "tiny" and chat.message.role == "assistant" and chat.message.content
    _check_final(chat)
    assert chat.done_reason == "length" and chat.eval_count == 8

    parts = out["chat_stream"]
    assert all(p.done is False for p in parts[:-1]) and parts[-1].done is True
    assert all(p.model == "tiny:latest" for p in parts)
    _check_final(parts[-1])
    assert "".join(p.message.content for p in parts) == chat.message.content

    ps = out["ps"].models
    assert [m.model for m in ps] == ["tiny:latest"], ps
    assert ps[0].size > 0 and ps[0].context_length == 512 and ps[0].expires_at is not None

    _check_final(out["generate"])
    assert out["generate"].response
    gen_parts = out["generate_stream"]
    assert gen_parts[-1].done and all(not p.done for p in gen_parts[:-1])
    _check_final(gen_parts[-1])
    for key in ("raw", "infill"):
        _check_final(out[key])
        assert out[key].response, key
    for key in ("raw_stream", "infill_stream"):
        assert out[key][-1].done and len(out[key]) > 1, key
        _check_final(out[key][-1])
    _check_final(out["json"])

    embed = out["embed"]
    assert len(embed.embeddings) == 2 and embed.prompt_eval_count and embed.total_duration
    for vector in embed.embeddings:
        assert math.isclose(math.sqrt(sum(v * v for v in vector)), 1.0, rel_tol=1e-6)
    assert len(out["embed_one"].embeddings) == 1 and len(out["embed_one"].embeddings[0]) == 8
    assert len(out["embeddings"].embedding) > 8
    load = out["load"]
    assert load.done and load.done_reason == "load" and load.message.content == ""

    errors = out["errors"]
    _check_final(out["num_ctx"])
    expected_status = {
        "unknown": 404,
        "unknown_stream": 404,
        "unknown_show": 404,
        "images": 400,
        "embed_on_chat_model": 400,
        "chat_on_embed_model": 400,
        "template": 400,
        "bad_key": 401,
        "no_key": 401,
        "pull": 501,
        "push": 501,
        "create": 501,
        "copy": 501,
        "delete": 501,
    }
    assert {k: e.status_code for k, e in errors.items()} == expected_status
    assert errors["unknown"].error == "model 'nope' not found"
    assert errors["unknown_stream"].error == "model 'nope:latest' not found"
    assert "projector" in errors["images"].error
    assert "models folder" in errors["pull"].error
    assert errors["bad_key"].error == "invalid API key"
    _check_final(out["after"])


async def test_every_answer_matches_ollamas_types(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """Raw answers (and every streamed line) against the client's pydantic types, with no
    field Ollama does not document; errors are ``{"error": ...}`` alone."""
    with trio.fail_after(120):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, http):
            http.headers.update(AUTH)

            async def post(path: str, body: dict[str, Any], status: int = 200) -> Any:
                resp = await http.post(path, json=body)
                assert resp.status_code == status, (path, resp.status_code, resp.text)
                return resp

            version = (await http.get("/api/version")).json()
            assert set(version) == VERSION_FIELDS
            check_schema(ollama.ListResponse, (await http.get("/api/tags")).json())
            check_schema(ollama.ShowResponse, (await post("/api/show", {"model": "tiny"})).json())

            chat = {"model": "tiny", "messages": MESSAGES, "options": OPTIONS}
            check_schema(
                ollama.ChatResponse, (await post("/api/chat", {**chat, "stream": False})).json()
            )
            resp = await post("/api/chat", chat)  # stream is Ollama's default
            assert resp.headers["content-type"].startswith("application/x-ndjson")
            lines = _ndjson(resp.text)
            assert len(lines) > 2
            for line in lines:
                check_schema(ollama.ChatResponse, line)
            assert "done_reason" not in lines[0] and lines[-1]["done"] is True

            for extra in ({}, {"raw": True}, {"suffix": " end"}):
                gen = {"model": "tiny", "prompt": "Once", "options": OPTIONS, **extra}
                check_schema(
                    ollama.GenerateResponse,
                    (await post("/api/generate", {**gen, "stream": False})).json(),
                )
                for line in _ndjson((await post("/api/generate", gen)).text):
                    check_schema(ollama.GenerateResponse, line)

            check_schema(ollama.ProcessResponse, (await http.get("/api/ps")).json())
            embed = (await post("/api/embed", {"model": "tiny-embed", "input": "hi"})).json()
            check_schema(ollama.EmbedResponse, embed)
            legacy = (await post("/api/embeddings", {"model": "tiny-embed", "prompt": "hi"})).json()
            check_schema(ollama.EmbeddingsResponse, legacy)

            # errors: Ollama's shape, Ollama's statuses; the host keeps serving
            bad = await http.post("/api/chat", content=b"{not json")
            assert bad.status_code == 400 and set(bad.json()) == ERROR_FIELDS
            wrong = await post("/api/chat", {"model": "tiny", "messages": "hi"}, 400)
            assert set(wrong.json()) == ERROR_FIELDS and "messages" in wrong.json()["error"]
            missing = await post("/api/show", {"model": "nope"}, 404)
            assert missing.json() == {"error": "model 'nope' not found"}
            method = await http.get("/api/chat")
            assert method.status_code == 405 and set(method.json()) == ERROR_FIELDS
            for route in ("pull", "push", "create", "copy"):
                answer = await post(f"/api/{route}", {"model": "tiny"}, 501)
                assert set(answer.json()) == ERROR_FIELDS
            deleted = await http.request("DELETE", "/api/delete", json={"model": "tiny"})
            assert deleted.status_code == 501 and set(deleted.json()) == ERROR_FIELDS
            check_schema(
                ollama.ChatResponse, (await post("/api/chat", {**chat, "stream": False})).json()
            )

            # HEAD / is the probe Ollama's clients send: 200, no key, no body; GET / is
            # still the status page
            async with httpx.AsyncClient(base_url=str(http.base_url)) as anonymous:
                head = await anonymous.head("/")
                assert head.status_code == 200 and head.content == b""
                page = await anonymous.get("/")
                assert page.status_code == 200 and "text/html" in page.headers["content-type"]
            await wait_nothing_held(host)


# --------------------------------------------------------------------------- pinning

LAUNCH = re.compile(r"launch_slot_: id +(\d+) \| task (\d+)")


def _launched_slots(host: Host) -> list[int]:
    """The slot of every task the engine launched, from its own log, oldest first."""
    lines = host.models["tiny"].engine.log.tail(400)
    return [int(m.group(1)) for line in lines if (m := LAUNCH.search(line))]


async def test_every_completion_runs_on_its_granted_slot(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """Each engine route an Ollama request becomes is pinned to the scheduler's slot
    (the engine's own log says where each task ran), streamed or not."""
    routes: list[tuple[str, dict[str, Any], str]] = [
        ("/api/chat", {"messages": MESSAGES}, "/v1/chat/completions"),
        ("/api/generate", {"prompt": "Once"}, "/v1/chat/completions"),
        ("/api/generate", {"prompt": "Once", "raw": True}, "/completion"),
        ("/api/generate", {"prompt": "x = ", "suffix": ";"}, "/infill"),
    ]
    cfg = _cfg(tiny_model, state_dir, engine_binary, parallel=3)
    with trio.fail_after(120):
        async with running(cfg) as (host, http):
            http.headers.update(AUTH)
            runtime = host.models["tiny"]
            slots = set()
            for i, (route, body, engine_route) in enumerate(routes):
                for stream in (False, True):
                    before = len(_launched_slots(host))
                    # a session of its own each time, so the scheduler moves between slots
                    r = await http.post(
                        route,
                        json={**body, "model": "tiny", "options": OPTIONS, "stream": stream},
                        headers={"X-Session-Id": f"pin-{i}-{stream}"},
                    )
                    assert r.status_code == 200, (route, r.text)
                    await wait_until(
                        lambda n=before: len(_launched_slots(host)) > n,
                        within=10,
                        what="the engine's log line",
                    )
                    sent = [c for c in runtime.client.recent if c.action == engine_route]
                    assert _launched_slots(host)[-1] == sent[-1].slot, (route, stream)
                    slots.add(sent[-1].slot)
            assert len(slots) > 1


async def test_requests_are_keyless_unless_a_session_header_names_one(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """Ollama's bodies name no conversation: a request is its caller's keyless owner's
    (``[scheduler] keyless = "shared"``), or the session a header names; each caller's
    own."""
    with trio.fail_after(120):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, http):
            http.headers.update(AUTH)
            chat = {"model": "tiny", "messages": MESSAGES, "options": OPTIONS, "stream": False}
            assert (await http.post("/api/chat", json=chat)).status_code == 200
            named = await http.post(
                "/api/generate",
                json={"model": "tiny", "prompt": "Hi", "options": OPTIONS, "stream": False},
                headers={"X-Session-Id": "ha-1"},
            )
            assert named.status_code == 200
            await wait_nothing_held(host)
            assert host.scheduler is not None
            owners = set(host.scheduler.statistics().slot_owners["tiny"].values())
            caller = host.sessions.caller(KEY)
            assert hash_session(host.sessions.keyless(caller)) in owners
            assert hash_session(host.sessions.session(caller, "ha-1")) in owners


# --------------------------------------------------------------------------- keep_alive


def _state(host: Host, model: str = "tiny") -> EngineState:
    return host.models[model].engine.state.value


async def test_keep_alive(tiny_model: Path, state_dir: Path, engine_binary: EngineBinary) -> None:
    """0 stops the engine after the request; a duration is the idle TTL from then on; a
    negative value keeps it loaded; a request without one restores the configured TTL."""
    cfg = _cfg(tiny_model, state_dir, engine_binary, engine={"health_interval": 0.25})
    with trio.fail_after(120):
        async with running(cfg) as (host, http):
            http.headers.update(AUTH)
            chat = {"model": "tiny", "messages": MESSAGES, "options": OPTIONS, "stream": False}
            runtime = host.models["tiny"]

            resp = await http.post("/api/chat", json={**chat, "keep_alive": 0})
            assert resp.status_code == 200, resp.text
            took = await wait_until(
                lambda: _state(host) is EngineState.STOPPED, within=10, what="engine stopped"
            )
            print(f"keep_alive 0: the engine stopped {took * 1000:.0f} ms after the answer")

            # streamed, with a duration: loaded again, released once idle that long
            resp = await http.post("/api/chat", json={**chat, "stream": True, "keep_alive": "1s"})
            assert resp.status_code == 200 and _ndjson(resp.text)[-1]["done"] is True
            assert runtime.engine.timing.idle_ttl == 1.0
            assert _state(host) is EngineState.READY
            await wait_until(
                lambda: _state(host) is EngineState.STOPPED, within=10, what="idle TTL release"
            )

            # negative: kept loaded (ps says so: expires in Go's "forever")
            resp = await http.post("/api/generate", json={"model": "tiny", "keep_alive": -1})
            assert resp.status_code == 200 and resp.json()["done_reason"] == "load"
            assert _state(host) is EngineState.READY and runtime.engine.timing.idle_ttl == 0
            ps = (await http.get("/api/ps")).json()["models"]
            assert ps[0]["expires_at"] > "2200"

            # none: the configured idle_ttl again
            runtime.set_idle_ttl(30)
            resp = await http.post("/api/chat", json=chat)
            assert resp.status_code == 200
            assert runtime.engine.timing.idle_ttl == runtime.config.idle_ttl == 0

            # a load-only request with keep_alive 0 unloads
            resp = await http.post(
                "/api/chat", json={"model": "tiny", "messages": [], "keep_alive": 0}
            )
            assert resp.json()["done_reason"] == "unload"
            await wait_until(
                lambda: _state(host) is EngineState.STOPPED, within=10, what="unloaded"
            )
            # load figures: the next request had to start the engine
            resp = await http.post("/api/chat", json=chat)
            body = resp.json()
            assert body["load_duration"] > 0 and body["total_duration"] > body["load_duration"]
            resp = await http.post("/api/chat", json=chat)
            assert "load_duration" not in resp.json()  # resident: Ollama leaves a zero out


# --------------------------------------------------------------------------- walk-away


async def _abort(stream: trio.SocketStream) -> None:
    """Leave the way a killed client does: a reset, not a polite close."""
    stream.socket.setsockopt(
        socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
    )
    await stream.aclose()


LONG_CHAT = {
    "model": "tiny",
    "messages": MESSAGES,
    "options": {"num_predict": 16000, "temperature": 0},
}


async def _warmed(host: Host, http: httpx.AsyncClient) -> tuple[str, str, int]:
    """Answer a short chat (``http`` gets the API key), then: the engine's URL, and the
    host's address and port for raw connections."""
    http.headers.update(AUTH)
    warm = await http.post("/api/chat", json={**LONG_CHAT, "stream": False, "options": OPTIONS})
    assert warm.status_code == 200
    base_url = host.models["tiny"].engine.base_url
    assert base_url is not None
    address, port = _base(http).removeprefix("http://").rsplit(":", 1)
    return base_url, address, int(port)


async def _post_raw(address: str, port: int, path: str, body: Any) -> trio.SocketStream:
    """A raw connection that has sent ``body`` to ``path``, with the API key."""
    stream = await trio.open_tcp_stream(address, port)
    payload = json.dumps(body).encode()
    await stream.send_all(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + f"Authorization: Bearer {KEY}\r\n".encode()
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return stream


async def _read_lines(stream: trio.SocketStream, n: int) -> bytes:
    """Read a streamed answer until ``n`` of its lines (not the last) have come."""
    buf = b""
    while buf.count(b'"done":false') < n:
        chunk = await stream.receive_some(65536)
        assert chunk, buf[:300]
        buf += chunk
    assert b"application/x-ndjson" in buf
    return buf


async def test_client_walking_away_mid_stream_stops_generation(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """A streamed ``/api/chat`` whose client leaves after two lines: the engine's slot is
    idle again within a second, and nothing is held."""
    cfg = _cfg(tiny_model, state_dir, engine_binary, parallel=1, ctx_per_slot=16384)
    with trio.fail_after(120):
        async with running(cfg) as (host, http):
            base_url, address, port = await _warmed(host, http)
            for _ in range(2):
                stream = await _post_raw(address, port, "/api/chat", LONG_CHAT)
                await _read_lines(stream, 2)
                assert await slots_busy(base_url) == [0]
                await _abort(stream)

                async def idle() -> bool:
                    return await slots_busy(base_url) == []

                took = await wait_until(idle, within=1.0, interval=0.05, what="generation stopped")
                print(f"generation stopped {took * 1000:.0f} ms after the client left")
                await wait_nothing_held(host, within=3)
            after = await http.post(
                "/api/chat", json={**LONG_CHAT, "stream": False, "options": OPTIONS}
            )
            assert after.status_code == 200


async def test_a_client_that_leaves_before_the_stream_starts_ends_it_at_once(
    tiny_model: Path,
    state_dir: Path,
    engine_binary: EngineBinary,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Quart route's stream whose client leaves after the route has answered but before
    the response went out (here while Quart's after-request hooks run) is never sent, so
    its body's own cleanup never runs: the connection ends the job, its slot and the
    engine's generation at once, not after ``stream_start_timeout`` (30 s here). The same
    request, read, is still generating 5 s later: what was cut would have run on."""
    import gezel_trio.api.metrics_endpoint as metrics_endpoint

    cfg = _cfg(tiny_model, state_dir, engine_binary, parallel=1, ctx_per_slot=16384)
    cfg.server.stream_start_timeout = 30.0
    real_record = metrics_endpoint.record_answer
    answered = trio.Event()

    async def hooks_take_their_time(exchange: Any, resp: Any, metrics: Any) -> Any:
        if resp.mimetype == "application/x-ndjson":
            answered.set()
            await trio.sleep_forever()  # until the client's leaving cancels the request
        return await real_record(exchange, resp, metrics)

    with trio.fail_after(120):
        async with running(cfg) as (host, http):
            base_url, address, port = await _warmed(host, http)

            async def idle() -> bool:
                return await slots_busy(base_url) == []

            monkeypatch.setattr(metrics_endpoint, "record_answer", hooks_take_their_time)
            gone = await _post_raw(address, port, "/api/chat", LONG_CHAT)
            await answered.wait()
            await _abort(gone)
            took = await wait_until(idle, within=5, interval=0.05, what="generation ended")
            await wait_nothing_held(host, within=3)
            print(f"generation ended {took * 1000:.0f} ms after the client left")
            monkeypatch.undo()
            # the engine's truth: the same request, read, still generates after the 5 s
            # the one cut was given
            read = await _post_raw(address, port, "/api/chat", LONG_CHAT)
            await _read_lines(read, 2)
            with trio.move_on_after(5):
                while await read.receive_some(65536):
                    pass
            assert await slots_busy(base_url) == [0], "it ends within 5 s on its own"
            await _abort(read)
            await wait_until(idle, within=5, interval=0.05, what="generation stopped")
            await wait_nothing_held(host, within=3)


# --------------------------------------------------------------------------- ollama_listen


async def test_ollama_listen_is_a_second_listener_with_the_same_keys(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    cfg = _cfg(tiny_model, state_dir, engine_binary)
    cfg.server.ollama_listen = "127.0.0.1:0"
    with trio.fail_after(120):
        async with open_server(cfg) as (host, binds):
            assert len(binds) == 2 and binds[0] != binds[1]
            assert host.urls == binds

            def scenario() -> tuple[Any, Any, ollama.ResponseError]:
                client = ollama.Client(host=binds[1], headers=AUTH, timeout=60)
                listed = client.list()
                chat = client.chat(model="tiny", messages=MESSAGES, options=OPTIONS)
                with pytest.raises(ollama.ResponseError) as denied:
                    ollama.Client(host=binds[1]).list()
                return listed, chat, denied.value

            listed, chat, denied = await trio.to_thread.run_sync(scenario)
            assert [m.model for m in listed.models] == ["tiny:latest", "tiny-embed:latest"]
            _check_final(chat)
            assert denied.status_code == 401
            # the same app: every route, the first listener's included
            async with httpx.AsyncClient(base_url=binds[1], headers=AUTH) as second:
                assert (await second.get("/v1/models")).status_code == 200


async def test_ollama_listen_on_a_taken_port_names_it(state_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = make_config([], state_dir=state_dir)
        cfg.server.ollama_listen = f"127.0.0.1:{port}"
        with pytest.raises(ListenError, match=f"127.0.0.1:{port}.*ollama_listen"):
            async with open_server(cfg):
                pass


def test_ollama_listen_must_be_host_and_port(state_dir: Path) -> None:
    cfg = make_config([], state_dir=state_dir)
    cfg.server.ollama_listen = "11434"
    with pytest.raises(ConfigError, match=r"server\.ollama_listen"):
        validate(cfg)
