"""Images beside the chats, through the host: a real sd-server with the demo image model,
supervised by the host, served on OpenAI's image route, under the arbiter.

The binary resolves like the host's (``sd_server_binary``); without one these fail with
the resolver's message (never skipped).
"""

from __future__ import annotations

import base64
import logging
import os
import signal
from functools import partial
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import trio

from benchmarks._raw_client import post_json, reset
from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.demo_image_model import DemoImageModel, demo_image_model_path
from gezel_trio.errors import BadRequest, UnknownModel
from gezel_trio.host.image_runtime import ImageRuntime
from gezel_trio.images.job import ImageJob, ImageProgress

from .conftest import make_config, running
from .fault_tools import wait_nothing_held, wait_until
from .test_image_engine import png_size

KEY = "sk-test-images"
STEPS = 4


@pytest.fixture(scope="session")
def image_model(models_dir: Path) -> DemoImageModel:
    return demo_image_model_path(cache_dir=models_dir)


def image_config(model: DemoImageModel, *, model_id: str = "img", **extra: Any) -> ModelConfig:
    return ModelConfig(
        id=model_id,
        kind="image",
        files={
            "diffusion_model": str(model.diffusion_model),
            "llm": str(model.llm),
            "taesd": str(model.vae),
        },
        args=["--steps", str(STEPS)],
        **extra,
    )


async def test_openai_sdk_generates_a_png_of_the_size_asked(
    image_model: DemoImageModel,
    tiny_model: Path,
    sd_server_binary: EngineBinary,
    engine_binary: EngineBinary,
    state_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gezel_trio.requests")
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1), image_config(image_model)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server={"api_keys": [KEY]},
        engine={"sd_server": str(sd_server_binary.path)},
    )
    with trio.fail_after(240):
        async with running(cfg) as (host, http):
            base = str(http.base_url).rstrip("/") + "/v1"

            def scenario() -> dict[str, Any]:
                client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=200)
                out: dict[str, Any] = {}
                out["image"] = client.images.generate(
                    model="img",
                    prompt="a red apple",
                    size="64x48",
                    n=1,  # type: ignore[arg-type]
                )
                with pytest.raises(openai.BadRequestError) as url:
                    client.images.generate(model="img", prompt="x", response_format="url")
                out["url"] = url.value
                with pytest.raises(openai.BadRequestError) as text:
                    client.images.generate(model="tiny", prompt="x")
                out["text"] = text.value
                with pytest.raises(openai.NotFoundError) as unknown:
                    client.images.generate(model="no-such-model", prompt="x")
                out["unknown"] = unknown.value
                with pytest.raises(openai.BadRequestError) as chat:
                    client.chat.completions.create(
                        model="img", messages=[{"role": "user", "content": "hi"}]
                    )
                out["chat"] = chat.value
                out["models"] = client.models.list()
                return out

            out = await trio.to_thread.run_sync(scenario)
            (data,) = out["image"].data
            png = base64.b64decode(data.b64_json, validate=True)
            assert png_size(png) == (64, 48)
            assert "b64_json" in str(out["url"]) and out["url"].body["param"] == "response_format"
            assert "is a text model" in str(out["text"])
            assert "no-such-model" in str(out["unknown"])
            assert "is an image model" in str(out["chat"])
            listed = {m.id: m for m in out["models"].data}
            assert listed["img"].model_extra["capabilities"] == ["image"]
            status = host.status()
            row = next(m for m in status["engines"] if m["model"] == "img")
            assert row["kind"] == "image" and row["state"] == "ready"
            assert row["job"] is None  # no render runs now
            assert row["calibration"] == {}  # no co-batch probe of an image engine
            auth = {"Authorization": f"Bearer {KEY}"}
            r = await http.post("/api/models/img/calibrate", headers=auth)
            assert r.status_code == 400 and "image model" in r.json()["error"]["message"]
            metrics = (await http.get("/metrics", headers=auth)).text
            assert 'gezel_images_generated_total{model="img"} 1.0' in metrics
    lines = [
        (r.fields["model"], r.fields["status"], r.fields["path"])  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "gezel_trio.requests" and "images" in str(r.fields.get("path"))  # type: ignore[attr-defined]
    ]
    assert lines == [
        ("img", 200, "/v1/images/generations"),
        ("tiny", 400, "/v1/images/generations"),
        ("(unresolved)", 404, "/v1/images/generations"),  # no label per made-up name
    ]


