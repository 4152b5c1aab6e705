"""sd-server's native async job API, as the host serves it: the submitted body (already
sd-server's schema) and the job objects the host answers with. Plain functions, no I/O.

The host's job API is sd-server's (``examples/server/api.md``, ``async_jobs.cpp``):
``POST /sdcpp/v1/img_gen`` (or ``vid_gen``) answers ``202 {id, kind, status, created,
poll_url}``; ``GET /sdcpp/v1/jobs/{id}`` answers ``{id, kind, status, created, started,
completed, queue_position, result, error}``, plus ``progress: {step, steps}`` (an
extension: sd-server's own API has no progress; the host reads it from the engine's
sampling log). The body may carry one field of the host's own, ``model``, naming the
image model (the first one when absent); the rest goes to sd-server untouched, and
sd-server judges it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from ..errors import FieldError
from ..host.image_jobs import ImageJobRecord, ImageJobs
from ..images.job import ImageJob, ImageResult

__all__ = ["JOBS_PATH", "NativeRequest", "job_body", "native_request", "submitted_body"]

JOBS_PATH: Final = "/sdcpp/v1/jobs/"

_VIDEO_MIME: Final = {"webm": "video/webm", "webp": "image/webp", "avi": "video/x-msvideo"}


@dataclass(frozen=True, slots=True)
class NativeRequest:
    model: str | None
    job: ImageJob = field(repr=False)


def native_request(body: Mapping[str, Any], kind: Literal["img_gen", "vid_gen"]) -> NativeRequest:
    """A submitted native body -> the job, with ``model`` taken out."""
    if not body:
        raise FieldError("body", "empty body: send sd-server's native fields, such as prompt")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise FieldError("model", "expected the name of an image model (see /v1/models)")
    native = {key: value for key, value in body.items() if key != "model"}
    return NativeRequest(model, ImageJob(native, kind=kind))


def submitted_body(job: ImageJobRecord) -> dict[str, Any]:
    """The ``202`` answer to a submission."""
    return {
        "id": job.id,
        "kind": job.kind,
        "status": job.status,
        "created": job.created,
        "poll_url": JOBS_PATH + job.id,
    }


def _result(job: ImageJobRecord, result: ImageResult) -> dict[str, Any]:
    if job.kind == "vid_gen":
        return {
            "output_format": result.output_format,
            "mime_type": result.mime_type
            or _VIDEO_MIME.get(result.output_format, "application/octet-stream"),
            "fps": result.fps,
            "frame_count": result.frame_count,
            "b64_json": result.media_b64 or "",
        }
    return {
        "output_format": result.output_format,
        "images": [{"index": i, "b64_json": image} for i, image in enumerate(result.images)],
    }


def job_body(table: ImageJobs, job: ImageJobRecord) -> dict[str, Any]:
    """A job as ``GET /sdcpp/v1/jobs/{id}`` shows it."""
    error = None
    if job.error is not None:
        error = {"code": job.error[0], "message": job.error[1]}
    return {
        "id": job.id,
        "kind": job.kind,
        "model": job.model,
        "status": job.status,
        "created": job.created,
        "started": job.started,
        "completed": job.completed,
        "queue_position": table.queue_position(job),
        "progress": {"step": job.step, "steps": job.steps},
        "result": _result(job, job.result) if job.result is not None else None,
        "error": error,
    }
