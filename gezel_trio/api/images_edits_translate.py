"""OpenAI's ``POST /v1/images/edits`` (multipart) <-> sd-server's native job. Plain
functions, no I/O.

The mapping is sd-server's own (``routes_openai.cpp``, ``build_openai_edit_request``):
every uploaded image (``image[]``, or the legacy single ``image``) becomes a reference
image (``ref_images``, which FLUX.2 [klein]- and Qwen-Image-Edit-style models condition
on) and the first is also the ``init_image`` (img2img for the others); ``mask`` is the
``mask_image``; ``n`` the ``batch_count``; ``size`` (``WIDTHxHEIGHT``) the output size,
else the first image's own size (sd-server's native API would render 512x512 instead, so
the host reads it from the image's header). ``output_format`` is ``png`` or ``jpeg``
(sd-server's edit route refuses webp). The answer carries ``b64_json``, as sd-server's
does; ``response_format: url`` is a 400 (the host keeps no files to link to, and a
client that asked for URLs would find none), as on ``/v1/images/generations``.
``model`` names the host's image model (the first image model when none is named).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import FieldError
from ..images.job import ImageJob, ImageResult
from .image_data import b64, image_size
from .native_image import apply_extra_args, output_format, parse_size

__all__ = ["EditRequest", "edit_answer", "edit_request"]


@dataclass(frozen=True, slots=True)
class EditRequest:
    """One edit, translated: the model asked (None: the default image model), the job."""

    model: str | None
    job: ImageJob = field(repr=False)


def _field(fields: Mapping[str, str], name: str) -> str | None:
    value = fields.get(name)
    return value if value else None


def edit_request(fields: Mapping[str, str], files: Mapping[str, Sequence[bytes]]) -> EditRequest:
    """The multipart form's text ``fields`` and uploaded ``files`` (each name to its
    parts' bytes, in order) -> the native job. Raises :class:`FieldError` naming the
    field to fix."""
    prompt = _field(fields, "prompt")
    if prompt is None:
        raise FieldError("prompt", "required: what to change in the image")
    images = [raw for raw in files.get("image[]", ()) if raw] or [
        raw for raw in files.get("image", ()) if raw
    ]
    if not images:
        raise FieldError("image", "at least one image (image[] or image) is required")
    n = 1
    if _field(fields, "n") is not None:
        try:
            n = int(fields["n"])
        except ValueError:
            raise FieldError("n", "expected an integer number of images") from None
        if n < 1:
            raise FieldError("n", "expected 1 or more images")
    size = parse_size(_field(fields, "size"))
    if size is None:
        size = image_size(images[0])
        if size is None:
            raise FieldError(
                "image",
                "the image is not a PNG, JPEG, GIF, BMP or WebP whose size can be read: "
                'send it as PNG or JPEG, or say the output size in "size"',
            )
    fmt = output_format(_field(fields, "output_format"), webp=False)
    body: dict[str, Any] = {
        "prompt": prompt,
        "width": size[0],
        "height": size[1],
        "batch_count": n,
        "init_image": b64(images[0]),
        "ref_images": [b64(raw) for raw in images],
        "output_format": fmt,
    }
    mask = [raw for raw in files.get("mask", ()) if raw]
    if mask:
        body["mask_image"] = b64(mask[0])
    compression = _field(fields, "output_compression")
    if compression is not None:
        try:
            body["output_compression"] = max(0, min(100, int(compression)))
        except ValueError:
            raise FieldError("output_compression", "expected an integer 0 to 100") from None
    response_format = _field(fields, "response_format")
    if response_format not in (None, "b64_json"):
        raise FieldError(
            "response_format",
            "only 'b64_json' is served (the host keeps no image files to link to), "
            f"got {response_format!r}",
        )
    return EditRequest(_field(fields, "model"), ImageJob(apply_extra_args(body)))


def edit_answer(result: ImageResult, *, created: int | None = None) -> dict[str, Any]:
    """OpenAI's images answer, as sd-server shapes it: ``created``, ``output_format``
    and ``data[].b64_json``."""
    return {
        "created": int(time.time()) if created is None else created,
        "output_format": result.output_format,
        "data": [{"b64_json": image} for image in result.images],
    }
