"""How an image job runs: resolved, granted the image lane's one slot under its GPU
lease, submitted to sd-server's async job API, polled, and recorded.

``Host.render`` calls :func:`render`. The job holds the scheduler's grant (the image
lane has one slot: sd-server renders one job at a time; its turns are shared fairly
with the chats by the scheduler) and, inside it, the arbiter's lease of its slot class,
for its whole run: in ``swap`` no chat evicts sd-server mid-render, and a chat's engine
is evicted for a render only once the chat's lease is released.

A caller that goes away cancels the job in the engine: a job sd-server has queued is
cancelled through its API; one it is generating cannot be (sd-server 0.4.7 cannot cancel
a running job), so the engine is stopped, and the next request starts it again. The
grant and the lease are released by scope exit either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from ..errors import EngineFailed, GezelError, WrongModelKind
from ..images.job import ImageJob, ImageProgress, ImageResult
from .activity import RequestEvent
from .image_runtime import ImageRuntime

if TYPE_CHECKING:
    from .host import Host

__all__ = ["POLL_S", "STOP_WITHIN_S", "job_result", "render"]

log = logging.getLogger("gezel_trio.host.images")
request_log = logging.getLogger("gezel_trio.requests")

POLL_S = 0.15
"""The most seconds between two looks at a running job's state; sooner after the engine
writes something (:meth:`ImageRuntime.wait_output`)."""
SOON_S = 0.01
"""The first look after the engine wrote, doubling up to :data:`POLL_S` while the state
stays the same (its last log line comes just before the job's images are encoded)."""
STOP_WITHIN_S = 0.8
"""The most a caller that went away waits for its job's cancel (or the engine's stop)
before it releases its grant and lease (the stop goes on)."""
CLIENT_CLOSED = 499
UNRESOLVED = "(unresolved)"
"""The model label of a request whose model did not resolve (as the other routes')."""


async def render(
    host: Host,
    model: str | None,
    job: ImageJob,
    *,
    caller: str,
    on_progress: Callable[[ImageProgress], None] | None = None,
    request_id: str | None = None,
    route: str | None = None,
) -> ImageResult:
    """Run ``job`` on the image model ``model`` (None: the first image model) for
    ``caller`` and return its images; see the module. ``on_progress`` is given each
    sampling update; ``route`` names the route in the request log and activity row,
    which are written here (with the metric) whatever the outcome.

    Raises UnknownModel (404), WrongModelKind (400, a text model), BadRequest (400,
    carrying sd-server's message), QueueFull, NoCapacity, EngineFailed, EngineCrashed.
    Cancellation (the caller left) cancels the job in the engine as the module says and
    is recorded as 499."""
    t0 = time.perf_counter()
    label = UNRESOLVED  # a made-up name must not grow the metrics' label set
    status = 500
    wait_s: float | None = None
    result: ImageResult | None = None
    try:
        runtime = host.resolve_model(model, kind="image")
        label = runtime.config.replica_of or runtime.id
        if not isinstance(runtime, ImageRuntime):  # the catalog opens every image model so
            raise EngineFailed(f"the model {runtime.id!r} has no image engine")
        async with host.slot(runtime) as grant:
            wait_s = grant.queue_wait_s
            with runtime.watching(on_progress or _ignore):
                result = await run_job(runtime, job)
            await runtime.measure_footprint(host.ledger)
        runtime.renders += 1
        host.metrics.images_done(label, len(result.images))
        status = 200
        return result
    except GezelError as exc:
        status = exc.status
        if isinstance(exc, WrongModelKind) and model:
            label = model  # a model served here, of the other kind
        raise
    except trio.Cancelled:
        status = CLIENT_CLOSED
        raise
    finally:
        _record(
            host,
            label,
            status,
            time.perf_counter() - t0,
            wait_s,
            job,
            result,
            route,
            request_id,
            caller,
        )


def _ignore(progress: ImageProgress) -> None:
    del progress


async def run_job(runtime: ImageRuntime, job: ImageJob) -> ImageResult:
    """Submit ``job`` to ``runtime``'s sd-server and poll it to its end (at most
    :data:`POLL_S` seconds apart, sooner after the engine writes): its images. A job
    that failed in the engine raises EngineFailed with the engine's message.
    Cancellation cancels a queued job through the API, or stops the engine when it is
    generating (within :data:`STOP_WITHIN_S` seconds; the stop goes on after)."""
    client = runtime.client
    t0 = time.perf_counter()
    job_id = await client.image_submit(job.kind, job.body)
    state = "queued"
    delay = POLL_S
    try:
        while True:
            answer = await client.image_job(job_id)
            state = str(answer["status"])
            if state == "completed":
                return job_result(answer, time.perf_counter() - t0)
            if state in ("failed", "cancelled"):
                raise EngineFailed(f"the image engine's job {state}: {_job_error(answer)}")
            wrote = await runtime.wait_output(delay)
            delay = SOON_S if wrote else min(delay * 2, POLL_S)
    except BaseException:
        if state in ("queued", "generating"):
            with trio.move_on_after(STOP_WITHIN_S, shield=True):
                await _abandon(runtime, job_id, state)
        raise


async def _abandon(runtime: ImageRuntime, job_id: str, state: str) -> None:
    """End a job nobody waits for any more: cancel it when queued, else stop the engine
    (the supervisor starts it again on the next request). Never raises."""
    try:
        if state == "queued" and await runtime.client.image_cancel(job_id):
            log.info("image job %s on %s cancelled (queued)", job_id, runtime.id)
            return
    except GezelError as exc:
        log.info("image job %s on %s: cancel failed: %s", job_id, runtime.id, exc.message)
    log.info(
        "image job %s on %s is generating and its caller left: stopping the engine "
        "(sd-server cannot cancel a running job)",
        job_id,
        runtime.id,
    )
    runtime.engine.closing_reason = "its render's caller left"
    await runtime.engine.stop()


def job_result(answer: dict[str, Any], seconds: float) -> ImageResult:
    """A completed job's result, in sd-server's shapes: ``images`` for an image job, one
    ``b64_json`` (with ``mime_type``, ``fps``, ``frame_count``) for a video job."""
    body = answer.get("result")
    if not isinstance(body, dict):
        raise EngineFailed("the image engine completed a job without its result")
    output_format = str(body.get("output_format") or "png")
    if isinstance(body.get("images"), list):
        images = sorted(
            (
                i
                for i in body["images"]
                if isinstance(i, dict) and isinstance(i.get("b64_json"), str)
            ),
            key=lambda i: i.get("index", 0),
        )
        return ImageResult(
            output_format=output_format,
            images=tuple(i["b64_json"] for i in images),
            seconds=seconds,
        )
    if isinstance(body.get("b64_json"), str):
        mime_type, fps, frames = body.get("mime_type"), body.get("fps"), body.get("frame_count")
        return ImageResult(
            output_format=output_format,
            images=(),
            seconds=seconds,
            media_b64=body["b64_json"],
            mime_type=mime_type if isinstance(mime_type, str) else None,
            fps=fps if isinstance(fps, int) else None,
            frame_count=frames if isinstance(frames, int) else None,
        )
    raise EngineFailed("the image engine completed a job without its images or video")


def _job_error(answer: dict[str, Any]) -> str:
    error = answer.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error.get("code") or error)
    return str(error or "no reason given")


