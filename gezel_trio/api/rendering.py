"""What every image route shares on its way to ``Host.render``: which image model a
request means, and running the render for the client that asked, whole or streamed,
ended when that client leaves.

A render ends when its client closes the connection (seen by the front's connection,
:func:`~gezel_trio.front_guard.call_when_client_leaves`, or, for a stream, by its body
being closed): ``Host.render`` is cancelled, which cancels the job in the engine (a
queued one through sd-server's API, a generating one by stopping the engine) and
releases its grant and lease by scope exit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Final

import trio
from quart import Response

from ..errors import GezelError
from ..front_guard import call_when_client_leaves
from ..host import Host, ModelRuntime
from ..images.job import ImageJob, ImageProgress, ImageResult
from .auth import request_caller
from .exchange import Exchange, current_exchange

__all__ = [
    "CLIENT_GONE",
    "ClientGone",
    "RenderEvent",
    "image_model",
    "image_models",
    "is_image_model",
    "render",
    "stream_render",
]

log = logging.getLogger("gezel_trio.api.images")

CLIENT_GONE: Final = 499
PROGRESS_BUFFER: Final = 16


class ClientGone(GezelError):
    """The client closed its connection before its render finished."""

    status = CLIENT_GONE
    code = "client_closed_request"


def is_image_model(runtime: ModelRuntime) -> bool:
    return runtime.config.kind == "image"


def image_models(host: Host) -> list[ModelRuntime]:
    """The host's image models, in configuration order."""
    return [rt for rt in host.models.values() if is_image_model(rt)]


def _recorded_by_render(model: str) -> Exchange:
    """The request's exchange, labelled ``model`` and marked recorded: ``Host.render``
    writes an image request's metric, log line and activity row itself, so the
    blueprint's recorder (Ollama's) must not write a second."""
    exchange = current_exchange()
    exchange.model = model
    exchange.recorded = True
    return exchange


def image_model(host: Host, name: str | None) -> str:
    """The id of the image model ``name`` means (the first image model for None), as
    ``Host.render`` resolves it: :class:`~gezel_trio.errors.UnknownModel` (404) for
    none, ``WrongModelKind`` (400) for a text model."""
    runtime = host.resolve_model(name, kind="image")
    return runtime.config.replica_of or runtime.id


async def render(
    host: Host,
    model: str,
    job: ImageJob,
    *,
    on_progress: Callable[[ImageProgress], None] | None = None,
) -> ImageResult:
    """``Host.render`` for this request's caller, labelled with its path; cancelled when the
    client closes its connection (then :class:`ClientGone`). Cancellation of the
    request's task cancels the render the same way."""
    exchange = _recorded_by_render(model)
    route = exchange.path
    with trio.CancelScope() as scope:
        take_back = call_when_client_leaves(scope.cancel)
        try:
            return await host.render(
                model, job, caller=request_caller(), on_progress=on_progress, route=route
            )
        finally:
            if take_back is not None:
                take_back()
    exchange.client_left = True
    raise ClientGone("the client closed its connection before the render finished")


@dataclass(frozen=True, slots=True)
class RenderEvent:
    """What a streamed render reports: progress, then its result or its failure."""

    progress: ImageProgress | None = None
    result: ImageResult | None = None
    error: GezelError | None = None


async def stream_render(
    host: Host,
    model: str,
    job: ImageJob,
    *,
    media_type: str,
    shape: Callable[[RenderEvent], bytes | None],
) -> Response:
    """A 200 streamed response whose body is ``shape`` of each :class:`RenderEvent`
    (None: nothing to send for it) of a render run as a task of the host's nursery,
    once the render's first event came (its failure before then is the error status).
    Closing the body (the stream ended, or its client left) or the client closing its
    connection cancels the render; so does cancellation while the first event is
    awaited."""
    exchange = _recorded_by_render(model)
    route = exchange.path
    caller = request_caller()
    send, recv = trio.open_memory_channel[RenderEvent](PROGRESS_BUFFER)

    def on_progress(progress: ImageProgress) -> None:
        # A reader behind drops this one (a later one follows); a reader gone, all.
        with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError):
            send.send_nowait(RenderEvent(progress=progress))

    async def run(*, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        async with send:
            with trio.CancelScope() as scope:
                task_status.started(scope)
                try:
                    result = await host.render(
                        model, job, caller=caller, on_progress=on_progress, route=route
                    )
                    event = RenderEvent(result=result)
                except GezelError as exc:
                    event = RenderEvent(error=exc)
                except Exception as exc:  # a bug: the stream says so, the host lives on
                    log.exception("image render failed", exc_info=exc)
                    event = RenderEvent(error=GezelError(f"internal error: {type(exc).__name__}"))
                with contextlib.suppress(trio.BrokenResourceError):
                    await send.send(event)

    scope: trio.CancelScope = await host.tasks.start(run)
    take_back = call_when_client_leaves(scope.cancel)
    handed_off = False
    try:
        # The status waits for the render's first word, as Ollama's does: a render
        # refused before it starts is an error status, not a 200 with an error line.
        try:
            first = await recv.receive()
        except trio.EndOfChannel:
            exchange.client_left = True
            raise ClientGone("the client closed its connection before the render began") from None
        if first.error is not None:
            raise first.error

        async def body() -> AsyncGenerator[bytes, None]:
            ended = False
            try:
                async with recv:
                    out = shape(first)
                    if out:
                        yield out
                    async for event in recv:
                        out = shape(event)
                        if out:
                            yield out
                ended = True
            finally:
                scope.cancel()
                if take_back is not None:
                    take_back()
                exchange.client_left = not ended

        resp = Response(body(), status=200, content_type=media_type)
        resp.timeout = None
        handed_off = True
        return resp
    finally:
        if not handed_off:
            scope.cancel()
            if take_back is not None:
                take_back()
