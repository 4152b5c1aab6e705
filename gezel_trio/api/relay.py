"""Proxy one completion through a slot of its engine, streaming or not.

Both shapes hold their slot with ``async with host.slot(...)`` for exactly as
long as the engine works on the request, and send it through the model's
:class:`~gezel_trio.engine.client.EngineClient`.

Streaming: a task in the host's nursery holds the slot and pushes the engine's
head and then raw SSE chunks into a small memory channel; the response body
reads from it. A client that disconnects closes the body, which cancels the
task, which closes the upstream response: llama-server stops generating. An
engine that fails mid-stream produces one SSE ``error`` event, then the end of
the stream.

The response's ``model`` is the id the client asked for (the engine names the
model by its alias, which is the model id for engines the host spawns).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import trio
from quart import Response, g, request

from .._trio import unwrapping
from ..engine.client import UpstreamHead, sse_error_event
from ..engine.supervisor import EngineState
from ..errors import EngineAbandoned, EngineCrashed, EngineFailed, FieldError, GezelError
from ..host import Host, ModelRuntime
from ..scheduler import Grant
from ..sessions import session_hash
from .assemble import Shape, SseDecoder, StreamAssembler, shape_of
from .errors import response_for
from .validation import check_completion_body

log = logging.getLogger("gezel_trio.requests")

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def session_of(body: dict[str, Any]) -> str | None:
    """The chat's session, None for a keyless request.

    Its name is ``prompt_cache_key`` in the body, else the ``X-Session-Id`` header;
    the session is the HMAC of the authenticated caller and that name
    (:func:`.app.request_session`), so two API keys never share one. The host
    never handles the raw name past this point.
    """
    from .app import request_session  # may join the imports above: app loads relay lazily

    key = body.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return request_session(key)
    header = request.headers.get("X-Session-Id")
    return request_session(header[:512]) if header else None


def upstream_body(body: dict[str, Any], grant: Grant) -> dict[str, Any]:
    """The body sent to the engine: the client's, with the scheduler's ``id_slot``,
    and ``cache_prompt`` off for a keyless request (it may reuse nothing the slot
    holds)."""
    out = dict(body)
    out.pop("id_slot", None)
    if grant.slot_id is not None:
        out["id_slot"] = grant.slot_id
    if grant.blind:
        out["cache_prompt"] = False
    return out


def requested_model(body: dict[str, Any], runtime: ModelRuntime) -> str:
    """The model name the client sent (the runtime's id when it sent none)."""
    named = body.get("model")
    return named if isinstance(named, str) and named else runtime.config.replica_of or runtime.id


class ModelRename:
    """Rewrites the ``model`` field of an engine's answer to the name the client sent.

    A spawned engine already answers with the model id (``--alias``), so most
    answers pass through untouched; otherwise the engine's own name is learned
    from its first answer and replaced byte-wise in every SSE chunk (an event
    split across two reads keeps the engine's name).
    """

    __slots__ = ("_engine_field", "_wanted", "_wanted_field")

    def __init__(self, wanted: str, engine_name: str | None) -> None:
        self._wanted = wanted
        self._wanted_field = _model_field(wanted)
        self._engine_field = None if engine_name is None else _model_field(engine_name)

    def body(self, content: bytes) -> bytes:
        """A whole JSON answer."""
        if self._wanted_field in content or b'"model"' not in content:
            return content
        try:
            data = json.loads(content)
        except ValueError:
            return content
        if not isinstance(data, dict) or not isinstance(data.get("model"), str):
            return content
        data["model"] = self._wanted
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()

    def chunk(self, chunk: bytes) -> bytes:
        """One SSE chunk."""
        if self._engine_field is None:
            if b'"model"' not in chunk or self._wanted_field in chunk:
                return chunk
            self._engine_field = _learn_model_field(chunk)
            if self._engine_field is None:
                return chunk
        if self._engine_field == self._wanted_field:
            return chunk
        return chunk.replace(self._engine_field, self._wanted_field)


def _model_field(name: str) -> bytes:
    return b'"model":' + json.dumps(name, ensure_ascii=False).encode()


def _learn_model_field(chunk: bytes) -> bytes | None:
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                data = json.loads(line[6:])
            except ValueError:
                continue
            if isinstance(data, dict) and isinstance(data.get("model"), str):
                return _model_field(data["model"])
    return None


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
    session = session_of(body)
    runtime = host.resolve_model(body.get("model"), session=session)
    _check_limits(runtime, body)
    spawned_alias = not runtime.config.external and runtime.config.replica_of is None
    rename = ModelRename(requested_model(body, runtime), runtime.id if spawned_alias else None)
    if body.get("stream") is True:
        return await _stream(host, runtime, body, path, session, rename)
    return await _unary(host, runtime, body, path, session, rename)


async def _unary(
    host: Host,
    runtime: ModelRuntime,
    body: dict[str, Any],
    path: str,
    session: str | None,
    rename: ModelRename,
) -> Response:
    """A non-streaming completion: streamed from the engine and assembled here, so a
    client that walks away (the handler is cancelled) stops generation at once.

    When the engine dies before it produced a single token of the answer (the
    request met a process being killed), the request is sent again, once, to the
    restarted engine or another replica: nothing of it reached the client, and
    nothing of it ran. So is one abandoned on a hung external engine (it may have
    run there, but the client has none of it).
    """
    shape = shape_of(path)
    for attempt in (1, 2):
        try:
            async with host.completion_slot(runtime, session=session) as (runtime, grant):
                status, content_type, content = await _assembled(
                    runtime,
                    path,
                    upstream_body(body, grant),
                    shape,
                    grant,
                    keep_tokens=body.get("return_tokens") is True,
                )
            break
        except (_NothingGenerated, EngineAbandoned):
            # nothing of the answer reached the client: it may go elsewhere
            if attempt == 2 or not await _engine_went_away(runtime, grant):
                raise
            log.info(
                "the engine died before answering: sending the request again",
                extra={"fields": {"model": runtime.id, "session": session_hash(session)}},
            )
            runtime = _resend_to(host, runtime, session)
    _note_for_log(runtime, session, grant)
    return Response(
        rename.body(content), status=status, content_type=content_type, headers=_wait_header(grant)
    )


def _resend_to(host: Host, failed: ModelRuntime, session: str | None) -> ModelRuntime:
    """Where a request goes again after ``failed``'s engine went away before answering:
    another replica if one is left, else the same model (its engine restarts)."""
    if failed.config.replica_of is None:
        return failed
    return host.resolve_model(failed.config.replica_of, session=session, avoid={failed.id})


class _NothingGenerated(EngineCrashed):
    """The engine failed before a single event of the answer arrived."""


async def _engine_went_away(runtime: ModelRuntime, grant: Grant) -> bool:
    """Whether the engine process that ``grant`` was prepared on is gone (it exited,
    or a new one runs): waits up to a second for the supervisor to notice."""
    engine = runtime.engine

    def gone() -> bool:
        return engine.generation != grant.generation or engine.base_url is None

    if not gone():
        with trio.move_on_after(1.0):
            await engine.state.wait_value(lambda state: state is not EngineState.READY)
    return gone() or engine.state.value is not EngineState.READY


async def _assembled(
    runtime: ModelRuntime,
    path: str,
    upstream: dict[str, Any],
    shape: Shape,
    grant: Grant,
    *,
    keep_tokens: bool,
) -> tuple[int, str, bytes]:
    """Send ``upstream`` as a stream and assemble the non-streaming answer: (status,
    content type, body). An engine error before the stream is relayed as it came;
    an error event amid it becomes that error's status. Cancellation closes the
    stream, which stops the engine on its next write."""
    streamed = {**upstream, "stream": True}
    if shape != "native":
        streamed["stream_options"] = {"include_usage": True}
    send, recv = trio.open_memory_channel[UpstreamHead | bytes](64)
    assembler = StreamAssembler(shape, keep_tokens=keep_tokens)
    decoder = SseDecoder()
    head: UpstreamHead | None = None
    raw: list[bytes] = []

    async def produce() -> None:
        async with send:
            await runtime.client.stream(path, streamed, send, slot=grant.slot_id)

    events = 0
    try:
        async with unwrapping(), trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            async with recv:
                async for item in recv:
                    if isinstance(item, UpstreamHead):
                        head = item
                    elif head is not None and head.status != 200:
                        raw.append(item)
                    else:
                        for event in decoder.feed(item):
                            events += 1
                            assembler.feed(event)
    except EngineCrashed as exc:
        if events == 0 and not isinstance(exc, _NothingGenerated):
            raise _NothingGenerated(exc.message) from exc
        raise
    if head is None:  # pragma: no cover - the producer raised, and that left the nursery
        raise EngineCrashed("the engine closed the stream before answering")
    if head.status != 200:
        return head.status, head.content_type, b"".join(raw)
    if assembler.error is not None:
        error = assembler.error.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        return status, "application/json; charset=utf-8", _dumps(assembler.error)
    return 200, "application/json; charset=utf-8", _dumps(assembler.result())


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


class StallGuard:
    """The relay channel's sending end, with a stall timeout: a client that stops
    reading for ``stall_s`` (the channel stays full) is treated as gone.

    It passes on one head: a stream sent again after its engine died before any
    event brings a second one, which is dropped when it is a 200 like the first (the
    client goes on reading the same response) and is an error otherwise."""

    __slots__ = ("_channel", "_head", "_stall_s", "events")

    def __init__(self, channel: trio.MemorySendChannel[UpstreamHead | bytes], stall_s: float):
        self._channel = channel
        self._stall_s = stall_s
        self._head: UpstreamHead | None = None
        self.events = 0
        """Chunks of the answer handed on so far (0: the client has none of it)."""

    async def send(self, value: UpstreamHead | bytes, /) -> None:
        """Raises BrokenResourceError after ``stall_s`` without room in the channel,
        EngineFailed for a second head that is not a 200."""
        if isinstance(value, UpstreamHead):
            if self._head is not None:
                if value.status == 200 and self._head.status == 200:
                    return
                raise EngineFailed(f"the engine answered {value.status} when sent again")
            self._head = value
        with trio.move_on_after(self._stall_s):
            await self._channel.send(value)
            if not isinstance(value, UpstreamHead):
                self.events += 1
            return
        raise trio.BrokenResourceError(f"the client read nothing for {self._stall_s:g}s")


async def _stream(
    host: Host,
    runtime: ModelRuntime,
    body: dict[str, Any],
    path: str,
    session: str | None,
    rename: ModelRename,
) -> Response:
    """Hold a slot in a task of the host's nursery, relaying the engine's stream
    into a channel the response body reads. The task ends (and the slot, lease and
    upstream connection with it) when the stream ends, when the client leaves or
    stops reading for ``stream_stall_timeout``, or when the body has not started
    ``stream_start_timeout`` after the head was handed over (the client left
    before the server could start it, so the body's own cleanup never runs).

    When the engine dies before the client saw any of the answer's events, the
    request is sent again, once: to another replica of a replicated model, else to
    the restarted engine.
    """
    send, recv = trio.open_memory_channel[UpstreamHead | bytes](32)
    guarded = StallGuard(send, host.config.server.stream_stall_timeout)
    scope = trio.CancelScope()
    body_started = trio.Event()
    outcome: dict[str, Any] = {"error": None, "grant": None, "runtime": runtime}

    async def runner() -> None:
        async with send:
            with scope:
                try:
                    await _stream_into(host, runtime, body, path, session, guarded, outcome)
                except GezelError as exc:
                    outcome["error"] = exc
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    # the client went away mid-stream (or stopped reading)
                    log.info(
                        "client left mid-stream",
                        extra={
                            "fields": {
                                "model": runtime.id,
                                "session": session_hash(session),
                                "why": str(exc) or "disconnected",
                            }
                        },
                    )
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
        keepalive = host.config.server.sse_keepalive_interval
        first: UpstreamHead | bytes | None = None
        with trio.move_on_after(keepalive if keepalive > 0 else math.inf):
            try:
                first = await recv.receive()
            except trio.EndOfChannel:
                err = outcome["error"] or EngineCrashed(
                    "the engine closed the stream before answering"
                )
                _note_for_log(outcome["runtime"], session, outcome["grant"])
                return response_for(err)
        if first is None:
            # Still queued or loading: commit to a 200 stream and keep the client (and
            # any proxy) alive with SSE comments; a later failure is an error event.
            handed_off = True
            return _waiting_stream(
                host, runtime, session, recv, scope, body_started, outcome, rename
            )
        if isinstance(first, bytes):
            # The error event of a job that failed before the engine answered.
            err = outcome["error"] or EngineCrashed("the engine failed before answering")
            _note_for_log(outcome["runtime"], session, outcome["grant"])
            return response_for(err)
        head = first
        if head.status != 200:
            chunks = [c async for c in recv if isinstance(c, bytes)]
            _note_for_log(outcome["runtime"], session, outcome["grant"])
            return Response(b"".join(chunks), status=head.status, content_type=head.content_type)

        async def body_iter() -> AsyncIterator[bytes]:
            body_started.set()
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
                        yield rename.chunk(parts[0] if len(parts) == 1 else b"".join(parts))
            finally:
                scope.cancel()

        async def body_must_start() -> None:
            with trio.move_on_after(host.config.server.stream_start_timeout):
                await body_started.wait()
                return
            log.info(
                "stream body never started: the client left before its head was sent",
                extra={"fields": {"model": runtime.id, "session": session_hash(session)}},
            )
            scope.cancel()
            recv.close()

        _note_for_log(outcome["runtime"], session, outcome["grant"])
        resp = Response(
            body_iter(),
            status=200,
            content_type="text/event-stream",
            headers={**SSE_HEADERS, **_wait_header(outcome["grant"])},
        )
        resp.timeout = None
        host.tasks.start_soon(body_must_start)
        handed_off = True
        return resp
    finally:
        if not handed_off:
            scope.cancel()
            recv.close()


QUEUE_WAIT_HEADER = "X-Gezel-Queue-Wait-Ms"
"""How long the request waited for its slot (queue, model load, slot preparation)."""


def _wait_header(grant: Grant | None) -> dict[str, str]:
    return {} if grant is None else {QUEUE_WAIT_HEADER: f"{grant.queue_wait_s * 1000:.1f}"}


async def _stream_into(
    host: Host,
    runtime: ModelRuntime,
    body: dict[str, Any],
    path: str,
    session: str | None,
    guarded: StallGuard,
    outcome: dict[str, Any],
) -> None:
    """Relay one stream into ``guarded``, holding its slot; ``outcome`` gets the grant
    and the member it ran on. Sent again once when the engine went away before
    ``guarded`` passed anything on. Raises the project's errors; cancellation exits
    the slot and closes the upstream stream."""
    for attempt in (1, 2):
        outcome["grant"] = None
        try:
            async with host.completion_slot(runtime, session=session) as (member, grant):
                outcome["grant"], outcome["runtime"] = grant, member
                await member.client.stream(
                    path, upstream_body(body, grant), guarded, slot=grant.slot_id
                )
            return
        except EngineCrashed:
            granted: Grant | None = outcome["grant"]
            member = outcome["runtime"]
            if attempt == 2 or guarded.events or granted is None:
                raise
            if not await _engine_went_away(member, granted):
                raise
            log.info(
                "the engine died before answering: sending the stream again",
                extra={"fields": {"model": member.id, "session": session_hash(session)}},
            )
            runtime = _resend_to(host, member, session)


def _waiting_stream(
    host: Host,
    runtime: ModelRuntime,
    session: str | None,
    recv: trio.MemoryReceiveChannel[UpstreamHead | bytes],
    scope: trio.CancelScope,
    body_started: trio.Event,
    outcome: dict[str, Any],
    rename: ModelRename,
) -> Response:
    """The response of a stream that is still waiting for its slot: SSE comments every
    ``sse_keepalive_interval`` until the engine's head arrives, then the engine's
    stream. The queue wait goes out as a comment (the head has left already); an
    engine error, before or after its head, becomes an SSE error event."""
    interval = host.config.server.sse_keepalive_interval

    async def body_iter() -> AsyncIterator[bytes]:
        body_started.set()
        try:
            async with recv:
                yield b": waiting for a slot\n\n"
                head: UpstreamHead | None = None
                while head is None:
                    with trio.move_on_after(interval):
                        try:
                            first = await recv.receive()
                        except trio.EndOfChannel:
                            err = outcome["error"] or EngineCrashed(
                                "the engine closed the stream before answering"
                            )
                            yield sse_error_event(err)
                            return
                        if isinstance(first, bytes):  # the job failed before the engine answered
                            yield first
                            return
                        head = first
                        break
                    yield b": waiting for a slot\n\n"
                grant = outcome["grant"]
                if grant is not None:
                    yield f": queue_wait_ms={grant.queue_wait_s * 1000:.1f}\n\n".encode()
                if head.status != 200:
                    text = b"".join([c async for c in recv if isinstance(c, bytes)])
                    yield sse_error_event(
                        EngineFailed(f"the engine answered {head.status}: {text[:300]!r}")
                    )
                    return
                async for chunk in recv:
                    if isinstance(chunk, bytes):
                        yield rename.chunk(chunk)
        finally:
            scope.cancel()
            # the request's log line is written after the body: give it the grant now
            fields.update(_log_fields(outcome["runtime"], session, outcome["grant"]))

    async def body_must_start() -> None:
        with trio.move_on_after(host.config.server.stream_start_timeout):
            await body_started.wait()
            return
        scope.cancel()
        recv.close()

    fields = _log_fields(runtime, session, None)
    g.gezel_log = fields
    resp = Response(body_iter(), status=200, content_type="text/event-stream", headers=SSE_HEADERS)
    resp.timeout = None
    host.tasks.start_soon(body_must_start)
    return resp


def _note_for_log(runtime: ModelRuntime, session: str | None, grant: Grant | None) -> None:
    """Hand the request log line what only the relay knows (see metrics_endpoint.log_request),
    and, after a KV restore, who verifies it against the answer's cached tokens."""
    g.gezel_log = _log_fields(runtime, session, grant)


def _log_fields(runtime: ModelRuntime, session: str | None, grant: Grant | None) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "session": session_hash(session),
        "slot": grant.slot_id if grant else None,
        "queue_wait_ms": round(grant.queue_wait_s * 1000, 2) if grant else None,
        "prepare_calls": grant.prepare_calls if grant else None,
    }
    if grant is not None and grant.restored_tokens:
        fields["verify_restore"] = partial(runtime.verify_restore, grant.restored_tokens)
    return fields