# --------------------------------------------------------------------------- the arbiter


def _swap_config(
    tiny_model: Path,
    image_model: DemoImageModel,
    state_dir: Path,
    engine_binary: EngineBinary,
    sd_server_binary: EngineBinary,
    policy: str,
) -> Any:
    return make_config(
        [
            ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=4096),
            image_config(image_model),
        ],
        state_dir=state_dir,
        engine_binary=engine_binary,
        engine={"sd_server": str(sd_server_binary.path)},
        gpu={"policy": policy},
    )


def _render_body(steps: int) -> dict[str, Any]:
    return {"model": "img", "prompt": "a red apple", "size": "64x48", "steps": steps}


CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Tell me a story."}],
    "temperature": 0,
    "max_tokens": 24,
}


async def test_swap_a_chat_waits_for_a_render_and_a_render_for_a_chat(
    image_model: DemoImageModel,
    tiny_model: Path,
    sd_server_binary: EngineBinary,
    engine_binary: EngineBinary,
    state_dir: Path,
) -> None:
    """``swap``: a chat that arrives mid-render waits for the render's lease, and the
    render completes on the same sd-server process (never evicted mid-render); then a
    render that arrives mid-chat waits for the chat in the same way."""
    cfg = _swap_config(tiny_model, image_model, state_dir, engine_binary, sd_server_binary, "swap")
    with trio.fail_after(300):
        async with running(cfg) as (host, http):
            img = host.models["img"]
            done: dict[str, float] = {}
            pids: dict[str, int | None] = {}

            async def render(name: str, steps: int) -> None:
                r = await http.post("/v1/images/generations", json=_render_body(steps), timeout=240)
                done[name] = trio.current_time()
                pids[name] = img.engine.pid
                assert r.status_code == 200, r.text
                (data,) = r.json()["data"]
                assert png_size(base64.b64decode(data["b64_json"])) == (64, 48)

            async def chat(name: str, **extra: Any) -> None:
                r = await http.post("/v1/chat/completions", json={**CHAT, **extra}, timeout=240)
                done[name] = trio.current_time()
                assert r.status_code == 200, r.text

            # 1. a chat arrives mid-render
            async with trio.open_nursery() as nursery:
                nursery.start_soon(render, "render", 8)
                await wait_until(
                    lambda: img.progress is not None and img.progress.step >= 1,
                    within=120,
                    what="the render sampling",
                )
                pid_mid_render = img.engine.pid
                starts = img.engine.starts
                chat_sent = trio.current_time()
                nursery.start_soon(chat, "chat")
            assert done["render"] < done["chat"], done
            assert pids["render"] == pid_mid_render and img.engine.starts == starts
            chat_wait = done["chat"] - chat_sent
            # the chat's engine evicted the image engine, after the render's lease
            await wait_until(lambda: img.engine.pid is None, within=30, what="sd-server evicted")

            # 2. a render arrives mid-chat (a long one: it holds its lease throughout)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(chat, "long chat", max_tokens=3000, ignore_eos=True))
                assert host.scheduler is not None
                scheduler = host.scheduler
                await wait_until(  # admitted (a slot's background save holds the engine too)
                    lambda: scheduler.statistics().running.get("tiny", 0) > 0,
                    within=60,
                    what="the chat running",
                )
                render_sent = trio.current_time()
                nursery.start_soon(render, "render 2", 4)
                await wait_until(lambda: "long chat" in done, within=120, what="the chat done")
                assert img.progress is None or img.progress.step == 0, "rendered beside a chat"
            assert done["long chat"] < done["render 2"], done
            print(
                f"swap: chat waited {chat_wait:.2f}s for a render; a render waited, "
                f"{done['render 2'] - render_sent:.2f}s to its end, for a chat"
            )
            assert host.arbiter.statistics().broken_leases == 0


