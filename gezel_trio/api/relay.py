"""Proxy one completion through the scheduler to its engine, streaming or not.

Streaming: the job (admitted by the scheduler) pushes the engine's head and
then raw SSE chunks into a small memory channel; the response body reads from
it. A client that disconnects closes the body, which cancels the job, which
closes the upstream response: llama-server stops generating. An engine that
fails mid-stream produces one SSE ``error`` event, then the end of the stream.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import trio
from quart import Response, g, request

from ..errors import EngineCrashed, FieldError, GezelError
from ..host import Grant, Host, ModelRuntime
from ..proxy import UpstreamHead, forward, relay_stream, sse_error_event
from ..sessions import session_hash
from .errors import response_for
from .validation import check_completion_body

log = logging.getLogger("gezel_trio.requests")

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def session_of(body: dict[str, Any]) -> str | None:
    """The chat's identity: ``prompt_cache_key`` in the body, else the ``X-Session-Id`` header."""
    key = body.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return key
    header = request.headers.get("X-Session-Id")
    return header[:512] if header else None


def upstream_body(body: dict[str, Any], grant: Grant) -> dict[str, Any]:
    """The body sent to the engine: the client's, with the scheduler's ``id_slot``."""
    out = dict(body)
    out.pop("id_slot", None)
    if grant.slot_id is not None:
        out["id_slot"] = grant.slot_id
    return out


def _check_limits(runtime: ModelRuntime, body: dict[str, Any]) -> None:
    runtime.check_token_ids(body.get("prompt"), "prompt")
    ctx = runtime.config.ctx_per_slot
    for name in ("max_tokens", "max_completion_tokens", "n_predict"):
        v = body.get(name)
        if isinstance(v, int) and v > ctx:
            raise FieldError(
                name,
                f"{v} is more than the model's context per slot ({ctx} tokens); "
                f"ask for at most {ctx}",
            )


async def proxy_completion(host: Host, body: dict[str, Any], path: str, *, kind: str) -> Response:
    check_completion_body(body, kind=kind)
    runtime = host.resolve_model(body.get("model"))
    _check_limits(runtime, body)
    session = session_of(body)
    if body.get("stream") is True:
        return await _stream(host, runtime, body, path, session)
    return await _unary(host, runtime, body, path, session)


def _read_timeout(host: Host) -> float:
    return host.config.engine.request_timeout


async def _unary(
    host: Host, runtime: ModelRuntime, body: dict[str, Any], path: str, session: str | None
) -> Response:

    async def run(grant: Grant) -> tuple[Response, Grant]:
        assert runtime.engine.base_url is not None
        result = await forward(
            host.http,
            "POST",
            runtime.engine.base_url + path,
            body=upstream_body(body, grant),
            read_timeout=_read_timeout(host),
            crashed=runtime.engine.crash_error,
        )
        resp = Response(
            result.content, status=result.head.status, content_type=result.head.content_type
        )
        return resp, grant

    resp, grant = await host.run_job(runtime, run, session=session)
    _note_for_log(session, grant)
    return resp


async def _stream(
    host: Host, runtime: ModelRuntime, body: dict[str, Any], path: str, session: str | None
) -> Response:
    send, recv = trio.open_memory_channel[UpstreamHead | bytes](32)
    scope = trio.CancelScope()
    outcome: dict[str, Any] = {"error": None, "grant": None}

    async def job(grant: Grant) -> None:
        outcome["grant"] = grant
        assert runtime.engine.base_url is not None
        await relay_stream(
            host.http,
            runtime.engine.base_url + path,
            upstream_body(body, grant),
            send,
            read_timeout=_read_timeout(host),
            crashed=runtime.engine.crash_error,
        )

    async def runner() -> None:
        async with send:
            with scope:
                try:
                    await host.run_job(runtime, job, session=session)
                except GezelError as exc:
                    outcome["error"] = exc
                except Exception as exc:  # a bug: never leave the client hanging
                    log.exception("stream job failed")
                    outcome["error"] = EngineCrashed(f"internal error while relaying: {exc!r}")
                # Once granted, the head may already be in the channel: end with an
                # error event (the handler also reads one that arrives before any head).
                if outcome["error"] is not None and outcome["grant"] is not None:
                    with trio.move_on_after(1, shield=True):
                        try:
                            await send.send(sse_error_event(outcome["error"]))
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            pass

    host.tasks.start_soon(runner)
    handed_off = False
    try:
        try:
            first = await recv.receive()
        except trio.EndOfChannel:
            err = outcome["error"] or EngineCrashed("the engine closed the stream before answering")
            _note_for_log(session, outcome["grant"])
            return response_for(err)
        if isinstance(first, bytes):
            # The error event of a job that failed before the engine answered.
            err = outcome["error"] or EngineCrashed("the engine failed before answering")
            _note_for_log(session, outcome["grant"])
            return response_for(err)
        head = first
        if head.status != 200:
            chunks = [c async for c in recv if isinstance(c, bytes)]
            _note_for_log(session, outcome["grant"])
            return Response(b"".join(chunks), status=head.status, content_type=head.content_type)

        async def body_iter() -> AsyncIterator[bytes]:
            try:
                async with recv:
                    async for chunk in recv:
                        if not isinstance(chunk, bytes):
                            continue
                        # When the client reads slower than the engine writes, send what
                        # has piled up in one write instead of one per token.
                        parts = [chunk]
                        while True:
                            try:
                                more = recv.receive_nowait()
                            except (trio.WouldBlock, trio.EndOfChannel):
                                break
                            if isinstance(more, bytes):
                                parts.append(more)
                        yield parts[0] if len(parts) == 1 else b"".join(parts)
            finally:
                scope.cancel()

        _note_for_log(session, outcome["grant"])
        resp = Response(
            body_iter(), status=200, content_type="text/event-stream", headers=SSE_HEADERS
        )
        resp.timeout = None
        handed_off = True
        return resp
    finally:
        if not handed_off:
            scope.cancel()
            recv.close()


def _note_for_log(session: str | None, grant: Grant | None) -> None:
    """Hand the request log line what only the relay knows (see metrics_endpoint.log_request)."""
    g.gezel_log = {
        "session": session_hash(session),
        "slot": grant.slot_id if grant else None,
        "queue_wait_ms": round(grant.queue_wait_s * 1000, 2) if grant else None,
    }