def _record(
    host: Host,
    model: str,
    status: int,
    duration_s: float,
    wait_s: float | None,
    job: ImageJob,
    result: ImageResult | None,
    route: str | None,
    request_id: str | None,
    caller: str,
) -> None:
    """The request's metric sample, activity row and request-log line (synchronous:
    cancellation cannot cut it)."""
    host.metrics.request_done(model, status, duration_s)
    host.activity.record(
        RequestEvent(
            at=round(time.time(), 3),
            model=model,
            status=status,
            path=route,
            session=None,
            ttft_ms=None,
            duration_ms=round(duration_s * 1000, 2),
            prompt_tokens=None,
            cached_tokens=None,
            completion_tokens=None,
        )
    )
    body = job.body
    request_log.info(
        "request",
        extra={
            "fields": {
                "model": model,
                "status": status,
                "kind": job.kind,
                "path": route,
                "request_id": request_id,
                "caller": caller[:12],
                "queue_wait_ms": None if wait_s is None else round(wait_s * 1000, 2),
                "duration_ms": round(duration_s * 1000, 2),
                "render_ms": None if result is None else round(result.seconds * 1000, 2),
                "images": None if result is None else len(result.images),
                "size": f"{body.get('width', '?')}x{body.get('height', '?')}",
            }
        },
    )