async def test_coexist_keeps_both_engines_resident(
    image_model: DemoImageModel,
    tiny_model: Path,
    sd_server_binary: EngineBinary,
    engine_binary: EngineBinary,
    state_dir: Path,
) -> None:
    """``coexist``: the ledger admits both engines' bytes, so a chat runs while a render
    does, and neither engine is stopped for the other."""
    cfg = _swap_config(
        tiny_model, image_model, state_dir, engine_binary, sd_server_binary, "coexist"
    )
    with trio.fail_after(300):
        async with running(cfg) as (host, http):
            img, tiny = host.models["img"], host.models["tiny"]
            r = await http.post("/v1/chat/completions", json=CHAT)  # tiny resident first
            assert r.status_code == 200, r.text
            tiny_pid = tiny.engine.pid
            both_ready: list[bool] = []

            async def render() -> None:
                r = await http.post("/v1/images/generations", json=_render_body(12), timeout=240)
                assert r.status_code == 200, r.text

            async with trio.open_nursery() as nursery:
                nursery.start_soon(render)
                await wait_until(
                    lambda: img.progress is not None and img.progress.step >= 1,
                    within=120,
                    what="the render sampling",
                )
                sd_pid = img.engine.pid
                r = await http.post("/v1/chat/completions", json=CHAT)
                assert r.status_code == 200, r.text
                both_ready.append(img.progress is not None and img.ready and tiny.ready)
            assert both_ready == [True], "the chat did not run while the render did"
            assert (img.engine.pid, tiny.engine.pid) == (sd_pid, tiny_pid)
            snapshot = await host.ledger.snapshot()
            held = {h.model for d in snapshot.devices.values() for h in d.holders}
            assert {"img", "tiny"} <= held


async def test_walk_away_mid_render_releases_the_lease_within_a_second(
    image_model: DemoImageModel,
    tiny_model: Path,
    sd_server_binary: EngineBinary,
    engine_binary: EngineBinary,
    state_dir: Path,
) -> None:
    """A client that leaves while its render is queued behind another is dequeued and
    the other renders on; a client that leaves mid-render (a TCP reset): sd-server cannot
    cancel a running job, so the host stops it; the lease is released within 1 s, and
    the host serves the next render and a chat."""
    cfg = _swap_config(tiny_model, image_model, state_dir, engine_binary, sd_server_binary, "swap")
    with trio.fail_after(300):
        async with running(cfg) as (host, http):
            img = host.models["img"]
            stream = await post_json(
                str(http.base_url).rstrip("/"), _render_body(40), "/v1/images/generations"
            )
            await wait_until(
                lambda: img.progress is not None and img.progress.step >= 1,
                within=120,
                what="the render sampling",
            )
            assert host.arbiter.statistics().holders == {"img": 1}
            sd_pid = img.engine.pid
            # a second render queued behind it (the lane's one slot is taken), then left
            assert host.scheduler is not None
            scheduler = host.scheduler
            queued = await post_json(
                str(http.base_url).rstrip("/"), _render_body(2), "/v1/images/generations"
            )
            await wait_until(lambda: scheduler.statistics().queued == 1, within=30, what="queued")
            await reset(queued)
            await wait_until(lambda: scheduler.statistics().queued == 0, within=5, what="dequeued")
            assert img.engine.pid == sd_pid and img.progress is not None  # the first renders on
            left = trio.current_time()
            await reset(stream)
            released = await wait_until(
                lambda: not host.arbiter.statistics().holders, within=5, what="lease released"
            )
            assert trio.current_time() - left < 1.0, f"lease held {released:.2f}s after"
            await wait_until(lambda: img.engine.pid != sd_pid, within=10, what="sd-server stopped")
            await wait_nothing_held(host, within=5)
            rows = [(e.model, e.status, e.path) for e in host.activity.snapshot().requests]
            assert rows.count(("img", 499, "/v1/images/generations")) == 2, rows  # both left
            r = await http.post("/v1/images/generations", json=_render_body(2), timeout=240)
            assert r.status_code == 200, r.text
            r = await http.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
            print(f"walk-away: lease released {released * 1000:.0f} ms after the client left")


