"""SD-WebUI's (AUTOMATIC1111's) API, which Open WebUI's "Automatic1111" image engine
and other WebUI clients speak: ``POST /sdapi/v1/txt2img`` and ``img2img`` (translated
by :mod:`.sdapi_translate` into sd-server's native job and rendered by
``Host.render``), and the discovery routes ``GET /sdapi/v1/{sd-models, options,
samplers, schedulers, upscalers, latent-upscale-modes, loras}``.

The checkpoint: WebUI holds one model for the whole instance, chosen with ``POST
/sdapi/v1/options`` ``{"sd_model_checkpoint": ...}`` (Open WebUI does this when its
admin picks a model); the host holds one per caller (so callers never steer each
other), forgetting the oldest beyond :data:`MAX_CHECKPOINTS`. A request's
``override_settings.sd_model_checkpoint`` wins for that request; with neither, the first
image model serves. Errors are sd-server's ``{"error": "..."}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from quart import Blueprint, Response

from ..errors import FieldError
from ..host import Host, ModelRuntime
from .auth import request_caller
from .errors import json_response
from .exchange import current_exchange
from .rendering import image_model, image_models, render
from .sdapi_translate import (
    latent_upscale_modes_body,
    options_body,
    samplers_body,
    schedulers_body,
    sd_models_body,
    sdapi_answer,
    sdapi_request,
    upscalers_body,
)
from .validation import read_json_object

__all__ = ["MAX_CHECKPOINTS", "bp"]

bp = Blueprint("sdapi", __name__)

MAX_CHECKPOINTS: Final = 1024


def _host() -> Host:
    return current_exchange().host


def _checkpoint(host: Host) -> str | None:
    """The caller's current checkpoint, when it still names an image model."""
    chosen = host.image_checkpoints.get(request_caller())
    if chosen is not None and any(rt.id == chosen for rt in image_models(host)):
        return chosen
    models = image_models(host)
    return models[0].id if models else None


async def _any2img(*, img2img: bool) -> Response:
    """Cancellation (the client left) cancels the render."""
    host = _host()
    translated = sdapi_request(await read_json_object(), img2img=img2img)
    model = image_model(host, translated.model or _checkpoint(host))
    result = await render(host, model, translated.job)
    return json_response(sdapi_answer(translated, result))


@bp.post("/sdapi/v1/txt2img")
async def txt2img() -> Response:
    return await _any2img(img2img=False)


@bp.post("/sdapi/v1/img2img")
async def img2img() -> Response:
    return await _any2img(img2img=True)


def _filename(runtime: ModelRuntime) -> str:
    """The file sd-server names the model by: its full model, else its diffusion model."""
    config: Any = runtime.config
    files = getattr(config, "files", None) or {}
    for key in ("model", "diffusion_model"):
        if files.get(key):
            return Path(files[key]).name
    path = getattr(config, "path", None)
    return Path(path).name if path else runtime.id


@bp.get("/sdapi/v1/sd-models")
async def sd_models() -> Response:
    host = _host()
    return json_response(sd_models_body([(rt.id, _filename(rt)) for rt in image_models(host)]))


@bp.get("/sdapi/v1/options")
async def options() -> Response:
    return json_response(options_body(_checkpoint(_host())))


@bp.post("/sdapi/v1/options")
async def set_options() -> Response:
    """Choose the caller's checkpoint (``sd_model_checkpoint``, an image model); the
    other options WebUI has are accepted and ignored, as sd-server has none."""
    host = _host()
    body = await read_json_object()
    chosen = body.get("sd_model_checkpoint")
    if chosen is not None:
        if not isinstance(chosen, str) or not chosen:
            raise FieldError("sd_model_checkpoint", "expected the title of an image model")
        model = image_model(host, chosen)
        table = host.image_checkpoints
        table[request_caller()] = model
        table.move_to_end(request_caller())
        while len(table) > MAX_CHECKPOINTS:
            table.popitem(last=False)
    return json_response(None)


@bp.get("/sdapi/v1/samplers")
async def samplers() -> Response:
    return json_response(samplers_body())


@bp.get("/sdapi/v1/schedulers")
async def schedulers() -> Response:
    return json_response(schedulers_body())


@bp.get("/sdapi/v1/upscalers")
async def upscalers() -> Response:
    return json_response(upscalers_body())


@bp.get("/sdapi/v1/latent-upscale-modes")
async def latent_upscale_modes() -> Response:
    return json_response(latent_upscale_modes_body())


@bp.get("/sdapi/v1/loras")
async def loras() -> Response:
    """None: the host passes sd-server no ``--lora-model-dir`` (a model's ``args`` may;
    its LoRAs then work by path in ``lora`` without being listed here)."""
    return json_response([])
