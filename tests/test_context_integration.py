"""Every place that reports a model's context says what the engine runs: a real llama-server's
own ``/slots`` ``n_ctx``, read in the same test, against ``/v1/models``, ``/api/show``,
``/api/tags``, ``/api/ps``, ``/api/status``, ``gezel-trio ps``, check-config and the value the
limits read, for every way the context is set: ``ctx_per_slot``, ``-c`` in ``args``,
``models_dir``, the defaults, a context above the trained one, and Ollama's ``num_ctx``.

The stopped model's reports (the prediction from the plan and the flags) must equal what the
engine then runs; once it runs, they are its ``/slots`` reading."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gezel_trio.cli.client import PS_HEADERS, ps_rows
from gezel_trio.config.check import check_config
from gezel_trio.config.models_dir import models_from_dir
from gezel_trio.config.schema import Config, ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.host import Host

from ._engine_bin import open_llama_server
from .conftest import make_config, running

SMOLLM2_TRAINED = 8192


async def engine_slots(host: Host, model_id: str) -> tuple[int, int]:
    """The engine's own answer: its slots and their ``n_ctx`` (all equal), from ``/slots``."""
    url = host.models[model_id].engine.base_url
    assert url is not None
    async with httpx.AsyncClient() as http:
        rows = (await http.get(url + "/slots", timeout=10)).json()
    sizes = {row["n_ctx"] for row in rows}
    assert len(sizes) == 1, rows
    return len(rows), sizes.pop()


async def reported(client: httpx.AsyncClient, host: Host, model_id: str) -> dict[str, Any]:
    """What every reporting place says of ``model_id``'s context per slot (and slots)."""
    listing = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}[model_id]
    show = (await client.post("/api/show", json={"model": model_id})).json()
    num_ctx = dict(line.split() for line in show["parameters"].splitlines())["num_ctx"]
    tags = {m["model"].split(":")[0]: m for m in (await client.get("/api/tags")).json()["models"]}
    status = (await client.get("/api/status")).json()
    engine = next(e for e in status["engines"] if e["model"] == model_id)
    row = dict(zip(PS_HEADERS, next(r for r in ps_rows(status) if r[0] == model_id), strict=True))
    out = {
        "/v1/models ctx_per_slot": listing["ctx_per_slot"],
        "/v1/models meta.n_ctx": listing["meta"]["n_ctx"],
        "/api/show num_ctx": int(num_ctx),
        "/api/tags context_length": tags[model_id]["details"]["context_length"],
        "/api/status ctx_per_slot": engine["ctx_per_slot"],
        "ps CONTEXT": row["CONTEXT"],
        "limits": host.models[model_id].ctx_per_slot,
    }
    ps = {m["model"].split(":")[0]: m for m in (await client.get("/api/ps")).json()["models"]}
    if model_id in ps:
        out["/api/ps context_length"] = ps[model_id]["context_length"]
    return {"parallel": listing["parallel"], "ctx": out}


def checked(config: Config, model_id: str) -> int:
    """What check-config says the model's slots will get."""
    report = check_config(config, None)
    assert report.ok, report.problems
    plan = report.plans[model_id]
    assert f"x {plan['runs_ctx_per_slot']} tokens" in plan["summary"]
    return int(plan["runs_ctx_per_slot"])


async def agree(config: Config, model_id: str) -> tuple[int, int]:
    """Serve ``config``; before the engine runs, every report says one context and check-config
    says the same; load the model; then every report says the engine's ``/slots`` n_ctx, which
    is that same context. Returns the engine's (slots, n_ctx)."""
    predicted = checked(config, model_id)
    async with running(config) as (host, client):
        before = await reported(client, host, model_id)
        assert set(before["ctx"].values()) == {predicted}, before
        with trio.fail_after(120):
            loaded = await client.post(f"/api/models/{model_id}/load", timeout=120)
        assert loaded.status_code == 200, loaded.text
        slots, n_ctx = await engine_slots(host, model_id)
        after = await reported(client, host, model_id)
        assert "/api/ps context_length" in after["ctx"]
        assert set(after["ctx"].values()) == {n_ctx}, (n_ctx, after)
        assert after["parallel"] == before["parallel"] == slots
        assert n_ctx == predicted
        return slots, n_ctx


async def test_ctx_per_slot_is_reported_as_the_engine_pads_it(
    engine_binary: EngineBinary, tiny_model: Path, state_dir: Path
) -> None:
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=2, ctx_per_slot=1000)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    assert await agree(cfg, "tiny") == (2, 1024)  # llama.cpp pads a slot to 256 tokens


