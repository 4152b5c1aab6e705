"""``GET /metrics`` and the per-request instrumentation that feeds it.

Every request to a model endpoint (the blueprints of each dialect) is
recorded once, when its answer ends: model, HTTP status, duration, time to the
engine's first token (never a keep-alive the host sent while the prompt was
processed), and the token counts the engine reported (``usage``, else
``timings``). A request whose client left is recorded too, as 499 (client closed),
with the slot it held and the tokens generated before it stopped: by its stream's
end, or by its front once the request's task is over (:func:`record_unanswered`).
Routes name the model with :func:`resolve_model`; a request whose model never
resolved (404, 400 before routing) is recorded under the model label
``(unresolved)``, so a client cannot grow the label set with made-up names.

A streamed answer is recorded when its body ends (finished, failed or the
client went away), from a wrapper around the response body: nothing is
buffered except the last few KiB, where the usage and timings are.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from quart import Blueprint, Response, current_app, request
from quart.wrappers.response import IterableBody
from quart_trio import QuartTrio

from ..config.schema import ModelKind
from ..engine.usage import TAIL_BYTES, Counts, tail_counts, token_counts
from ..errors import GezelError
from ..host import Host, ModelRuntime
from ..host.activity import Activity, RequestEvent
from ..host.metrics import CONTENT_TYPE, Metrics
from .exchange import UNRESOLVED, Exchange, current_exchange, exchange_or_none

bp = Blueprint("metrics", __name__)
request_log = logging.getLogger("gezel_trio.requests")

INSTRUMENTED_BLUEPRINTS = frozenset({"openai", "native", "responses", "anthropic", "ollama"})
_MAX_PARSE_BYTES = 4 * 1024 * 1024


def metrics_of_app() -> Metrics:
    m: Metrics = current_app.config["GEZEL_METRICS"]
    return m


@bp.get("/metrics")
async def metrics() -> Response:
    """Prometheus text exposition. Reads the host's status once."""
    return Response(metrics_of_app().render(), status=200, content_type=CONTENT_TYPE)


def resolve_model(
    host: Host, model: object, *, session: str | None = None, kind: ModelKind | None = "text"
) -> ModelRuntime:
    """The runtime a request's ``model`` names, a model of ``kind`` (None: any), resolved
    once (see :meth:`Host.resolve_model`), and this request's metrics labelled with it: a
    replicated model's own id, never a member's; ``(unresolved)`` when it raises."""
    exchange = current_exchange()
    try:
        runtime = host.resolve_model(model, session=session, kind=kind)
    except GezelError:
        exchange.model = UNRESOLVED
        raise
    exchange.model = runtime.config.replica_of or runtime.id
    return runtime


CLIENT_CLOSED = 499
"""The status a request is recorded with when it ended because its client left (nginx's
"client closed request"): queued, generating, or amid its stream."""


def install_metrics(app: QuartTrio, metrics: Metrics) -> None:
    """Record every model-endpoint request of ``app`` in ``metrics`` and serve ``/metrics``."""
    app.config["GEZEL_METRICS"] = metrics
    app.register_blueprint(bp)

    @app.before_request
    async def _trace() -> None:
        if request.blueprint in INSTRUMENTED_BLUEPRINTS:
            exchange = exchange_or_none()
            if exchange is not None:
                exchange.traced = True

    @app.after_request
    async def _record(resp: Response) -> Response:
        if request.blueprint not in INSTRUMENTED_BLUEPRINTS:
            return resp
        return await record_answer(current_exchange(), resp, metrics)


async def record_answer(exchange: Exchange, resp: Response, metrics: Metrics) -> Response:
    """Record a model request's answer (either front's) in ``metrics``, the request log
    and the activity feed: a whole answer now, a streamed one when its body ends (the
    response returned wraps its body for that; a stream whose client left is recorded
    as :data:`CLIENT_CLOSED`). A request that never gets this far (its client left while
    it was queued or generating) is recorded by its front (:func:`record_unanswered`)."""
    exchange.traced = True
    status = resp.status_code
    body = resp.response
    if isinstance(body, IterableBody):
        resp.response = IterableBody(_observed_stream(exchange, metrics, body, status))
        return resp
    counts = exchange.counts or (None, None, None)
    if counts[0] is None and status == 200 and (resp.content_length or 0) <= _MAX_PARSE_BYTES:
        ctype = resp.content_type or ""
        if "json" in ctype:
            try:
                counts = token_counts(json.loads(await resp.get_data(as_text=False)))
            except ValueError:
                pass
    record_exchange(exchange, metrics, status, counts)
    return resp


