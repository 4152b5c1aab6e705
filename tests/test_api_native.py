"""The llama.cpp-native passthrough against a real llama-server behind a real hypercorn socket."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gezel_trio.api.native import PUBLIC_SLOT_FIELDS
from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary

from ._engine_bin import ENGINE_LIMITS
from .conftest import make_config, running


def _cfg(tiny_model: Path, state_dir: Path, engine_binary: EngineBinary) -> Any:
    return make_config(
        [
            ModelConfig(id="tiny", path=str(tiny_model), parallel=2, ctx_per_slot=512),
            ModelConfig(id="other", path=str(tiny_model), parallel=1, ctx_per_slot=256),
        ],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]  # type: ignore[no-any-return]


async def test_native_passthrough(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Make the engine put conversation text into /slots, as a debug build would.
    monkeypatch.setenv("LLAMA_SERVER_SLOTS_DEBUG", "1")
    with trio.fail_after(60):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, client):
            engine = host.models["tiny"].engine
            prompt = {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0}

            # /completion with a model field, and through the prefix: the same answer
            r1 = await client.post("/completion", json={**prompt, "model": "tiny"})
            assert r1.status_code == 200, r1.text
            a1 = r1.json()
            assert isinstance(a1["content"], str) and a1["tokens_predicted"] > 0
            r2 = await client.post("/upstream/tiny/completion", json=prompt)
            assert r2.status_code == 200, r2.text
            assert r2.json()["content"] == a1["content"]
            assert host.models["other"].engine.pid is None  # only the chosen model ran
            assert engine.base_url is not None

            # the engine's own answers pass through untouched
            async with httpx.AsyncClient(limits=ENGINE_LIMITS, base_url=engine.base_url) as direct:
                tok_body = {"content": "hello world", "with_pieces": False}
                direct_tok = (await direct.post("/tokenize", json=tok_body)).json()
                via_field = await client.post("/tokenize", json={**tok_body, "model": "tiny"})
                via_prefix = await client.post("/upstream/tiny/tokenize", json=tok_body)
                assert via_field.status_code == via_prefix.status_code == 200
                assert via_field.json() == via_prefix.json() == direct_tok
                tokens = direct_tok["tokens"]
                assert tokens
                detok = await client.post("/upstream/tiny/detokenize", json={"tokens": tokens})
                assert detok.status_code == 200
                assert (
                    detok.json()
                    == (await direct.post("/detokenize", json={"tokens": tokens})).json()
                )
                assert "hello world" in detok.json()["content"]

                props = await client.get("/props", params={"model": "tiny"})
                assert props.status_code == 200
                direct_props = (await direct.get("/props")).json()
                assert (
                    props.json()["model_path"]
                    == direct_props["model_path"]
                    == str(host.models["tiny"].config.path)
                )
                assert props.json()["default_generation_settings"]["n_ctx"] == 512
                assert (await client.get("/upstream/tiny/props")).json()[
                    "model_path"
                ] == direct_props["model_path"]

            # /slots: read-only, one entry per slot, only the allowed fields
            async with httpx.AsyncClient(limits=ENGINE_LIMITS, base_url=engine.base_url) as direct:
                raw = (await direct.get("/slots")).json()
            assert any("prompt" in s for s in raw)  # the engine does show it
            slots = await client.get("/upstream/tiny/slots")
            assert slots.status_code == 200, slots.text
            listed = slots.json()
            assert [s["id"] for s in listed] == [0, 1]
            for s in listed:  # an allow-list: no prompt, text, params, stop words, grammar
                assert set(s) <= {*PUBLIC_SLOT_FIELDS, "next_token"}, set(s)
            assert any("params" in s or "prompt" in s for s in raw)  # what was left out
            assert (await client.get("/slots", params={"model": "tiny"})).json()[0]["id"] == 0
            for path in ("/slots", "/upstream/tiny/slots", "/props"):
                err = _error(await client.post(path, json={}), 405)
                assert "not allowed" in err["message"]
            assert (await client.post("/upstream/tiny/slots/0?action=erase")).status_code == 404

            # streaming /completion relays the engine's SSE
            async with client.stream(
                "POST", "/upstream/tiny/completion", json={**prompt, "stream": True}
            ) as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                events = [
                    json.loads(line[6:])
                    async for line in resp.aiter_lines()
                    if line.startswith("data: ")
                ]
            assert len(events) >= 2 and events[-1]["stop"] is True
            assert "".join(e.get("content", "") for e in events) == a1["content"]

            # errors: a prefix/body conflict, an unknown model, bad fields
            err = _error(
                await client.post(
                    "/upstream/tiny/tokenize", json={"content": "x", "model": "other"}
                ),
                400,
            )
            assert err["param"] == "model"
            err = _error(await client.post("/upstream/nope/completion", json=prompt), 404)
            assert err["code"] == "model_not_found"
            err = _error(await client.get("/props", params={"model": "nope"}), 404)
            assert "nope" in err["message"]
            assert (
                _error(await client.post("/tokenize", json={"content": 5}), 400)["param"]
                == "content"
            )
            assert (
                _error(await client.post("/detokenize", json={"tokens": ["a"]}), 400)["param"]
                == "tokens"
            )
            assert (
                _error(await client.post("/completion", json={"prompt": {"x": 1}}), 400)["param"]
                == "prompt"
            )
            assert (
                _error(
                    await client.post("/completion", json={"prompt": "x", "n_predict": "8"}), 400
                )["param"]
                == "n_predict"
            )


async def test_client_id_slot_is_replaced_by_the_schedulers(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    """A client's ``id_slot`` is dropped: the session keeps its slot whatever the client asks."""
    with trio.fail_after(60):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (_, client):
            base = {"prompt": "The cat sat", "n_predict": 4, "temperature": 0, "model": "tiny"}
            first = await client.post("/completion", json={**base, "prompt_cache_key": "chat-A"})
            assert first.status_code == 200, first.text
            home = first.json()["id_slot"]
            for asked in (0, 1, 1, 0, 7):
                resp = await client.post(
                    "/completion",
                    json={**base, "prompt_cache_key": "chat-A", "id_slot": asked},
                )
                assert resp.status_code == 200, resp.text
                assert resp.json()["id_slot"] == home, (asked, resp.json()["id_slot"])
            # the session also reaches its slot through X-Session-Id, with a hostile id_slot
            resp = await client.post(
                "/upstream/tiny/completion",
                json={**base, "id_slot": 1 - home},
                headers={"X-Session-Id": "chat-A"},
            )
            assert resp.json()["id_slot"] == home
            owners = (await client.get("/api/status")).json()["scheduler"]["slot_owners"]["tiny"]
            assert owners[str(home)] is not None
            assert owners.get(str(1 - home)) is None
