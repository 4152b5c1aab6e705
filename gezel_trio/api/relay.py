"""Proxy one completion through a slot of its engine, streaming or not: the one
path every dialect takes.

A dialect route parses its own shape, names the engine route and body
(:class:`Upstream`), and hands over a :class:`Shaper` that turns the engine's
answer into the client's shape; :func:`proxy_completion` does the rest the same
way for all of them: it holds the slot with ``async with host.completion_slot(...)``
for exactly as long as the engine works on the request, pins it (``id_slot``),
sends it through the model's :class:`~gezel_trio.engine.client.EngineClient`,
sends it again when the engine died before any of the answer reached the client,
and records it.

Streaming: a task in the host's nursery holds the slot and pushes the engine's
head and then raw SSE chunks into a small memory channel; the response body
reads from it. A client that disconnects closes the body, which cancels the
task, which closes the upstream response: llama-server stops generating. An
engine that fails mid-stream produces one error event in the dialect's shape,
then the end of the stream.

The response's ``model`` is the id the client asked for (the engine names the
model by its alias, which is the model id for engines the host spawns).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import trio
from quart import Response, g

from .._trio import unwrapping
from ..engine.client import UpstreamHead, UpstreamResult, sse_error_event
from ..engine.supervisor import EngineState
from ..errors import EngineAbandoned, EngineCrashed, EngineFailed, FieldError, GezelError
from ..host import Host, ModelRuntime
from ..scheduler import Grant, Prefix, prefix_blocks
from ..sessions import session_hash
from .assemble import Shape, SseDecoder, StreamAssembler
from .auth import Owner
from .errors import response_for
from .metrics_endpoint import token_counts

log = logging.getLogger("gezel_trio.requests")

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


@dataclass(frozen=True, slots=True)
class Upstream:
    """What one completion sends to its engine: the route, the body (the host adds
    ``id_slot`` and ``cache_prompt``), and how a non-streamed answer is assembled
    from the engine's stream."""

    path: str
    body: dict[str, Any]
    shape: Shape
    stream: bool
    keep_tokens: bool = False


def upstream_body(body: dict[str, Any], grant: Grant) -> dict[str, Any]:
    """The body sent to the engine: the client's, with the scheduler's ``id_slot``,
    and ``cache_prompt`` off for a blind request (it may reuse nothing the slot
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


Counts = tuple[int | None, int | None, int | None]
"""(prompt, cached, completion) tokens, as :func:`.metrics_endpoint.token_counts` reads them."""


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
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                data = json.loads(line[6:])
            except ValueError:
                continue
            if isinstance(data, dict):
                named = data.get("model")
                if not isinstance(named, str) and isinstance(data.get("response"), dict):
                    named = data["response"].get("model")
                if isinstance(named, str):
                    return _model_field(named)
    return None


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


def check_limits(runtime: ModelRuntime, body: dict[str, Any]) -> None:
    """Refuse (400) what the engine's slot cannot hold: token ids out of its
    vocabulary, or more tokens to generate than a slot's context."""
    runtime.check_token_ids(body.get("prompt"), "prompt")
    ctx = runtime.config.ctx_per_slot
    for name in ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens"):
        v = body.get(name)
        if isinstance(v, int) and v > ctx:
            raise FieldError(
                name,
                f"{v} is more than the model's context per slot ({ctx} tokens); "
                f"ask for at most {ctx}",
            )


async def proxy_completion(
    host: Host,
    runtime: ModelRuntime,
    upstream: Upstream,
    *,
    owner: Owner,
    shaper: Shaper,
) -> Response:
    """Run ``upstream`` on a slot of ``runtime`` (resolved once, by the route) for
    ``owner``, and answer in ``shaper``'s shape. Cancellation (the client left) exits
    the slot and closes the upstream request: the engine stops generating."""
    check_limits(runtime, upstream.body)
    job = _Job(owner, prompt_blocks(upstream.body))
    if upstream.stream:
        return await _stream(host, runtime, upstream, job, shaper)
    return await _unary(host, runtime, upstream, job, shaper)


@dataclass(frozen=True, slots=True)
class _Job:
    """Who a completion runs for, and the prompt blocks it is placed by."""

    owner: Owner
    prefix: Prefix

    @property
    def session(self) -> str | None:
        return self.owner.session

    def slot(
        self, host: Host, runtime: ModelRuntime
    ) -> AbstractAsyncContextManager[tuple[ModelRuntime, Grant]]:
        """``host.completion_slot`` for this job."""
        return host.completion_slot(
            runtime, session=self.owner.session, keyless=self.owner.keyless, prefix=self.prefix
        )