def record_unanswered(exchange: Exchange) -> None:
    """Record a model request that ended without its answer being recorded, as
    :data:`CLIENT_CLOSED`: its client left while it was queued (no slot) or generating
    (the slot it held and the tokens generated so far are in its line), or before its
    answer's body started. Its front calls this once the request's task is over, cancelled
    or not; it is synchronous, so cancellation cannot cut it. A no-op for a request that
    is no model request or was recorded already."""
    if exchange.traced and not exchange.recorded:
        record_exchange(exchange, exchange.host.metrics, CLIENT_CLOSED, (None, None, None))


def record_exchange(
    exchange: Exchange,
    metrics: Metrics,
    status: int,
    counts: Counts,
    first_at: float | None = None,
) -> None:
    """Record ``exchange`` once (later calls do nothing): one sample in ``metrics``, one
    request-log line, one activity row. The time to first token is the engine's first
    generated token (its completion's progress; ``first_at``, the first byte, only for a
    request with no completion behind it); a completion cut
    short counts the tokens generated before it stopped. Synchronous."""
    if exchange.recorded:
        return
    exchange.recorded = True
    progress = exchange.progress
    fields: dict[str, Any] = {"path": exchange.path, **exchange.log}
    if progress is not None:
        first_at = progress.ttft_at  # the engine's, never a keep-alive's
        if counts[2] is None and (progress.tokens or status == CLIENT_CLOSED):
            counts = (counts[0], counts[1], progress.tokens)
        grant = progress.grant
        if grant is not None:
            fields["slot"] = grant.slot_id
            fields["queue_wait_ms"] = round(grant.queue_wait_s * 1000, 2)
            fields["prepare_calls"] = grant.prepare_calls
    t0 = exchange.t0
    duration = time.perf_counter() - t0
    ttft = None if first_at is None else first_at - t0
    metrics.request_done(exchange.model, status, duration, ttft, *counts)
    log_request(exchange.model, status, duration, ttft, counts, fields, exchange.host.activity)


async def _observed_stream(
    exchange: Exchange, metrics: Metrics, body: IterableBody, status: int
) -> AsyncIterator[bytes]:
    """``body``'s chunks, passed on; the request is recorded when they end (a stream that
    did not reach its end, or that the relay ended because its client stopped reading,
    as :data:`CLIENT_CLOSED`)."""
    first: float | None = None
    recent: collections.deque[bytes] = collections.deque()
    held = 0
    ended = False
    try:
        async with body as chunks:
            async for chunk in chunks:
                if first is None:
                    first = time.perf_counter()
                if isinstance(chunk, bytes | bytearray):
                    recent.append(bytes(chunk))
                    held += len(chunk)
                    while held - len(recent[0]) >= TAIL_BYTES:
                        held -= len(recent.popleft())
                yield chunk
        ended = True
    finally:
        read = exchange.log.get("counts")
        counts = read() if callable(read) else None
        if counts is None:
            counts = tail_counts(b"".join(recent)[-TAIL_BYTES:])
        left = not ended or exchange.client_left
        record_exchange(exchange, metrics, CLIENT_CLOSED if left else status, counts, first)


def log_request(
    model: str,
    status: int,
    duration_s: float,
    ttft_s: float | None,
    counts: Counts,
    fields: dict[str, Any],
    activity: Activity | None = None,
) -> None:
    """The one structured line per request: model, session hash, slot, queue wait,
    TTFT, tokens, status, and what was clamped (``clamped``: ``{field: {"asked": n,
    "served": m}}``, see :mod:`gezel_trio.host.limits`). ``fields`` carries what the
    relay knew (session, slot, wait, clamps)."""
    prompt, cached, completion = counts
    if activity is not None:
        activity.record(
            RequestEvent(
                at=round(time.time(), 3),
                model=model,
                status=status,
                path=fields.get("path"),
                session=fields.get("session"),
                ttft_ms=None if ttft_s is None else round(ttft_s * 1000, 2),
                duration_ms=round(duration_s * 1000, 2),
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=completion,
            )
        )
    request_log.info(
        "request",
        extra={
            "fields": {
                "model": model,
                "status": status,
                "session": fields.get("session"),
                "slot": fields.get("slot"),
                "queue_wait_ms": fields.get("queue_wait_ms"),
                "ttft_ms": None if ttft_s is None else round(ttft_s * 1000, 2),
                "duration_ms": round(duration_s * 1000, 2),
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "completion_tokens": completion,
                "clamped": fields.get("clamped"),
                "path": fields.get("path") or (request.path if _in_request() else None),
            }
        },
    )


def _in_request() -> bool:
    from quart import has_request_context

    return has_request_context()
