"""The error contract, case by case, on one real host that keeps serving after each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary

from ._engine_bin import ENGINE_LIMITS
from .conftest import make_config, running

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
LONG_PROMPT = " ".join(f"w{i}" for i in range(1500))  # far more tokens than 256 per slot


def _broken_tokenizer_model(tiny_model: Path, dest: Path) -> Path:
    """A GGUF whose header reads fine but that llama-server refuses to load (unknown tokenizer)."""
    data = bytearray(tiny_model.read_bytes())
    key = b"tokenizer.ggml.model"
    at = data.index(key) + len(key) + 4 + 8  # type (u32), string length (u64)
    assert data[at : at + 5] == b"llama"
    data[at : at + 5] = b"zzzzz"
    dest.write_bytes(bytes(data))
    return dest


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, (status, resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert {"message", "type", "param", "code"} <= set(err)
    return err  # type: ignore[no-any-return]


async def _still_serving(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).status_code == 200
    resp = await client.post(
        "/v1/chat/completions", json={**CHAT, "model": "tiny", "max_tokens": 1}
    )
    assert resp.status_code == 200, resp.text


async def test_error_contract(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, tmp_path: Path
) -> None:
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("these are not the weights you are looking for\n" * 10)
    bad_vocab = _broken_tokenizer_model(tiny_model, tmp_path / "bad-vocab.gguf")
    cfg = make_config(
        [
            ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=256),
            ModelConfig(id="bad-vocab", path=str(bad_vocab), parallel=1, ctx_per_slot=256),
            ModelConfig(id="not-gguf", path=str(not_gguf), parallel=1, ctx_per_slot=256),
        ],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server={"max_body_bytes": 16384},
    )
    with trio.fail_after(60):
        async with running(cfg) as (host, client):
            await _still_serving(client)

            # malformed JSON: 400
            for raw in (b"{", b'{"messages": [}', b"\xff\xfe", b"[1, 2]", b"", b'{"a": NaN}'):
                err = _error(
                    await client.post(
                        "/v1/chat/completions",
                        content=raw,
                        headers={"content-type": "application/json"},
                    ),
                    400,
                )
                assert err["type"] == "invalid_request_error"
            await _still_serving(client)

            # wrong types: 400 naming the field
            cases = [
                ("/v1/chat/completions", {"messages": "hi"}, "messages"),
                ("/v1/chat/completions", {**CHAT, "max_tokens": "ten"}, "max_tokens"),
                ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
                ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
                ("/v1/chat/completions", {**CHAT, "model": 7}, "model"),
                (
                    "/v1/chat/completions",
                    {**CHAT, "stream_options": {"include_usage": 1}},
                    "stream_options.include_usage",
                ),
                ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
                ("/v1/completions", {"max_tokens": 3}, "prompt"),
                ("/v1/embeddings", {"model": "tiny", "input": 42}, "input"),
                (
                    "/v1/embeddings",
                    {"model": "tiny", "input": "hi"},
                    "model",
                ),  # not an embedding model
                ("/tokenize", {"content": ["x"]}, "content"),
            ]
            for path, body, field in cases:
                err = _error(await client.post(path, json=body), 400)
                assert err["param"] == field, (path, body, err)
                assert field in err["message"]
            await _still_serving(client)

            # body over the limit: 413
            big = {**CHAT, "messages": [{"role": "user", "content": "x" * 32768}]}
            err = _error(await client.post("/v1/chat/completions", json=big), 413)
            assert "16384" in err["message"]
            await _still_serving(client)

            # unknown model: 404 naming it and the known ones
            err = _error(
                await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-5"}), 404
            )
            assert err["code"] == "model_not_found"
            assert "gpt-5" in err["message"] and "tiny" in err["message"]
            await _still_serving(client)

            # model locked: 409, and nothing starts for it
            assert (await client.put("/api/config", json={"lock_model": True})).status_code == 200
            err = _error(
                await client.post("/v1/chat/completions", json={**CHAT, "model": "bad-vocab"}), 409
            )
            assert err["code"] == "model_locked"
            assert host.models["bad-vocab"].engine.starts == 0
            await _still_serving(client)
            assert (await client.put("/api/config", json={"lock_model": False})).status_code == 200

            # an engine that fails to start: 503 with its last log lines
            err = _error(
                await client.post("/v1/chat/completions", json={**CHAT, "model": "bad-vocab"}), 503
            )
            assert err["code"] == "engine_failed"
            engine_lines = [
                ln.strip()
                for ln in host.models["bad-vocab"].engine.log.tail(200)
                if ln.strip() and not ln.startswith("[gezel]")
            ]
            assert engine_lines, "the engine wrote nothing"
            assert any(ln in err["message"] for ln in engine_lines), err["message"]
            assert host.models["bad-vocab"].engine.starts == 1
            await _still_serving(client)

            # a file that is not GGUF at all: 503 that says so (it never reaches the engine)
            err = _error(
                await client.post("/v1/chat/completions", json={**CHAT, "model": "not-gguf"}), 503
            )
            assert str(not_gguf) in err["message"] and "GGUF" in err["message"]
            await _still_serving(client)

            # upstream errors are relayed faithfully: the engine's own status and body
            engine = host.models["tiny"].engine
            assert engine.base_url is not None
            long_chat = {
                **CHAT,
                "model": "tiny",
                "messages": [{"role": "user", "content": LONG_PROMPT}],
            }
            async with httpx.AsyncClient(limits=ENGINE_LIMITS, base_url=engine.base_url) as direct:
                want = await direct.post("/v1/chat/completions", json=long_chat)
                want_native = await direct.post(
                    "/completion", json={"prompt": LONG_PROMPT, "n_predict": 2}
                )
            assert want.status_code == 400, want.text
            got = await client.post("/v1/chat/completions", json=long_chat)
            assert got.status_code == want.status_code
            assert got.json() == want.json()
            assert "context" in got.json()["error"]["message"]
            async with client.stream(
                "POST", "/v1/chat/completions", json={**long_chat, "stream": True}
            ) as s:
                body = await s.aread()
                assert s.status_code == 400
            assert json.loads(body) == want.json()
            got = await client.post(
                "/upstream/tiny/completion", json={"prompt": LONG_PROMPT, "n_predict": 2}
            )
            assert (got.status_code, got.json()) == (want_native.status_code, want_native.json())
            await _still_serving(client)

            # a max_tokens beyond the slot's context is served (the engine stops when the
            # slot is full: tests/test_limits.py); beyond what the engine reads, both refuse
            served = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100000})
            assert served.status_code == 200, served.text
            err = _error(
                await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2**31}), 400
            )
            assert err["param"] == "max_tokens"
            await _still_serving(client)


async def test_queue_full_is_503_with_retry_after(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """With a queue of one, requests that arrive while the engine loads overflow it."""
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=256)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        scheduler={"max_queue": 1},
    )
    results: list[httpx.Response] = []
    with trio.fail_after(60):
        async with running(cfg) as (host, client):

            async def one() -> None:
                results.append(await client.post("/v1/chat/completions", json=CHAT))

            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(one)
            statuses = sorted(r.status_code for r in results)
            assert statuses[0] == 200 and statuses[-1] == 503, statuses
            assert set(statuses) == {200, 503}
            for r in results:
                if r.status_code == 503:
                    err = _error(r, 503)
                    assert err["code"] == "queue_full"
                    assert int(r.headers["Retry-After"]) >= 1
            await _still_serving(client)
            assert host.models["tiny"].engine.starts == 1