async def test_render_progress_refusals_and_a_crash_restart(
    image_model: DemoImageModel,
    sd_server_binary: EngineBinary,
    state_dir: Path,
) -> None:
    """``Host.render`` as the image routes call it: each sampling step reaches
    ``on_progress`` in order; a body sd-server refuses is a BadRequest carrying its
    message; an unknown model is refused; sd-server killed under the host is started
    again by the supervisor for the next render; an idle one is released, and started
    again on demand."""
    cfg = make_config(
        [image_config(image_model)],
        state_dir=state_dir,
        engine={"sd_server": str(sd_server_binary.path)},
    )
    with trio.fail_after(300):
        async with running(cfg) as (host, _http):
            img = host.models["img"]
            updates: list[ImageProgress] = []
            job = ImageJob(
                {
                    "prompt": "a red apple",
                    "width": 64,
                    "height": 48,
                    "sample_params": {"sample_steps": 3},
                }
            )
            result = await host.render(None, job, caller="test", on_progress=updates.append)
            assert updates and updates[-1] == ImageProgress(3, 3), updates
            assert [u.step for u in updates] == sorted({u.step for u in updates})
            assert result.output_format == "png" and len(result.images) == 1
            assert png_size(base64.b64decode(result.images[0])) == (64, 48)
            assert result.seconds > 0
            assert img.progress is None  # no render runs now

            with pytest.raises(BadRequest) as refused:
                await host.render(
                    "img", ImageJob({"prompt": "x", "output_format": "gif"}), caller="test"
                )
            assert refused.value.message.startswith("the image engine refused the request: ")
            print(refused.value.message)
            with pytest.raises(UnknownModel):
                await host.render("nope", job, caller="test")

            first = img.engine.pid
            assert first is not None
            os.kill(first, signal.SIGKILL)
            await wait_until(lambda: img.engine.crashes == 1, within=30, what="the crash seen")
            result = await host.render("img", job, caller="test")
            assert len(result.images) == 1
            assert img.engine.pid not in (None, first) and img.engine.starts == 2

            img.set_idle_ttl(0.5)  # released when idle, as a text model's engine is
            await wait_until(lambda: img.engine.pid is None, within=30, what="idle release")
            assert any("idle for 0.5s" in line for line in img.engine.log.tail(20))
            result = await host.render("img", job, caller="test")  # started on demand again
            assert len(result.images) == 1 and img.engine.starts == 3


async def test_the_ledger_holds_what_sd_server_measures_after_a_render(
    image_model: DemoImageModel,
    sd_server_binary: EngineBinary,
    state_dir: Path,
) -> None:
    """sd-server's bytes are estimated from its files when it starts, then replaced by its
    process's measured resident memory once it has rendered; status shows both."""
    cfg = make_config(
        [image_config(image_model)],
        state_dir=state_dir,
        engine={"sd_server": str(sd_server_binary.path)},
    )
    with trio.fail_after(240):
        async with running(cfg) as (host, http):
            img = host.models["img"]
            assert isinstance(img, ImageRuntime)
            r = await http.post("/v1/images/generations", json=_render_body(STEPS))
            assert r.status_code == 200, r.text
            assert img.engine.pid is not None
            rss = psutil.Process(img.engine.pid).memory_info().rss  # the engine's truth, now
            snapshot = await host.ledger.snapshot()
            (held,) = [h for d in snapshot.devices.values() for h in d.holders if h.model == "img"]
            assert img.measured_bytes is not None
            assert held.nbytes == img.measured_bytes  # never below what was measured
            assert abs(held.nbytes - rss) <= max(rss // 10, 16 << 20), (held.nbytes, rss)
            status = (await http.get("/api/status")).json()
            (row,) = [e for e in status["engines"] if e["name"] == "img"]
            plan = row["plan"]
            assert plan["measured_bytes"] == held.nbytes
            assert plan["total_bytes"] == held.nbytes
            assert plan["estimated_bytes"] != held.nbytes  # the files' sizes, as first held
            print(
                f"sd-server: estimated {plan['estimated_bytes'] / 2**20:.0f} MiB, "
                f"measured {held.nbytes / 2**20:.0f} MiB (resident now {rss / 2**20:.0f} MiB)"
            )
