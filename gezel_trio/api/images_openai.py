"""OpenAI's image generation route: ``POST /v1/images/generations`` (JSON).

The request is translated into sd-server's native job body (:func:`native_body`, no
I/O) and rendered by ``Host.render``, which holds the image lane's slot and GPU lease,
and writes the request log line, metric and activity row. Images are answered as
``b64_json`` only: the host keeps no files to link to, so ``response_format = "url"``
is a 400 that says so. Beside OpenAI's fields it takes ``steps``, ``seed`` and
``negative_prompt`` (sd-server's ``sample_params.sample_steps``, ``seed``,
``negative_prompt``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from quart import Blueprint, Response

from ..errors import FieldError
from ..images.job import ImageJob
from .auth import request_caller
from .errors import json_response
from .exchange import current_exchange
from .validation import read_json_object

bp = Blueprint("images_openai", __name__)

MAX_IMAGES = 10
"""OpenAI's own limit on ``n``."""
MAX_SIDE = 4096
OUTPUT_FORMATS = ("png", "jpeg", "webp")


def _int(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise FieldError(name, f"expected an integer {low}..{high}, got {value!r}")
    return value


def parse_size(size: object) -> tuple[int, int] | None:
    """``"WxH"`` as (width, height); None for ``auto`` or no size. FieldError otherwise."""
    if size is None or size == "auto":
        return None
    if isinstance(size, str):
        w, sep, h = size.lower().partition("x")
        if (
            sep
            and w.isdigit()
            and h.isdigit()
            and 0 < int(w) <= MAX_SIDE
            and 0 < int(h) <= MAX_SIDE
        ):
            return int(w), int(h)
    raise FieldError("size", f"expected 'WIDTHxHEIGHT' (such as '512x512') or 'auto', got {size!r}")


def native_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """sd-server's ``/sdcpp/v1/img_gen`` body for an OpenAI generation request (checked:
    FieldError names a wrong field)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise FieldError("prompt", "required: a non-empty string describing the image")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise FieldError("model", "expected a string naming an image model")
    fmt = body.get("response_format")
    if fmt not in (None, "b64_json"):
        raise FieldError(
            "response_format",
            f"only 'b64_json' is served (the host keeps no image files to link to), got {fmt!r}",
        )
    out: dict[str, Any] = {"prompt": prompt}
    n = _int(body, "n", 1, MAX_IMAGES)
    if n is not None:
        out["batch_count"] = n
    size = parse_size(body.get("size"))
    if size is not None:
        out["width"], out["height"] = size
    output_format = body.get("output_format")
    if output_format is not None:
        if output_format not in OUTPUT_FORMATS:
            raise FieldError(
                "output_format", f"expected one of png, jpeg, webp, got {output_format!r}"
            )
        out["output_format"] = output_format
    compression = _int(body, "output_compression", 0, 100)
    if compression is not None:
        out["output_compression"] = compression
    negative = body.get("negative_prompt")
    if negative is not None:
        if not isinstance(negative, str):
            raise FieldError("negative_prompt", "expected a string")
        out["negative_prompt"] = negative
    seed = _int(body, "seed", -1, 2**63 - 1)
    if seed is not None:
        out["seed"] = seed
    steps = _int(body, "steps", 1, 1000)
    if steps is not None:
        out["sample_params"] = {"sample_steps": steps}
    return out


@bp.post("/v1/images/generations")
@bp.post("/images/generations")
async def generations() -> Response:
    """Render the request's images and answer them in OpenAI's shape (see the module)."""
    exchange = current_exchange()
    body = await read_json_object()
    job = ImageJob(native_body(body))
    model = body.get("model")
    result = await exchange.host.render(
        model if isinstance(model, str) and model else None,
        job,
        caller=request_caller(),
        route=exchange.path,
    )
    answer: dict[str, Any] = {
        "created": int(time.time()),
        "data": [{"b64_json": image} for image in result.images],
        "output_format": result.output_format,
    }
    if "width" in job.body:
        answer["size"] = f"{job.body['width']}x{job.body['height']}"
    return json_response(answer)
