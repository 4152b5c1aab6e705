"""The HTTP side of a completion, the same for every dialect.

A dialect route parses its own shape, resolves the model once, and hands a
:class:`~gezel_trio.host.completion.Completion` (engine route, body, assembly) and a
:class:`Shaper` (how the engine's answer, stream events and errors look in its
shape) to :func:`proxy_completion`. The host's completion service
(:mod:`gezel_trio.host.completion`) runs it on a pinned slot, resends it before
the first byte, and assembles a non-streamed answer; this module turns what comes
back into the client's response: the status, the body or the stream, the dialect's
keep-alive while a stream waits for its slot, and what the request log and metrics
need to know: the session, the token counts, and the completion's progress (its grant,
its first token, the tokens generated so far), which they read when the request ends,
answered or not. A keep-alive is never a first token: the time to first token is the
engine's.

Streaming: the job runs in the host's nursery and pushes the engine's head and raw
chunks into a small channel that the response body reads. A client that
disconnects closes the body, which cancels the job, which closes the upstream
response: llama-server stops generating. An engine that fails mid-stream produces
one error event in the dialect's shape, then the end of the stream.

The response's ``model`` is the id the client asked for (the engine names the
model by its alias, which is the model id for engines the host spawns).
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

import trio
from quart import Response

from ..engine.client import UpstreamHead, UpstreamResult, sse_error_event
from ..engine.sse import data_payloads
from ..errors import EngineCrashed, EngineFailed, GezelError
from ..front_guard import call_when_client_leaves
from ..host import Host, ModelRuntime
from ..host.completion import Completion, EngineAnswer, Item, Owner, Progress, StreamJob
from ..host.limits import clamp_fields
from ..kv.sessions import session_hash
from ..scheduler import Grant
from .errors import response_for
from .exchange import Counts, current_exchange

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def requested_model(body: dict[str, Any], runtime: ModelRuntime) -> str:
    """The model name the client sent (the runtime's id when it sent none)."""
    named = body.get("model")
    return named if isinstance(named, str) and named else runtime.config.replica_of or runtime.id


class Shaper(Protocol):
    """How one dialect shapes what the engine answers. Plain code, no I/O."""

    media_type: str
    """The streamed answer's content type."""

    def answer(self, data: dict[str, Any]) -> bytes:
        """A whole 200 answer, from the assembled engine answer."""
        ...

    def failure(self, status: int, content_type: str, content: bytes) -> Response:
        """The engine's own error answer (non-200), in the dialect's shape."""
        ...

    def chunk(self, chunk: bytes) -> bytes:
        """Raw bytes of the engine's SSE stream in, the client's bytes out."""
        ...

    def end(self) -> bytes:
        """What closes the client's stream after the engine's ended."""
        ...

    def error_event(self, error: GezelError) -> bytes:
        """A failure amid a stream (the head has gone out as a 200)."""
        ...

    def waiting(self) -> bytes:
        """Something to send while the stream waits for its slot (b"": nothing)."""
        ...

    def counts(self) -> Counts | None:
        """The tokens of a streamed answer, when the shaper read them (None: read the
        stream's tail)."""
        ...


class PassThrough:
    """The engine's own shape (OpenAI's routes, llama.cpp's): bytes pass through,
    with ``model`` renamed to what the client asked for."""

    media_type = "text/event-stream"

    def __init__(self, rename: ModelRename) -> None:
        self._rename = rename

    def answer(self, data: dict[str, Any]) -> bytes:
        if isinstance(data.get("model"), str):
            data["model"] = self._rename.wanted
        elif isinstance(data.get("response"), dict) and "model" in data["response"]:
            data["response"]["model"] = self._rename.wanted
        return _dumps(data)

    def failure(self, status: int, content_type: str, content: bytes) -> Response:
        return Response(content, status=status, content_type=content_type)

    def chunk(self, chunk: bytes) -> bytes:
        return self._rename.chunk(chunk)

    def end(self) -> bytes:
        return b""

    def error_event(self, error: GezelError) -> bytes:
        return sse_error_event(error)

    def waiting(self) -> bytes:
        return b": waiting for a slot\n\n"

    def counts(self) -> Counts | None:
        return None


class ModelRename:
    """Rewrites the ``model`` field of an engine's answer to the name the client sent.

    A spawned engine already answers with the model id (``--alias``), so most
    answers pass through untouched; otherwise the engine's own name is learned
    from its first chunk and replaced byte-wise in every SSE chunk (an event
    split across two reads keeps the engine's name).
    """

    __slots__ = ("_engine_field", "_wanted_field", "wanted")

    def __init__(self, wanted: str, engine_name: str | None) -> None:
        self.wanted = wanted
        self._wanted_field = _model_field(wanted)
        self._engine_field = None if engine_name is None else _model_field(engine_name)

    def body(self, content: bytes) -> bytes:
        """A whole JSON answer the engine sent (one the host did not parse)."""
        if self._wanted_field in content or b'"model"' not in content:
            return content
        try:
            data = json.loads(content)
        except ValueError:
            return content
        if not isinstance(data, dict) or not isinstance(data.get("model"), str):
            return content
        data["model"] = self.wanted
        return _dumps(data)

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


def rename_for(body: dict[str, Any], runtime: ModelRuntime) -> ModelRename:
    """The rename of ``runtime``'s answers to the model name in ``body``."""
    spawned_alias = not runtime.config.external and runtime.config.replica_of is None
    return ModelRename(requested_model(body, runtime), runtime.id if spawned_alias else None)


def _model_field(name: str) -> bytes:
    return b'"model":' + json.dumps(name, ensure_ascii=False).encode()


def _learn_model_field(chunk: bytes) -> bytes | None:
    for payload in data_payloads(chunk):
        if not payload.startswith(b"{"):
            continue
        try:
            data = json.loads(payload)
        except ValueError:
            continue
        if isinstance(data, dict):
            named = data.get("model")
            if not isinstance(named, str) and isinstance(data.get("response"), dict):
                named = data["response"].get("model")
            if isinstance(named, str):
                return _model_field(named)
    return None


async def whole_engine_call(
    host: Host, runtime: ModelRuntime, path: str, body: dict[str, Any]
) -> Response:
    """Forward a request that the engine spreads over slots of its own choosing (it
    reads no ``id_slot``: embeddings, rerank), holding every slot of the engine, which
    are left unknown (erased before a chat uses one): no chat's KV is read or left
    behind. The answer is the engine's, its ``model`` renamed to what the client sent.
    Cancellation closes the upstream request and releases the slots."""
    upstream = {k: v for k, v in body.items() if k != "id_slot"}
    async with host.slot(runtime, any_slot=True):
        result = await runtime.client.forward("POST", path, body=upstream)
    return Response(
        rename_for(body, runtime).body(result.content),
        status=result.head.status,
        content_type=result.head.content_type,
    )


async def slot_free_call(
    host: Host,
    runtime: ModelRuntime,
    method: str,
    path: str,
    *,
    body: dict[str, Any] | None = None,
) -> UpstreamResult:
    """Forward one call that occupies no slot (tokenize, templates, token counts, props)
    to the model's engine.

    A ready engine gets it at once (held in use, so it is not released
    meanwhile). An engine that is not running, or that went away between the
    check and the call, is made resident through the scheduler first.
    Cancellation closes the upstream connection.
    """
    if runtime.ready:
        try:
            with runtime.hold():
                return await runtime.client.forward(method, path, body=body)
        except EngineCrashed:
            pass  # evicted or restarted meanwhile: go the long way once
    async with host.slot(runtime, needs_slot=False):
        result = await runtime.client.forward(method, path, body=body)
    return result


async def proxy_completion(
    host: Host,
    runtime: ModelRuntime,
    completion: Completion,
    *,
    owner: Owner,
    shaper: Shaper,
) -> Response:
    """Run ``completion`` on a slot of ``runtime`` (resolved once, by the route) for
    ``owner`` through the host's completion service, and answer in ``shaper``'s shape.
    Cancellation (the client left) exits the slot and closes the upstream request: the
    engine stops generating."""
    exchange = current_exchange()
    exchange.log = _log_fields(owner.session)
    if completion.stream:
        return await _stream(host, runtime, completion, owner, shaper)
    exchange.progress = progress = Progress()  # read by the request's record, even if cut
    answer = await host.completions.complete(runtime, completion, owner, progress)
    exchange.log["clamped"] = clamp_fields(answer.clamps)
    result = answer.result
    if isinstance(result, EngineAnswer):
        return shaper.failure(result.status, result.content_type, result.content)
    exchange.counts = answer.counts
    return Response(
        shaper.answer(result),
        status=200,
        content_type="application/json; charset=utf-8",
        headers=_wait_header(answer.grant),
    )


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


async def _stream(
    host: Host,
    runtime: ModelRuntime,
    completion: Completion,
    owner: Owner,
    shaper: Shaper,
) -> Response:
    """The response of a streamed completion, whose job runs in the host's nursery
    (:meth:`CompletionService.start_stream`): the engine's head decides the status;
    a job still queued after ``sse_keepalive_interval`` commits to a 200 with the
    dialect's keep-alive (:func:`_waiting_stream`). The job is cancelled when the body
    ends (the stream ended, or the client left) and, read or not, when its client
    closes the connection (:func:`_end_when_client_leaves`)."""
    job = host.completions.start_stream(runtime, completion, owner)
    exchange = current_exchange()
    exchange.progress = job.progress
    exchange.log["clamped"] = clamp_fields(job.clamps)
    _end_when_client_leaves(job)
    handed_off = False
    try:
        keepalive = host.config.server.sse_keepalive_interval
        first: Item | None = None
        with trio.move_on_after(keepalive if keepalive > 0 else math.inf):
            try:
                first = await job.recv.receive()
            except trio.EndOfChannel:
                err = job.error or EngineCrashed("the engine closed the stream before answering")
                return response_for(err)
        if first is None:
            # Still queued or loading: commit to a 200 stream and keep the client (and
            # any proxy) alive; a later failure is an error event.
            handed_off = True
            return _waiting_stream(host, job, shaper)
        if isinstance(first, GezelError):  # the job failed before the engine answered
            return response_for(first)
        if isinstance(first, bytes):  # pragma: no cover - the head always comes first
            raise EngineCrashed("the engine sent a body before its head")
        head = first
        if head.status != 200:
            chunks = [c async for c in job.recv if isinstance(c, bytes)]
            return shaper.failure(head.status, head.content_type, b"".join(chunks))

        async def body_iter() -> AsyncGenerator[bytes, None]:
            job.reading.set()
            try:
                async with job.recv:
                    async for item in _relayed(job.recv, shaper):
                        yield item
            finally:
                job.scope.cancel()
                exchange.client_left = job.client_left

        exchange.log["counts"] = shaper.counts  # a stream's tokens, once the shaper read them
        resp = Response(
            _JobBody(job, body_iter()),
            status=200,
            content_type=shaper.media_type,
            headers={**SSE_HEADERS, **_wait_header(job.grant)},
        )
        resp.timeout = None
        _expect_reader(host, job)
        handed_off = True
        return resp
    finally:
        if not handed_off:
            job.cancel()


def _end_when_client_leaves(job: StreamJob) -> None:
    """Have ``job`` end when its client closes its connection, whether its body was
    being read, not started yet, or never to be started (the client left between the
    route's answer and its first write: the body's own cleanup never runs). The
    connection tells, when the request came through :func:`~..front_guard.serve_front`;
    the job takes the call back when it ends."""
    job.on_end = call_when_client_leaves(job.scope.cancel)


def _expect_reader(host: Host, job: StreamJob) -> None:
    """``job``'s response is handed over: with no connection to tell that its client left
    (another server than ``serve_front``), the service cancels it unless its body starts
    within ``stream_start_timeout`` (:meth:`CompletionService.expect_reader`)."""
    if job.on_end is None:
        host.completions.expect_reader(job)


class _JobBody:
    """A stream job's response body: the chunks of ``chunks``; closing it ends the job,
    whether it was read or not. (The generator's own cleanup, which ends the job too,
    never runs for a body that was never started: a front that could not send the
    response closes it instead.)"""

    __slots__ = ("_chunks", "_job")

    def __init__(self, job: StreamJob, chunks: AsyncGenerator[bytes, None]) -> None:
        self._job = job
        self._chunks = chunks

    def __aiter__(self) -> _JobBody:
        return self

    async def __anext__(self) -> bytes:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        """End the job, then close the chunks (their cleanup, if they had started)."""
        self._job.cancel()
        await self._chunks.aclose()


async def _relayed(recv: trio.MemoryReceiveChannel[Item], shaper: Shaper) -> AsyncIterator[bytes]:
    """The client's bytes of a stream whose head has been read: each chunk shaped, a
    failure as the dialect's error event (and nothing after it), else the dialect's
    end once the engine's stream ended. When the client reads slower than the engine
    writes, what has piled up goes out in one write instead of one per token."""
    async for item in recv:
        if isinstance(item, GezelError):
            yield shaper.error_event(item)
            return
        if not isinstance(item, bytes):
            continue
        parts = [item]
        failed: GezelError | None = None
        while True:
            try:
                more = recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if isinstance(more, GezelError):
                failed = more
                break
            if isinstance(more, bytes):
                parts.append(more)
        out = shaper.chunk(parts[0] if len(parts) == 1 else b"".join(parts))
        if out:
            yield out
        if failed is not None:
            yield shaper.error_event(failed)
            return
    end = shaper.end()
    if end:
        yield end


QUEUE_WAIT_HEADER = "X-Gezel-Queue-Wait-Ms"
"""How long the request waited for its slot (queue, model load, slot preparation)."""


def _wait_header(grant: Grant | None) -> dict[str, str]:
    return {} if grant is None else {QUEUE_WAIT_HEADER: f"{grant.queue_wait_s * 1000:.1f}"}


def _waiting_stream(host: Host, job: StreamJob, shaper: Shaper) -> Response:
    """The response of a stream that is still waiting for its slot: the dialect's
    keep-alive every ``sse_keepalive_interval`` until the engine's head arrives, then
    the engine's stream. An engine error, before or after its head, becomes the
    dialect's error event."""
    interval = host.config.server.sse_keepalive_interval

    async def body_iter() -> AsyncGenerator[bytes, None]:
        job.reading.set()
        try:
            async with job.recv:
                waiting = shaper.waiting()
                if waiting:
                    yield waiting
                head: UpstreamHead | None = None
                while head is None:
                    with trio.move_on_after(interval):
                        try:
                            first = await job.recv.receive()
                        except trio.EndOfChannel:
                            err = job.error or EngineCrashed(
                                "the engine closed the stream before answering"
                            )
                            yield shaper.error_event(err)
                            return
                        if isinstance(first, GezelError):  # failed before the engine answered
                            yield shaper.error_event(first)
                            return
                        if isinstance(first, UpstreamHead):
                            head = first
                        break
                    if waiting:
                        yield waiting
                if head is None:  # pragma: no cover - the head always comes first
                    return
                if waiting and job.grant is not None:  # an SSE dialect: a comment
                    yield f": queue_wait_ms={job.grant.queue_wait_s * 1000:.1f}\n\n".encode()
                if head.status != 200:
                    text = b"".join([c async for c in job.recv if isinstance(c, bytes)])
                    yield shaper.error_event(
                        EngineFailed(f"the engine answered {head.status}: {text[:300]!r}")
                    )
                    return
                async for item in _relayed(job.recv, shaper):
                    yield item
        finally:
            job.scope.cancel()
            exchange.client_left = job.client_left

    exchange = current_exchange()
    exchange.log["counts"] = shaper.counts
    resp = Response(
        _JobBody(job, body_iter()),
        status=200,
        content_type=shaper.media_type,
        headers=SSE_HEADERS,
    )
    resp.timeout = None
    _expect_reader(host, job)
    return resp


def _log_fields(session: str | None) -> dict[str, Any]:
    """What the request log line gets from the relay itself (see
    :func:`~.metrics_endpoint.record_exchange`, which adds the grant's slot and wait)."""
    return {"session": session_hash(session), "clamped": None}
