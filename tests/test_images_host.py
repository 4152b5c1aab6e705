"""Images beside the chats, through the host: a real sd-server with the demo image model,
supervised by the host, served on OpenAI's image route, under the arbiter.

The binary resolves like the host's (``sd_server_binary``); without one these fail with
the resolver's message (never skipped).
"""

from __future__ import annotations

import base64
import logging
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.demo_image_model import DemoImageModel, demo_image_model_path

from .conftest import make_config, running
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
            assert "is an image model" in str(out["chat"])
            listed = {m.id: m for m in out["models"].data}
            assert listed["img"].model_extra["capabilities"] == ["image"]
            status = host.status()
            row = next(m for m in status["engines"] if m["model"] == "img")
            assert row["kind"] == "image" and row["state"] == "ready"
            assert row["job"] is None  # no render runs now
    lines = [
        (r.fields["model"], r.fields["status"], r.fields["path"])  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "gezel_trio.requests" and "images" in str(r.fields.get("path"))  # type: ignore[attr-defined]
    ]
    assert lines == [
        ("img", 200, "/v1/images/generations"),
        ("tiny", 400, "/v1/images/generations"),
    ]