async def test_the_last_ctx_size_in_args_is_what_is_reported(
    engine_binary: EngineBinary, tiny_model: Path, state_dir: Path
) -> None:
    cfg = make_config(
        [
            ModelConfig(
                id="tiny",
                path=str(tiny_model),
                ctx_per_slot=512,
                args=["--ctx-size", "8192", "-c", "1536", "-np", "3"],
            )
        ],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    assert await agree(cfg, "tiny") == (3, 512)


async def test_a_models_dir_model_gets_its_trained_context(
    engine_binary: EngineBinary, tiny_model: Path, state_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny_model, folder / "dirmodel.gguf")
    cfg = make_config([], state_dir=state_dir, engine_binary=engine_binary)
    cfg.engine.models_dir = str(folder)
    assert [m.id for m in models_from_dir([], str(folder))] == ["dirmodel"]
    assert await agree(cfg, "dirmodel") == (2, 4096)  # the demo model's trained context


async def test_smollm2_by_default_gets_its_trained_context(
    engine_binary: EngineBinary, smollm2: Path, state_dir: Path
) -> None:
    cfg = make_config(
        [ModelConfig(id="smollm2", path=str(smollm2))],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    slots, n_ctx = await agree(cfg, "smollm2")
    # Bare llama-server -m smollm2.gguf gives every slot the trained context: so does the host.
    assert n_ctx == SMOLLM2_TRAINED and slots == 2


async def test_a_context_above_the_trained_one_runs_as_asked(
    engine_binary: EngineBinary, smollm2: Path, state_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_config(
        [ModelConfig(id="smollm2", path=str(smollm2), parallel=1, ctx_per_slot=16384)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    report = check_config(cfg, None)
    assert any("above the model's trained context 8192" in w for w in report.warnings)
    with caplog.at_level(logging.WARNING, logger="gezel_trio.host.placement"):
        assert await agree(cfg, "smollm2") == (1, 16384)
    assert "above its trained context 8192" in caplog.text


async def test_ollama_num_ctx_does_not_change_the_reported_context(
    engine_binary: EngineBinary, tiny_model: Path, state_dir: Path
) -> None:
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=768)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    async with running(cfg) as (host, client):
        with trio.fail_after(120):
            answer = await client.post(
                "/api/generate",
                json={
                    "model": "tiny",
                    "prompt": "hello",
                    "stream": False,
                    "options": {"num_ctx": 256, "num_predict": 4},
                },
                timeout=120,
            )
        assert answer.status_code == 200, answer.text
        slots, n_ctx = await engine_slots(host, "tiny")
        seen = await reported(client, host, "tiny")
        assert (slots, n_ctx) == (1, 768)
        assert set(seen["ctx"].values()) == {n_ctx}, seen


async def test_an_external_engine_is_reported_as_it_runs(
    engine_binary: EngineBinary, tiny_model: Path, state_dir: Path
) -> None:
    """An engine the host does not own: what its ``/slots`` says, whatever its config said."""
    async with open_llama_server(tiny_model, parallel=3, ctx=1536) as engine:
        cfg = make_config(
            [ModelConfig(id="ext", url=engine.base_url, ctx_per_slot=4096)],
            state_dir=state_dir,
            engine_binary=engine_binary,
        )
        async with running(cfg) as (host, client):
            with trio.fail_after(60):
                loaded = await client.post("/api/models/ext/load", timeout=60)
            assert loaded.status_code == 200, loaded.text
            slots, n_ctx = await engine_slots(host, "ext")
            seen = await reported(client, host, "ext")
            assert (slots, n_ctx) == (3, 512)
            assert set(seen["ctx"].values()) == {n_ctx}, seen
            assert seen["parallel"] == slots


async def test_a_ctx_size_in_args_is_planned_for_the_kv_the_engine_allocates(
    engine_binary: EngineBinary, tiny_model: Path, state_dir: Path
) -> None:
    """``-c`` in args above what a slot may use (the demo model is trained on 4,096): the
    engine caps each slot at 4,096 but allocates the KV of the whole ``-c``; the plan (and
    the memory reserved) counts what its log says it allocated."""
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), args=["-c", "16384", "-lv", "4"])],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    async with running(cfg) as (host, client):
        with trio.fail_after(120):
            loaded = await client.post("/api/models/tiny/load", timeout=120)
        assert loaded.status_code == 200, loaded.text
        slots, n_ctx = await engine_slots(host, "tiny")
        assert (slots, n_ctx) == (2, 4096)
        seen = await reported(client, host, "tiny")
        assert set(seen["ctx"].values()) == {n_ctx}, seen
        runtime = host.models["tiny"]
        sizes = [
            float(line.split("size =")[1].split("MiB")[0])
            for line in runtime.engine.log.tail(400)
            if "llama_kv_cache: size =" in line
        ]
        assert sizes, runtime.engine.log.summary()
        plan = runtime.plan
        assert plan is not None and plan["ctx_per_slot"] * plan["parallel"] == 16384
        assert plan["kv_bytes"] == round(sizes[-1] * 1024**2)
