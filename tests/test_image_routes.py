"""Every image dialect but OpenAI's generations, through the host, with the clients people
use: the official ``openai`` SDK's ``images.edit``, the official ``ollama`` client's
``generate`` with an image model (whole, and streamed with progress), ``list`` and
``show``; SD-WebUI's ``txt2img``/``img2img`` and discovery as Open WebUI's
AUTOMATIC1111 engine calls them (HTTP Basic auth included); and the host's async job
API (submit, poll, owner isolation, cancel queued and generating). Each render is a
decodable PNG of the size asked, from a real sd-server on the demo image model.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.demo_image_model import DemoImageModel

from ._png import decoded_size, make_png
from .conftest import make_config, running
from .test_images_host import image_config, image_model  # noqa: F401 (a fixture)

KEY = "sk-test-image-routes"
OTHER_KEY = "sk-test-image-routes-other"
SOURCE = make_png(48, 32)
SOURCE_B64 = base64.b64encode(SOURCE).decode()


def _png(b64: str) -> tuple[int, int]:
    """The size of a base64 PNG, decoded whole."""
    return decoded_size(base64.b64decode(b64, validate=True))


async def _poll(
    http: httpx.AsyncClient,
    url: str,
    key: str,
    until: set[str],
    steps: int | None = None,
) -> dict[str, Any]:
    """Poll a job until its status is one of ``until`` (and, given ``steps``, its
    progress counts at least that many sampling steps); a deadline bounds it."""
    with trio.fail_after(200):
        while True:
            r = await http.get(url, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            state: dict[str, Any] = r.json()
            if state["status"] in until and state["progress"]["steps"] >= (steps or 0):
                return state
            assert state["status"] not in ("completed", "failed", "cancelled"), state
            await trio.sleep(0.1)


async def test_image_dialects_through_the_host(
    image_model: DemoImageModel,  # noqa: F811
    tiny_model: Path,
    sd_server_binary: EngineBinary,
    engine_binary: EngineBinary,
    state_dir: Path,
) -> None:
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=1), image_config(image_model)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server={"api_keys": [KEY, OTHER_KEY]},
        engine={"sd_server": str(sd_server_binary.path)},
    )
    with trio.fail_after(600):
        async with running(cfg) as (host, http):
            base = str(http.base_url).rstrip("/")
            auth = {"Authorization": f"Bearer {KEY}"}

            def clients() -> dict[str, Any]:
                out: dict[str, Any] = {}
                oa = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=200)
                out["edit"] = oa.images.edit(
                    model="img",
                    image=("src.png", io.BytesIO(SOURCE), "image/png"),
                    prompt="paint it blue",
                    size="64x48",  # type: ignore[arg-type]
                    response_format="b64_json",
                )
                out["edit_own_size"] = oa.images.edit(
                    image=[
                        ("a.png", io.BytesIO(SOURCE), "image/png"),
                        ("b.png", io.BytesIO(make_png(32, 32)), "image/png"),
                    ],
                    mask=("m.png", io.BytesIO(make_png(48, 32, colour=0)), "image/png"),
                    prompt="paint it",
                )
                with pytest.raises(openai.BadRequestError) as text_model:
                    oa.images.edit(
                        model="tiny", image=("a.png", io.BytesIO(SOURCE), "image/png"), prompt="x"
                    )
                out["text_model"] = text_model.value
                ol = ollama.Client(host=base, headers=auth, timeout=200)
                out["whole"] = ol.generate(
                    model="img", prompt="a fox", width=64, height=48, steps=3, stream=False
                )
                out["parts"] = list(
                    ol.generate(
                        model="img", prompt="a fox", width=64, height=48, steps=3, stream=True
                    )
                )
                out["list"] = ol.list()
                out["show"] = ol.show("img")
                with pytest.raises(ollama.ResponseError) as too_wide:
                    ol.generate(model="img", prompt="x", width=5000, stream=False)
                out["too_wide"] = too_wide.value
                with pytest.raises(ollama.ResponseError) as refused:  # streamed, yet a status
                    list(
                        ol.generate(
                            model="img", prompt="x", images=[b"not an image"], width=64, height=48
                        )
                    )
                out["refused"] = refused.value
                return out

            out = await trio.to_thread.run_sync(clients)

            # OpenAI edits
            (edited,) = out["edit"].data
            assert _png(edited.b64_json) == (64, 48)
            (edited,) = out["edit_own_size"].data
            assert _png(edited.b64_json) == (48, 32)  # the first image's size
            assert "is a text model" in str(out["text_model"])

            # Ollama: whole, streamed with progress, listed with its capability
            assert out["whole"].done and _png(out["whole"].image) == (64, 48)
            *progress, last = out["parts"]
            assert last.done and _png(last.image) == (64, 48)
            assert progress, "no progress before the image"
            assert all(p.total == 3 and not p.done and p.image is None for p in progress)
            assert [p.completed for p in progress] == sorted(p.completed for p in progress)
            assert {m.model for m in out["list"].models} == {"img:latest", "tiny:latest"}
            r = await http.get("/api/tags", headers=auth)  # the client's Model drops them
            listed = {m["model"]: m["capabilities"] for m in r.json()["models"]}
            assert listed["img:latest"] == ["image"]
            assert "image" not in listed["tiny:latest"]
            assert out["show"].capabilities == ["image"]
            assert out["too_wide"].status_code == 400
            assert "4096" in str(out["too_wide"])
            # sd-server's own refusal of the input image, before any progress: a 400
            assert out["refused"].status_code == 400, out["refused"]
            assert "image engine refused" in str(out["refused"])

            # SD-WebUI as Open WebUI's AUTOMATIC1111 engine calls it: Basic auth with the
            # key as its password, options, sd-models, the checkpoint set, txt2img
            basic = base64.b64encode(f"webui:{KEY}".encode()).decode()
            webui = {"authorization": f"Basic {basic}"}
            r = await http.get("/sdapi/v1/options", headers=webui)
            assert r.status_code == 200, r.text
            assert r.json() == {"samples_format": "png", "sd_model_checkpoint": "img"}
            r = await http.get("/sdapi/v1/sd-models", headers=webui)
            assert [(m["title"], m["model_name"]) for m in r.json()] == [("img", "img")]
            r = await http.post(
                "/sdapi/v1/options",
                json={**r.json()[0], "sd_model_checkpoint": "img"},
                headers=webui,
            )
            assert r.status_code == 200, r.text
            txt2img = {"prompt": "a boat", "batch_size": 2, "width": 64, "height": 48, "steps": 2}
            r = await http.post("/sdapi/v1/txt2img", json=txt2img, headers=webui, timeout=200)
            assert r.status_code == 200, r.text
            answer = r.json()
            assert [_png(i) for i in answer["images"]] == [(64, 48), (64, 48)]
            assert answer["parameters"] == txt2img and answer["info"] == ""
            img2img = {"prompt": "a boat", "init_images": [SOURCE_B64], "denoising_strength": 0.5}
            r = await http.post("/sdapi/v1/img2img", json=img2img, headers=auth, timeout=200)
            assert r.status_code == 200, r.text
            assert [_png(i) for i in r.json()["images"]] == [(48, 32)]
            for path in ("samplers", "schedulers", "upscalers", "latent-upscale-modes", "loras"):
                r = await http.get(f"/sdapi/v1/{path}", headers=auth)
                assert r.status_code == 200 and isinstance(r.json(), list), (path, r.text)
            r = await http.post("/sdapi/v1/txt2img", json={"width": 64}, headers=auth)
            assert (r.status_code, r.json()) == (400, {"error": "prompt: prompt required"})
            r = await http.post("/sdapi/v1/txt2img", json={"prompt": "x"})
            assert r.status_code == 401 and "error" in r.json()

            # The async job API: submit, poll with progress, owner isolation
            r = await http.post(
                "/sdcpp/v1/img_gen",
                json={
                    "prompt": "a cat",
                    "width": 64,
                    "height": 48,
                    "sample_params": {"sample_steps": 3},
                },
                headers=auth,
            )
            assert r.status_code == 202, r.text
            submitted = r.json()
            assert submitted["status"] == "queued" and submitted["kind"] == "img_gen"
            url = submitted["poll_url"]
            other = await http.get(url, headers={"Authorization": f"Bearer {OTHER_KEY}"})
            assert (other.status_code, other.json()) == (404, {"error": "job not found"})
            done = await _poll(http, url, KEY, {"completed", "failed", "cancelled"})
            assert done["status"] == "completed", done
            assert done["progress"] == {"step": 3, "steps": 3}
            (image,) = done["result"]["images"]
            assert image["index"] == 0 and _png(image["b64_json"]) == (64, 48)

            # Cancel a generating job (a long one) and the queued one behind it: both
            # end cancelled, and the engine serves the next job.
            long_job = {
                "prompt": "slow",
                "width": 64,
                "height": 48,
                "sample_params": {"sample_steps": 400},
            }
            first = (await http.post("/sdcpp/v1/img_gen", json=long_job, headers=auth)).json()
            second = (await http.post("/sdcpp/v1/img_gen", json=long_job, headers=auth)).json()
            generating = await _poll(http, first["poll_url"], KEY, {"generating"}, steps=1)
            assert generating["progress"]["step"] < generating["progress"]["steps"]
            queued = (await http.get(second["poll_url"], headers=auth)).json()
            assert queued["status"] == "queued" and queued["queue_position"] == 1
            for job in (second, first):
                r = await http.post(f"{job['poll_url']}/cancel", headers=auth)
                assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
                assert r.json()["error"]["code"] == "cancelled"
            with trio.fail_after(30):  # the render's grant is released: the lane is free
                while True:
                    rows = host.status()["engines"]
                    if not any(m["model"] == "img" and m["job"] is not None for m in rows):
                        break
                    await trio.sleep(0.05)
            r = await http.post(
                "/sdcpp/v1/img_gen",
                json={
                    "prompt": "again",
                    "width": 64,
                    "height": 48,
                    "sample_params": {"sample_steps": 2},
                },
                headers=auth,
            )
            done = await _poll(http, r.json()["poll_url"], KEY, {"completed", "failed"})
            assert done["status"] == "completed", done
            assert _png(done["result"]["images"][0]["b64_json"]) == (64, 48)
            r = await http.post("/sdcpp/v1/vid_gen", json={"prompt": "x"}, headers=auth)
            assert r.status_code == 400 and "renders no video" in r.json()["error"], r.text
            assert "img_gen" in r.json()["error"]  # what the engine said it renders
            r = await http.get("/sdcpp/v1/jobs/job_nope", headers=auth)
            assert (r.status_code, r.json()) == (404, {"error": "job not found"})
            r = await http.post(
                "/sdcpp/v1/img_gen", json={"prompt": "x", "model": "tiny"}, headers=auth
            )
            assert r.status_code == 400 and "is a text model" in r.json()["error"]


def _lane_busy(host: Any) -> bool:
    return any(m["model"] == "img" and m["job"] is not None for m in host.status()["engines"])


async def _wait_lane(host: Any, busy: bool, within: float) -> float:
    """Seconds until the image lane is (not) running a job; fails after ``within``."""
    started = trio.current_time()
    with trio.fail_after(within):
        while True:
            if _lane_busy(host) == busy:
                break
            await trio.sleep(0.02)
    return trio.current_time() - started


async def test_a_client_that_walks_away_ends_its_render(
    image_model: DemoImageModel,  # noqa: F811
    sd_server_binary: EngineBinary,
    engine_binary: EngineBinary,
    state_dir: Path,
) -> None:
    """A streamed Ollama generate whose reader closes it, and a whole SD-WebUI txt2img
    whose client goes away: each render ends (the engine's job stopped, the lane free)
    within a few seconds, and the next render is served."""
    cfg = make_config(
        [image_config(image_model)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        engine={"sd_server": str(sd_server_binary.path)},
    )
    long = {"model": "img", "prompt": "slow", "width": 64, "height": 48, "steps": 100}
    with trio.fail_after(400):
        async with running(cfg) as (host, http):
            async with http.stream("POST", "/api/generate", json=long, timeout=200) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if '"completed"' in line:
                        break  # sampling has begun: walk away
            freed = await _wait_lane(host, busy=False, within=30)
            print(f"streamed generate: lane free {freed:.2f} s after the reader left")

            async def txt2img() -> None:
                body = {"prompt": "slow", "width": 64, "height": 48, "steps": 100}
                await http.post("/sdapi/v1/txt2img", json=body, timeout=200)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(txt2img)
                await _wait_lane(host, busy=True, within=120)
                await trio.sleep(1)  # into sampling
                nursery.cancel_scope.cancel()  # the client goes away
            freed = await _wait_lane(host, busy=False, within=30)
            print(f"txt2img: lane free {freed:.2f} s after the client left")

            r = await http.post(
                "/api/generate",
                json={**long, "steps": 2, "stream": False},
                timeout=200,
            )
            assert r.status_code == 200, r.text
            assert _png(r.json()["image"]) == (64, 48)
