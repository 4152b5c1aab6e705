"""``GET /metrics`` and the per-request instrumentation that feeds it.

Every request to a model endpoint (the blueprints of each dialect) is
recorded once, when its answer ends: model, HTTP status,
duration, time to first byte for streams, and the token counts the engine
reported (``usage``, else ``timings``). Routes name the model with
:func:`resolve_model`; a request whose model never resolved (404, 400 before
routing) is recorded under the model label ``(unresolved)``, so a client
cannot grow the label set with made-up names.

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

from ..engine.usage import TAIL_BYTES, Counts, tail_counts, token_counts
from ..errors import GezelError
from ..host import Host, ModelRuntime
from ..host.activity import Activity, RequestEvent
from ..host.metrics import CONTENT_TYPE, Metrics
from .exchange import UNRESOLVED, Exchange, current_exchange

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


def resolve_model(host: Host, model: object, *, session: str | None = None) -> ModelRuntime:
    """The runtime a request's ``model`` names, resolved once (see
    :meth:`Host.resolve_model`), and this request's metrics labelled with it: a
    replicated model's own id, never a member's; ``(unresolved)`` when it raises."""
    exchange = current_exchange()
    try:
        runtime = host.resolve_model(model, session=session)
    except GezelError:
        exchange.model = UNRESOLVED
        raise
    exchange.model = runtime.config.replica_of or runtime.id
    return runtime


def install_metrics(app: QuartTrio, metrics: Metrics) -> None:
    """Record every model-endpoint request of ``app`` in ``metrics`` and serve ``/metrics``."""
    app.config["GEZEL_METRICS"] = metrics
    app.register_blueprint(bp)

    @app.after_request
    async def _record(resp: Response) -> Response:
        if request.blueprint not in INSTRUMENTED_BLUEPRINTS:
            return resp
        return await record_answer(current_exchange(), resp, metrics)


async def record_answer(exchange: Exchange, resp: Response, metrics: Metrics) -> Response:
    """Record a model request's answer (either front's) in ``metrics``, the request log
    and the activity feed: a whole answer now, a streamed one when its body ends (the
    response returned wraps its body for that)."""
    status = resp.status_code
    body = resp.response
    activity = exchange.host.activity
    t0 = exchange.t0
    if isinstance(body, IterableBody):
        # the relay's own dict: a stream that waited fills it in as its body ends
        fields = exchange.log
        fields.setdefault("path", exchange.path)
        resp.response = IterableBody(
            _observed_stream(metrics, body, exchange.model, status, t0, fields, activity)
        )
        return resp
    counts = exchange.counts or (None, None, None)
    if counts[0] is None and status == 200 and (resp.content_length or 0) <= _MAX_PARSE_BYTES:
        ctype = resp.content_type or ""
        if "json" in ctype:
            try:
                counts = token_counts(json.loads(await resp.get_data(as_text=False)))
            except ValueError:
                pass
    duration = time.perf_counter() - t0
    # a non-streamed completion is streamed from the engine: the relay noted when
    # its first event came
    first = exchange.first_event_at
    ttft = None if first is None else first - t0
    metrics.request_done(exchange.model, status, duration, ttft, *counts)
    fields = {"path": exchange.path, **exchange.log}
    log_request(exchange.model, status, duration, ttft, counts, fields, activity)
    return resp


async def _observed_stream(
    metrics: Metrics,
    body: IterableBody,
    model: str,
    status: int,
    t0: float,
    fields: dict[str, Any],
    activity: Activity,
) -> AsyncIterator[bytes]:
    first: float | None = None
    recent: collections.deque[bytes] = collections.deque()
    held = 0
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
    finally:
        ttft = None if first is None else first - t0
        duration = time.perf_counter() - t0
        read = fields.get("counts")
        counts = read() if callable(read) else None
        if counts is None:
            counts = tail_counts(b"".join(recent)[-TAIL_BYTES:])
        metrics.request_done(model, status, duration, ttft, *counts)
        log_request(model, status, duration, ttft, counts, fields, activity)


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