TEXT_BLOCK_CHARS = 256
TOKEN_BLOCK = 64


def prompt_blocks(body: dict[str, Any]) -> Prefix:
    """The blocks a request's prompt is placed by (see :mod:`gezel_trio.scheduler.prefix`):
    one per message of a chat (or input item of a Responses request); for a text or
    token prompt, and an infill's extra context and prefix, its *complete* fixed-size
    pieces, so that a prompt that grows keeps every block of the shorter one. ``()``
    when the body has none of these."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return prefix_blocks(_canonical(m) for m in messages)
    parts: list[str] = []
    if isinstance(body.get("instructions"), str):
        parts.append(body["instructions"])
    inp = body.get("input")
    if isinstance(inp, list):
        return prefix_blocks([*parts, *(_canonical(item) for item in inp)])
    if isinstance(body.get("input_extra"), list):
        parts.append(_canonical(body["input_extra"]))
    for name in ("input", "input_prefix", "prompt"):
        parts += _pieces(body.get(name))
    return prefix_blocks(parts)


def _pieces(value: object) -> list[str]:
    """The complete pieces of a text (:data:`TEXT_BLOCK_CHARS`) or of a list of token
    ids (:data:`TOKEN_BLOCK`); the unfinished tail is left out."""
    if isinstance(value, str):
        size, items = TEXT_BLOCK_CHARS, value
        return [items[i : i + size] for i in range(0, len(items) - size + 1, size)]
    if isinstance(value, list) and all(isinstance(t, int) for t in value):
        size = TOKEN_BLOCK
        return [
            ",".join(map(str, value[i : i + size])) for i in range(0, len(value) - size + 1, size)
        ]
    return []


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


async def _unary(
    host: Host,
    runtime: ModelRuntime,
    upstream: Upstream,
    job: _Job,
    shaper: Shaper,
) -> Response:
    """A non-streaming completion: streamed from the engine and assembled here, so a
    client that walks away (the handler is cancelled) stops generation at once.

    When the engine dies before it produced a single token of the answer (the
    request met a process being killed), the request is sent again, once, to the
    restarted engine or another replica: nothing of it reached the client, and
    nothing of it ran. So is one abandoned on a hung external engine (it may have
    run there, but the client has none of it).
    """
    for attempt in (1, 2):
        try:
            async with job.slot(host, runtime) as (runtime, grant):
                assembled = await _assembled(runtime, upstream, grant)
            break
        except (_NothingGenerated, EngineAbandoned):
            # nothing of the answer reached the client: it may go elsewhere
            if attempt == 2 or not await _engine_went_away(runtime, grant):
                raise
            log.info(
                "the engine died before answering: sending the request again",
                extra={"fields": {"model": runtime.id, "session": session_hash(job.session)}},
            )
            runtime = _resend_to(host, runtime, job.owner)
    _note_for_log(runtime, job.session, grant)
    if isinstance(assembled, _EngineAnswer):
        return shaper.failure(assembled.status, assembled.content_type, assembled.content)
    g.gezel_counts = token_counts(assembled)
    return Response(
        shaper.answer(assembled),
        status=200,
        content_type="application/json; charset=utf-8",
        headers=_wait_header(grant),
    )


def _resend_to(host: Host, failed: ModelRuntime, owner: Owner) -> ModelRuntime:
    """Where a request goes again after ``failed``'s engine went away before answering:
    another replica if one is left, else the same model (its engine restarts)."""
    if failed.config.replica_of is None:
        return failed
    return host.resolve_model(
        failed.config.replica_of, session=owner.route_session, avoid={failed.id}
    )


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


@dataclass(frozen=True, slots=True)
class _EngineAnswer:
    """An answer the engine gave instead of a completion: its status and body."""

    status: int
    content_type: str
    content: bytes


async def _assembled(
    runtime: ModelRuntime, upstream: Upstream, grant: Grant
) -> dict[str, Any] | _EngineAnswer:
    """Send ``upstream`` on ``grant``'s slot as a stream and assemble the non-streaming
    answer, parsed once. An engine error before the stream is relayed as it came; an
    error event amid it becomes that error's status. Cancellation closes the stream,
    which stops the engine on its next write."""
    streamed = {**upstream_body(upstream.body, grant), "stream": True}
    if upstream.shape in ("chat", "text"):
        streamed["stream_options"] = {"include_usage": True}
    send, recv = trio.open_memory_channel[UpstreamHead | bytes](64)
    assembler = StreamAssembler(upstream.shape, keep_tokens=upstream.keep_tokens)
    decoder = SseDecoder()
    head: UpstreamHead | None = None
    raw: list[bytes] = []

    async def produce() -> None:
        async with send:
            await runtime.client.stream(upstream.path, streamed, send, slot=grant.slot_id)

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
                            if not events:
                                g.gezel_first_event_at = time.perf_counter()  # its TTFT
                            events += 1
                            assembler.feed(event)
    except EngineCrashed as exc:
        if events == 0 and not isinstance(exc, _NothingGenerated):
            raise _NothingGenerated(exc.message) from exc
        raise
    if head is None:  # pragma: no cover - the producer raised, and that left the nursery
        raise EngineCrashed("the engine closed the stream before answering")
    if head.status != 200:
        return _EngineAnswer(head.status, head.content_type, b"".join(raw))
    if assembler.error is not None:
        error = assembler.error.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        return _EngineAnswer(status, "application/json; charset=utf-8", _dumps(assembler.error))
    return assembler.result()


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


Item = UpstreamHead | bytes | GezelError
"""What the relay channel carries: the engine's head, its raw chunks, and at most one
failure, last."""


async def _stream(
    host: Host,
    runtime: ModelRuntime,
    upstream: Upstream,
    job: _Job,
    shaper: Shaper,
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
    send, recv = trio.open_memory_channel[Item](32)
    guarded = StallGuard(send, host.config.server.stream_stall_timeout)
    scope = trio.CancelScope()
    body_started = trio.Event()
    outcome: dict[str, Any] = {"error": None, "grant": None, "runtime": runtime}

    async def runner() -> None:
        async with send:
            with scope:
                try:
                    await _stream_into(host, runtime, upstream, job, guarded, outcome)
                except GezelError as exc:
                    outcome["error"] = exc
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    # the client went away mid-stream (or stopped reading)
                    log.info(
                        "client left mid-stream",
                        extra={
                            "fields": {
                                "model": runtime.id,
                                "session": session_hash(job.session),
                                "why": str(exc) or "disconnected",
                            }
                        },
                    )
                except Exception as exc:  # a bug: never leave the client hanging
                    log.exception("stream job failed")
                    outcome["error"] = EngineCrashed(f"internal error while relaying: {exc!r}")
                # Once granted, the head may already be in the channel: end with the
                # error (the handler also reads one that arrives before any head).
                if outcome["error"] is not None and outcome["grant"] is not None:
                    with trio.move_on_after(1, shield=True):
                        try:
                            await send.send(outcome["error"])
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            pass

    host.tasks.start_soon(runner)
    handed_off = False
    try:
        keepalive = host.config.server.sse_keepalive_interval
        first: Item | None = None
        with trio.move_on_after(keepalive if keepalive > 0 else math.inf):
            try:
                first = await recv.receive()
            except trio.EndOfChannel:
                err = outcome["error"] or EngineCrashed(
                    "the engine closed the stream before answering"
                )
                _note_for_log(outcome["runtime"], job.session, outcome["grant"])
                return response_for(err)
        if first is None:
            # Still queued or loading: commit to a 200 stream and keep the client (and
            # any proxy) alive; a later failure is an error event.
            handed_off = True
            return _waiting_stream(
                host, runtime, job.session, recv, scope, body_started, outcome, shaper
            )
        if isinstance(first, GezelError):  # the job failed before the engine answered
            _note_for_log(outcome["runtime"], job.session, outcome["grant"])
            return response_for(first)
        if isinstance(first, bytes):  # pragma: no cover - the head always comes first
            raise EngineCrashed("the engine sent a body before its head")
        head = first
        if head.status != 200:
            chunks = [c async for c in recv if isinstance(c, bytes)]
            _note_for_log(outcome["runtime"], job.session, outcome["grant"])
            return shaper.failure(head.status, head.content_type, b"".join(chunks))

        async def body_iter() -> AsyncIterator[bytes]:
            body_started.set()
            try:
                async with recv:
                    async for item in _relayed(recv, shaper):
                        yield item
            finally:
                scope.cancel()

        async def body_must_start() -> None:
            with trio.move_on_after(host.config.server.stream_start_timeout):
                await body_started.wait()
                return
            log.info(
                "stream body never started: the client left before its head was sent",
                extra={"fields": {"model": runtime.id, "session": session_hash(job.session)}},
            )
            scope.cancel()
            recv.close()

        _note_for_log(outcome["runtime"], job.session, outcome["grant"], shaper)
        resp = Response(
            body_iter(),
            status=200,
            content_type=shaper.media_type,
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


async def _stream_into(
    host: Host,
    runtime: ModelRuntime,
    upstream: Upstream,
    job: _Job,
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
            async with job.slot(host, runtime) as (member, grant):
                outcome["grant"], outcome["runtime"] = grant, member
                await member.client.stream(
                    upstream.path,
                    upstream_body(upstream.body, grant),
                    guarded,
                    slot=grant.slot_id,
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
                extra={"fields": {"model": member.id, "session": session_hash(job.session)}},
            )
            runtime = _resend_to(host, member, job.owner)


def _waiting_stream(
    host: Host,
    runtime: ModelRuntime,
    session: str | None,
    recv: trio.MemoryReceiveChannel[Item],
    scope: trio.CancelScope,
    body_started: trio.Event,
    outcome: dict[str, Any],
    shaper: Shaper,
) -> Response:
    """The response of a stream that is still waiting for its slot: the dialect's
    keep-alive every ``sse_keepalive_interval`` until the engine's head arrives, then
    the engine's stream. An engine error, before or after its head, becomes the
    dialect's error event."""
    interval = host.config.server.sse_keepalive_interval

    async def body_iter() -> AsyncIterator[bytes]:
        body_started.set()
        try:
            async with recv:
                waiting = shaper.waiting()
                if waiting:
                    yield waiting
                head: UpstreamHead | None = None
                while head is None:
                    with trio.move_on_after(interval):
                        try:
                            first = await recv.receive()
                        except trio.EndOfChannel:
                            err = outcome["error"] or EngineCrashed(
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
                grant = outcome["grant"]
                if waiting and grant is not None:  # an SSE dialect: a comment
                    yield f": queue_wait_ms={grant.queue_wait_s * 1000:.1f}\n\n".encode()
                if head.status != 200:
                    text = b"".join([c async for c in recv if isinstance(c, bytes)])
                    yield shaper.error_event(
                        EngineFailed(f"the engine answered {head.status}: {text[:300]!r}")
                    )
                    return
                async for item in _relayed(recv, shaper):
                    yield item
        finally:
            scope.cancel()
            # the request's log line is written after the body: give it the grant now
            fields.update(_log_fields(outcome["runtime"], session, outcome["grant"], shaper))

    async def body_must_start() -> None:
        with trio.move_on_after(host.config.server.stream_start_timeout):
            await body_started.wait()
            return
        scope.cancel()
        recv.close()

    fields = _log_fields(runtime, session, None, shaper)
    g.gezel_log = fields
    resp = Response(body_iter(), status=200, content_type=shaper.media_type, headers=SSE_HEADERS)
    resp.timeout = None
    host.tasks.start_soon(body_must_start)
    return resp


def _note_for_log(
    runtime: ModelRuntime,
    session: str | None,
    grant: Grant | None,
    shaper: Shaper | None = None,
) -> None:
    """Hand the request log line what only the relay knows (see metrics_endpoint.log_request),
    and, after a KV restore, who verifies it against the answer's cached tokens."""
    g.gezel_log = _log_fields(runtime, session, grant, shaper)


def _log_fields(
    runtime: ModelRuntime,
    session: str | None,
    grant: Grant | None,
    shaper: Shaper | None = None,
) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "session": session_hash(session),
        "slot": grant.slot_id if grant else None,
        "queue_wait_ms": round(grant.queue_wait_s * 1000, 2) if grant else None,
        "prepare_calls": grant.prepare_calls if grant else None,
    }
    if shaper is not None:
        fields["counts"] = shaper.counts  # a stream's tokens, once the shaper read them
    if grant is not None and grant.restored_tokens:
        fields["verify_restore"] = partial(runtime.verify_restore, grant.restored_tokens)
    return fields
