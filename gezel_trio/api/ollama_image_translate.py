"""Ollama's ``/api/generate`` with an image model <-> sd-server's native job. Plain
functions, no I/O.

Ollama's own image generation (its experimental ``x/imagegen`` runner, served through
``/api/generate``) takes ``prompt``, ``width``, ``height`` and ``steps`` (0 or absent:
the model's default; above 4096 a 400), ``options.seed``, and ``images`` (input images,
for models that edit). It answers, when streamed, NDJSON progress objects
``{model, created_at, response: "", done: false, completed, total}`` (sampling steps
done out of the total) and a last object with ``image`` (base64 PNG), ``done: true``,
``done_reason`` and the wall times; unstreamed, that last object alone. An empty prompt
loads the model (``done_reason: "load"``). These are the fields the official ``ollama``
client's ``GenerateResponse`` reads (``image``, ``completed``, ``total``).

Input ``images`` map as sd-server's own edit route maps uploads (see
:mod:`.images_edits_translate`): every image a reference image, the first also the
init image, and the output the first image's size unless ``width``/``height`` say.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ..errors import FieldError
from ..images.job import ImageJob, ImageProgress, ImageResult
from .image_data import b64, decode_b64_image, image_size
from .native_image import as_int
from .ollama_translate import KeepAlive, WallTimes, parse_keep_alive, rfc3339_nano

__all__ = [
    "MAX_DIMENSION",
    "OllamaImageRequest",
    "image_answer",
    "image_generate_request",
    "image_progress",
]

MAX_DIMENSION: Final = 4096
"""Ollama refuses a larger width or height with a 400."""


@dataclass(frozen=True, slots=True)
class OllamaImageRequest:
    model: str
    job: ImageJob = field(repr=False)
    stream: bool
    keep_alive: KeepAlive | None = None
    load_only: bool = False


def _dimension(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    number = as_int(value, key)
    if number < 0:
        raise FieldError(key, "expected a positive number of pixels (0: the model's default)")
    if number > MAX_DIMENSION:
        raise FieldError(key, f"width and height must be <= {MAX_DIMENSION}")
    return number or None


def image_generate_request(body: Mapping[str, Any]) -> OllamaImageRequest:
    """An ``/api/generate`` body naming an image model -> the native job. Raises
    :class:`FieldError` naming the field to fix."""
    model = body.get("model") or body.get("name")
    if not isinstance(model, str) or not model:
        raise FieldError("model", "required: the name of a model (see /api/tags)")
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise FieldError("prompt", "expected a string")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise FieldError("stream", "expected true or false")
    keep_alive = parse_keep_alive(body.get("keep_alive"))
    width, height = _dimension(body, "width"), _dimension(body, "height")
    steps = body.get("steps")
    native: dict[str, Any] = {"prompt": prompt, "batch_count": 1, "output_format": "png"}
    if steps is not None and as_int(steps, "steps") != 0:
        if as_int(steps, "steps") < 0:
            raise FieldError("steps", "expected a positive number of steps (0: the default)")
        native["sample_params"] = {"sample_steps": as_int(steps, "steps")}
    options = body.get("options")
    if options is not None and not isinstance(options, Mapping):
        raise FieldError("options", "expected an object of model parameters")
    if options and options.get("seed") is not None:
        native["seed"] = as_int(options["seed"], "options.seed")
    images_value = body.get("images")
    if images_value is not None and not isinstance(images_value, list):
        raise FieldError("images", "expected an array of base64-encoded images")
    images = [decode_b64_image(v, f"images[{i}]") for i, v in enumerate(images_value or ())]
    if images:
        native["init_image"] = b64(images[0])
        native["ref_images"] = [b64(raw) for raw in images]
        if width is None or height is None:
            size = image_size(images[0])
            if size is None:
                raise FieldError(
                    "images[0]",
                    "the image's size cannot be read (send PNG or JPEG), or say width and height",
                )
            width, height = width or size[0], height or size[1]
    if width is not None:
        native["width"] = width
    if height is not None:
        native["height"] = height
    return OllamaImageRequest(
        model=model,
        job=ImageJob(native),
        stream=True if stream is None else stream,
        keep_alive=keep_alive,
        load_only=not prompt,
    )


def image_progress(
    model: str, progress: ImageProgress, *, clock_ns: Callable[[], int] = time.time_ns
) -> dict[str, Any] | None:
    """A streamed progress object; None before sampling starts (Ollama sends progress
    only once it knows the total)."""
    if progress.steps <= 0:
        return None
    return {
        "model": model,
        "created_at": rfc3339_nano(clock_ns()),
        "response": "",
        "done": False,
        "completed": progress.step,
        "total": progress.steps,
    }


def image_answer(
    model: str,
    result: ImageResult,
    wall: WallTimes,
    *,
    clock_ns: Callable[[], int] = time.time_ns,
) -> dict[str, Any]:
    """The last object: the image and ``done``, with the host's wall times."""
    out: dict[str, Any] = {
        "model": model,
        "created_at": rfc3339_nano(clock_ns()),
        "response": "",
        "done": True,
        "done_reason": "stop",
    }
    if result.images:
        out["image"] = result.images[0]
    out["total_duration"] = wall.total_ns
    if wall.load_ns:
        out["load_duration"] = wall.load_ns
    return out
