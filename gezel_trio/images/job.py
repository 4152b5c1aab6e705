"""One image job, its progress and its result: plain data, no I/O.

The route modules translate their dialect into an :class:`ImageJob` (sd-server's native
body), hand it to ``Host.render`` and translate the :class:`ImageResult` back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class ImageJob:
    """A render for sd-server: its native ``/sdcpp/v1/img_gen`` (or ``vid_gen``) body."""

    body: Mapping[str, Any]
    kind: Literal["img_gen", "vid_gen"] = "img_gen"


@dataclass(frozen=True)
class ImageProgress:
    """Sampling steps done out of the total (0/0 before sampling starts)."""

    step: int
    steps: int


@dataclass(frozen=True)
class ImageResult:
    """The images of a finished job, base64 each, in order; or, for a video job
    (``vid_gen``), its one container file in ``media_b64`` (and no images)."""

    output_format: str  # "png" | "jpeg" | "webp"; a video's: "webm" | "avi" | ...
    images: tuple[str, ...]
    seconds: float  # engine time of the job: submit to completed
    media_b64: str | None = None
    """A video job's file, base64 (None: an image job)."""
    mime_type: str | None = None
    """The video's MIME type, as the engine said (None: not said)."""
    fps: int | None = None
    frame_count: int | None = None
