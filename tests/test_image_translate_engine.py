"""Each image dialect's translation, posted to a real sd-server: the native body the host
would send (``POST /sdcpp/v1/img_gen``, polled to the end) is one sd-server accepts and
renders at the size the dialect asked. Where sd-server serves the dialect itself (its
own ``/sdapi/v1/txt2img`` and ``/v1/images/edits``), the same request through both
paths must give the same pixels: the translation is the engine's own mapping.

One sd-server on the demo image model serves the whole test (a start loads the model;
each 4-step render takes a few seconds on the CPU).
"""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_trio.api.image_data import _png_rows
from gezel_trio.api.images_edits_translate import edit_request
from gezel_trio.api.ollama_image_translate import image_generate_request
from gezel_trio.api.sdapi_translate import sdapi_request
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.demo_image_model import write_demo_image_model
from gezel_trio.engine.ports import free_port
from gezel_trio.images.job import ImageJob

from ._engine_bin import LlamaServer, run_llama_server
from ._png import decoded_size as png_size
from ._png import make_png

RENDER_TIMEOUT = 240


async def _render(client: httpx.AsyncClient, job: ImageJob, server: LlamaServer) -> list[bytes]:
    """Submit ``job`` as the host does and poll it to the end; its images' bytes."""
    r = await client.post(f"/sdcpp/v1/{job.kind}", json=dict(job.body))
    assert r.status_code == 202, r.text[:500] + "\n" + server.log_tail()
    poll_url = r.json()["poll_url"]
    with trio.fail_after(RENDER_TIMEOUT):
        while True:
            state = (await client.get(poll_url)).json()
            if state["status"] in ("completed", "failed", "cancelled"):
                break
            await trio.sleep(0.2)
    assert state["status"] == "completed", f"{state}\n{server.log_tail()}"
    return [base64.b64decode(i["b64_json"], validate=True) for i in state["result"]["images"]]


def _pixels(png: bytes) -> list[bytes]:
    return [row for row, _ in _png_rows(png)[2]]


async def test_every_translation_renders_on_a_real_sd_server(
    sd_server_binary: EngineBinary, tmp_path: Path
) -> None:
    model = write_demo_image_model(tmp_path / "image-model", seed=0)
    port = free_port()
    argv = [
        str(sd_server_binary.path),
        *model.server_args(),
        "--listen-ip",
        "127.0.0.1",
        "--listen-port",
        str(port),
        "--steps",
        "4",
    ]
    source = make_png(48, 32)
    source_b64 = base64.b64encode(source).decode()
    mask = make_png(48, 32, lambda x, y: (255 if x >= 24 else 0,), colour=0)
    async with (
        run_llama_server(
            argv,
            sd_server_binary.launch_env(),
            tmp_path / "sd-server.log",
            port=port,
            ready_timeout=120,
            ready_path="/v1/models",
        ) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=RENDER_TIMEOUT) as client,
    ):
        started = time.monotonic()

        # SD-WebUI txt2img: the translation and sd-server's own route agree pixel for pixel
        txt2img: dict[str, Any] = {
            "prompt": "a red boat",
            "negative_prompt": "fog",
            "width": 64,
            "height": 48,
            "steps": 2,
            "cfg_scale": 1.0,
            "seed": 5,
            "batch_size": 2,
            "sampler_name": "Euler a",
            "scheduler": "karras",
        }
        ours = await _render(client, sdapi_request(txt2img, img2img=False).job, server)
        assert [png_size(png) for png in ours] == [(64, 48), (64, 48)]
        r = await client.post("/sdapi/v1/txt2img", json=txt2img)
        assert r.status_code == 200, r.text[:300]
        theirs = [base64.b64decode(i) for i in r.json()["images"]]
        assert [_pixels(p) for p in ours] == [_pixels(p) for p in theirs]

        # SD-WebUI img2img: the size comes from the init image; the mask is inverted
        img2img = {
            "prompt": "a blue boat",
            "init_images": ["data:image/png;base64," + source_b64],
            "mask": base64.b64encode(mask).decode(),
            "inpainting_mask_invert": 1,
            "denoising_strength": 0.6,
            "steps": 2,
            "seed": 3,
        }
        ours = await _render(client, sdapi_request(img2img, img2img=True).job, server)
        assert [png_size(png) for png in ours] == [(48, 32)]
        r = await client.post("/sdapi/v1/img2img", json=img2img)
        assert r.status_code == 200, r.text[:300]
        theirs = [base64.b64decode(i) for i in r.json()["images"]]
        assert [_pixels(p) for p in ours] == [_pixels(p) for p in theirs]

        # OpenAI edits, with the size asked, and without (the first image's size)
        edit = edit_request(
            {"prompt": "paint it", "size": "64x48", "n": "1"},
            {"image[]": [source, make_png(32, 32)], "mask": [mask]},
        )
        ours = await _render(client, edit.job, server)
        assert [png_size(png) for png in ours] == [(64, 48)]
        r = await client.post(
            "/v1/images/edits",
            data={"prompt": "paint it", "size": "64x48", "n": "1"},
            files=[
                ("image[]", ("a.png", source, "image/png")),
                ("image[]", ("b.png", make_png(32, 32), "image/png")),
                ("mask", ("m.png", mask, "image/png")),
            ],
        )
        assert r.status_code == 200, r.text[:300]
        theirs = [base64.b64decode(d["b64_json"]) for d in r.json()["data"]]
        assert [_pixels(p) for p in ours] == [_pixels(p) for p in theirs]
        edit = edit_request({"prompt": "paint it"}, {"image": [source]})
        assert [png_size(p) for p in await _render(client, edit.job, server)] == [(48, 32)]

        # Ollama's generate with an image model
        ollama = image_generate_request(
            {
                "model": "img",
                "prompt": "a fox",
                "width": 64,
                "height": 48,
                "steps": 2,
                "options": {"seed": 9},
            }
        )
        assert [png_size(p) for p in await _render(client, ollama.job, server)] == [(64, 48)]
        print(f"6 translations rendered and 3 compared in {time.monotonic() - started:.1f} s")
