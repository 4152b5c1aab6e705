"""sd-server's native async job API, served by the host for long work:
``POST /sdcpp/v1/img_gen`` and ``/sdcpp/v1/vid_gen`` (submit: ``202`` with the job's
id and ``poll_url``), ``GET /sdcpp/v1/jobs/{id}`` (poll: status, queue position,
``progress {step, steps}``, the result or the error in sd-server's shapes), ``POST
/sdcpp/v1/jobs/{id}/cancel``, and ``GET /sdcpp/v1/capabilities``.

The jobs are the host's, not the engine's: each one runs ``Host.render`` as a task of
the host's nursery (so it holds its grant and lease like any render, and the engine
started, swapped or restarted under it is the host's business), tracked in the host's
bounded :class:`~gezel_trio.host.image_jobs.ImageJobs` table (``Host.image_jobs``). A
job is visible only to the caller that submitted it. Cancelling it cancels its task,
which cancels the render whether it is queued or generating (sd-server itself cannot
cancel a generating job: the host stops its engine, which restarts on the next
request). Errors are sd-server's ``{"error": "..."}``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Literal

import trio
from quart import Blueprint, Response

from ..errors import EngineFailed, FieldError, GezelError
from ..host import Host
from ..host.image_jobs import ImageJobRecord, ImageJobs
from ..images.job import ImageJob, ImageProgress
from .auth import request_caller
from .errors import json_response
from .exchange import current_exchange
from .rendering import image_model
from .sdcpp_translate import job_body, native_request, submitted_body
from .validation import read_json_object

__all__ = ["bp"]

log = logging.getLogger("gezel_trio.api.images")

bp = Blueprint("sdcpp", __name__)


def _host() -> Host:
    return current_exchange().host


async def _run_job(
    host: Host,
    table: ImageJobs,
    record: ImageJobRecord,
    job: ImageJob,
    caller: str,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """One job's task in the host's nursery: ``Host.render`` to the end, its outcome
    written to the table. Cancellation (a cancel request, the host shutting down) ends
    the render; the job is then cancelled."""

    def on_progress(progress: ImageProgress) -> None:
        table.progress(record, progress.step, progress.steps, unix_now=int(time.time()))

    with table.running(record) as scope:
        task_status.started()
        try:
            result = await host.render(
                record.model,
                job,
                caller=caller,
                on_progress=on_progress,
                route=f"/sdcpp/v1/{record.kind}",
            )
        except GezelError as exc:
            table.fail(record, exc.code, exc.message, now=trio.current_time(), unix_now=_unix())
        except Exception as exc:  # a bug: the job says so, the host lives on
            log.exception("image job %s failed", record.id, exc_info=exc)
            message = f"internal error: {type(exc).__name__}"
            table.fail(record, "internal_error", message, now=trio.current_time(), unix_now=_unix())
        else:
            table.complete(record, result, now=trio.current_time(), unix_now=_unix())
    if scope.cancelled_caught:
        table.cancel(record, now=trio.current_time(), unix_now=_unix())


def _unix() -> int:
    return int(time.time())


async def _engine_modes(host: Host, model: str) -> list[str]:
    """The generation modes the model's sd-server supports (its capabilities'
    ``supported_modes``), the engine loaded for the question as for a request.
    Cancellation abandons the wait."""
    runtime = host.resolve_model(model, kind="image")
    async with host.slot(runtime, needs_slot=False):
        answer = await runtime.client.forward("GET", "/sdcpp/v1/capabilities")
    try:
        modes = json.loads(answer.content).get("supported_modes")
    except (ValueError, AttributeError):
        modes = None
    if answer.head.status != 200 or not isinstance(modes, list):
        raise EngineFailed(
            f"the image engine did not say what it renders ({answer.head.status}): "
            f"{answer.content[:200]!r}"
        )
    return [str(mode) for mode in modes]


async def _submit(kind: Literal["img_gen", "vid_gen"]) -> Response:
    host = _host()
    translated = native_request(await read_json_object(), kind)
    model = image_model(host, translated.model)
    current_exchange().model = model
    if kind == "vid_gen":
        modes = await _engine_modes(host, model)
        if "vid_gen" not in modes:
            raise FieldError(
                "model",
                f"the model {model!r} renders no video (its engine supports: "
                f"{', '.join(modes) or 'nothing'}); name a video model such as a Wan one",
            )
    table = host.image_jobs
    caller = request_caller()
    record = table.submit(caller, kind=kind, model=model, now=trio.current_time(), unix_now=_unix())
    try:
        await host.tasks.start(_run_job, host, table, record, translated.job, caller)
    except RuntimeError:  # the host is shutting down
        table.fail(
            record,
            "shutting_down",
            "the host is shutting down",
            now=trio.current_time(),
            unix_now=_unix(),
        )
    return json_response(submitted_body(record), 202)


@bp.post("/sdcpp/v1/img_gen")
async def img_gen() -> Response:
    return await _submit("img_gen")


@bp.post("/sdcpp/v1/vid_gen")
async def vid_gen() -> Response:
    """Video, for a model whose engine renders it (its capabilities say ``vid_gen``);
    for another, a 400 saying so before any job is made."""
    return await _submit("vid_gen")


@bp.get("/sdcpp/v1/jobs/<job_id>")
async def job(job_id: str) -> Response:
    table = _host().image_jobs
    record = table.get(request_caller(), job_id, now=trio.current_time())
    return json_response(job_body(table, record))


@bp.post("/sdcpp/v1/jobs/<job_id>/cancel")
async def cancel(job_id: str) -> Response:
    """A queued or generating job is cancelled (its render ends, releasing its grant
    and lease); a finished one is shown as it is."""
    table = _host().image_jobs
    record = table.get(request_caller(), job_id, now=trio.current_time())
    table.cancel(record, now=trio.current_time(), unix_now=_unix())
    return json_response(job_body(table, record))
