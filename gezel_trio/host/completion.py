"""The completion service: how every completion runs on a slot, whatever its dialect.

A dialect (``gezel_trio.api``) parses its own shape, resolves the model once and
hands over a :class:`Completion`: the engine route, the body, and how a
non-streamed answer is assembled. From there every completion takes one path:

- its limits are fitted to the model (:meth:`CompletionService.fit_limits`): token ids
  out of its vocabulary are a 400, an output limit above a slot's context is lowered
  to it (:mod:`.limits`), and the answer says so (``clamps``, for the request log);
- it takes a slot for its :class:`Owner` with ``async with host.completion_slot(...)``,
  placed by the blocks of its prompt (:func:`prompt_blocks`);
- it is sent pinned to that slot (``id_slot``; ``cache_prompt`` off when blind);
- it is sent again, once, when the engine died before any of the answer reached
  the client (to the restarted engine, or another replica);
- a non-streamed completion is streamed from the engine and assembled here, so a
  client that walks away stops generation at once (llama-server, measured on
  b10435, kept generating a non-streamed request for 10 s and more after its
  client closed);
- once its answer is known (assembled, or its stream ended), a completion that ran
  on a KV restore verifies it against the tokens the engine reports cached
  (:meth:`ModelRuntime.verify_restore <gezel_trio.host.runtime.ModelRuntime.verify_restore>`);
- a stream whose reader never starts reading is cancelled, by its connection when
  its client leaves (``StreamJob.on_end`` takes that call back), else by
  :meth:`CompletionService.expect_reader`.

What comes back is the engine's, parsed once (:class:`Answer`), or a stream of
its raw chunks (:class:`StreamJob`); shaping it for the client is the dialect's.
Nothing here knows HTTP on the client's side.
"""

from __future__ import annotations

import array
import itertools
import json
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

import trio

from ..config.schema import Config
from ..engine.argv import context_shift
from ..engine.assemble import Shape, StreamAssembler
from ..engine.client import UpstreamHead
from ..engine.sse import SseDecoder
from ..engine.supervisor import EngineState
from ..engine.usage import Counts, StreamTail, generated_in, token_counts
from ..errors import EngineAbandoned, EngineCrashed, EngineFailed, GezelError
from ..kv.lead import Lead, LeadOf, lead_of
from ..kv.prefix import Header
from ..kv.sessions import session_hash
from ..scheduler import Grant, Prefix, prefix_blocks
from .limits import ENGINE_MAX, Clamp, fit_output_limits
from .runtime import ModelRuntime
from .snapshot import CompletionStats

log = logging.getLogger("gezel_trio.requests")

__all__ = [
    "Answer",
    "Completion",
    "CompletionService",
    "CompletionStats",
    "EngineAnswer",
    "Item",
    "Owner",
    "Progress",
    "StreamJob",
    "prompt_blocks",
    "upstream_body",
]


@dataclass(frozen=True, slots=True)
class Owner:
    """Whose KV a request's slot holds, as the scheduler keys it: ``session`` is the
    caller's named chat, the caller's keyless owner (``[scheduler] keyless =
    "shared"``), or None for a blind request (``"blind"``); ``keyless`` says the
    client named no conversation; ``caller`` is the caller whose other owners'
    prefixes it may start from (None: it shares none: not known, or a keyless
    conversation of ``keyless = "conversation"``)."""

    session: str | None
    keyless: bool
    caller: str | None = None

    @property
    def route_session(self) -> str | None:
        """The session a replicated model routes by: a keyless owner spreads by load."""
        return None if self.keyless else self.session


@dataclass(frozen=True, slots=True)
class Completion:
    """What one completion sends to its engine: the route, the body (the service adds
    ``id_slot`` and ``cache_prompt``), whether it is streamed to the client, and how a
    non-streamed answer is assembled from the engine's stream. ``clamps``: what of the
    client's request the host serves less of than asked (a dialect's own, such as
    Ollama's ``num_ctx``; the service adds the output limits it lowers)."""

    path: str
    body: dict[str, Any]
    shape: Shape
    stream: bool
    keep_tokens: bool = False
    clamps: tuple[Clamp, ...] = ()


@dataclass(slots=True)
class Progress:
    """How far a completion has got, kept up to date while it runs, so that whoever
    started it knows even when it never returns (its client left): the grant of the
    slot it holds (None: still queued), when the engine's first event and first
    generated token came (``time.perf_counter``), and the tokens generated so far
    (events that carry generated output: llama-server sends one per token)."""

    grant: Grant | None = None
    first_event_at: float | None = None
    first_token_at: float | None = None
    tokens: int = 0

    @property
    def ttft_at(self) -> float | None:
        """When the first token came: the first generated output, else (an answer with
        none) the engine's first event."""
        return self.first_token_at if self.first_token_at is not None else self.first_event_at

    def tell(self, grant: Grant) -> None:
        """Tell the scheduler, as the request leaves its slot, that the engine
        generated a token for it (``grant.answered``): a blind request's engine then
        started it from nothing, and the slot holds its owner's KV alone."""
        if self.first_token_at is not None:
            grant.answered()

    def add(self, chunk: bytes, shape: Shape) -> None:
        """A chunk of the engine's answer (its SSE stream of ``shape``) came."""
        if self.first_event_at is None:
            self.first_event_at = time.perf_counter()
        tokens = generated_in(chunk, shape)
        if tokens > 0:
            self.tokens += tokens
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()


@dataclass(frozen=True, slots=True)
class EngineAnswer:
    """An answer the engine gave instead of a completion: its status and body."""

    status: int
    content_type: str
    content: bytes


@dataclass(frozen=True, slots=True)
class Answer:
    """A non-streamed completion: the engine's answer assembled and parsed once (or its
    own error answer), the member and grant it ran on."""

    result: dict[str, Any] | EngineAnswer
    runtime: ModelRuntime
    grant: Grant
    counts: Counts
    """The answer's (prompt, cached, completion) tokens, read once (all None for an
    engine's error answer)."""
    clamps: tuple[Clamp, ...] = ()
    """What the request asked more of than it was served (see :class:`Completion`)."""


Item = UpstreamHead | bytes | GezelError
"""What a stream job's channel carries: the engine's head, its raw chunks, and at most
one failure, last."""


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


TEXT_BLOCK_CHARS = 256
TOKEN_BLOCK = 64
_ID_BYTES = array.array("q").itemsize

# The first character of a message's blocks says what each is, so that no text can
# pass for a header, and a boundary between messages (a header) is never one between
# pieces of a message's text.
_HEADER, _PIECE, _REST, _PART_HEADER, _WHOLE = "\x00", "\x01", "\x02", "\x03", "\x04"


def prompt_blocks(body: dict[str, Any]) -> Prefix:
    """The blocks a request's prompt is placed by (see :mod:`gezel_trio.kv.prefix`).

    A chat's messages (or a Responses request's input items), each as its header
    (everything but its text content, a :class:`~gezel_trio.kv.prefix.Header`), then
    its text content in complete :data:`TEXT_BLOCK_CHARS`-character pieces and a
    final block for the rest (:func:`_message_blocks`); so a request that continues
    another message by message has the other's blocks as a prefix, and one whose last
    message grew keeps its header and every complete piece of the shorter version. A
    text or token prompt, and an infill's extra context and prefix, as its *complete*
    fixed-size pieces, so that a prompt that grows keeps every block of the shorter
    one. ``()`` when the body has none of these."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return prefix_blocks(_message_blocks(messages))
    parts: list[str | bytes] = []
    if isinstance(body.get("instructions"), str):
        parts.append(body["instructions"])
    inp = body.get("input")
    if isinstance(inp, list):
        return prefix_blocks(itertools.chain(parts, _message_blocks(inp)))
    if isinstance(body.get("input_extra"), list):
        parts.append(_canonical(body["input_extra"]))
    for name in ("input", "input_prefix", "prompt"):
        parts += _pieces(body.get(name))
    return prefix_blocks(parts)


def request_lead(completion: Completion) -> Lead | None:
    """The lead of a chat or Responses request (:func:`~gezel_trio.kv.lead.lead_of`),
    its blocks cut as :func:`prompt_blocks` cuts the whole request."""
    return lead_of(completion.path, completion.body, _lead_blocks)


def _lead_blocks(messages: list[Any], instructions: str | None) -> Prefix:
    head = [instructions] if instructions is not None else []
    return prefix_blocks(itertools.chain(head, _message_blocks(messages)))


def _message_blocks(messages: Iterable[object]) -> Iterator[str]:
    """Each message's blocks, lazily (:func:`~gezel_trio.kv.prefix.prefix_blocks` reads
    no more than ``MAX_BLOCKS``): its header (the message without ``content``), then
    its content. Text content (a string, or a list of text parts alone, which the
    engine renders as their texts joined by newlines) is :func:`_text_blocks`;
    another list of parts gives each text part (a part with a string ``text``) as its
    own header (the part without ``text``) and its text's blocks, and any other part
    (an image, a tool result) as one block. A message whose content is neither (none:
    a tool call, say) is one block, its whole self. An item's ``id`` (Codex names
    every Responses input item anew in each session) is left out: the engine renders
    none, so two sessions whose items differ only in their ids share their blocks as
    they share tokens."""
    for message in messages:
        content: object = message.get("content") if isinstance(message, dict) else None
        if not isinstance(message, dict) or not isinstance(content, (str, list)):
            yield _WHOLE + _canonical(
                _without(message, "id") if isinstance(message, dict) else message
            )
            continue
        yield Header(_HEADER + _canonical(_without(message, "content", "id")))
        if isinstance(content, list) and content and all(map(_plain_text, content)):
            # the engine renders text parts as their texts joined by newlines: so many
            # tokens as that string, whatever the client marked on them (Claude Code
            # resends a message as a string, and moves its cache_control marks)
            content = "\n".join(part["text"] for part in content)
        if isinstance(content, str):
            yield from _text_blocks(content)
            continue
        for part in content:
            text: object = part.get("text") if isinstance(part, dict) else None
            if not isinstance(part, dict) or not isinstance(text, str):
                yield _WHOLE + _canonical(part)
                continue
            yield Header(_PART_HEADER + _canonical(_without(part, "text")))
            yield from _text_blocks(text)


def _plain_text(part: object) -> bool:
    """Whether a content part is text alone (``type`` text, or a Responses input's or
    output's text; marks such as ``cache_control`` aside, which the engine ignores)."""
    return (
        isinstance(part, dict)
        and part.get("type", "text") in ("text", "input_text", "output_text")
        and isinstance(part.get("text"), str)
        and all(k in ("type", "text", "cache_control") for k in part)
    )


def _without(value: dict[Any, Any], *keys: str) -> dict[Any, Any]:
    return {k: v for k, v in value.items() if k not in keys}


def _text_blocks(text: str) -> Iterator[str]:
    """A message's text: its complete :data:`TEXT_BLOCK_CHARS`-character pieces, then
    always one block for the rest (possibly empty), which ends the text."""
    size = TEXT_BLOCK_CHARS
    whole = len(text) - len(text) % size
    for i in range(0, whole, size):
        yield _PIECE + text[i : i + size]
    yield _REST + text[whole:]


def _pieces(value: object) -> list[str] | list[bytes]:
    """The complete pieces of a text (:data:`TEXT_BLOCK_CHARS`) or of a list of token
    ids (:data:`TOKEN_BLOCK`, each piece the ids as 64-bit integers: a 3,500-token
    prompt in a tenth of the time their decimal text took); the unfinished tail is left
    out. A list of anything but integers has none."""
    if isinstance(value, str):
        size = TEXT_BLOCK_CHARS
        return [value[i : i + size] for i in range(0, len(value) - size + 1, size)]
    if isinstance(value, list):
        try:
            ids = array.array("q", value).tobytes()
        except (TypeError, OverflowError):
            return []  # not token ids (text and ids mixed, several prompts, ...)
        size = TOKEN_BLOCK * _ID_BYTES
        return [ids[i : i + size] for i in range(0, len(ids) - size + 1, size)]
    return []


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


class _NothingGenerated(EngineCrashed):
    """The engine failed before a single event of the answer arrived."""


class StallGuard:
    """A stream job channel's sending end, with a stall timeout: a client that stops
    reading for ``stall_s`` (the channel stays full) is treated as gone.

    It passes on one head: a stream sent again after its engine died before any
    event brings a second one, which is dropped when it is a 200 like the first (the
    client goes on reading the same response) and is an error otherwise."""

    __slots__ = (
        "_channel",
        "_head",
        "_progress",
        "_shape",
        "_stall_s",
        "events",
        "tail",
    )

    def __init__(
        self,
        channel: trio.MemorySendChannel[Item],
        stall_s: float,
        *,
        progress: Progress | None = None,
        shape: Shape = "chat",
    ):
        self._channel = channel
        self._stall_s = stall_s
        self._head: UpstreamHead | None = None
        self._progress = progress
        self._shape: Shape = shape
        self.events = 0
        """Chunks of the answer handed on so far (0: the client has none of it)."""
        self.tail = StreamTail()
        """The end of what was handed on, where the engine says its token counts."""

    @property
    def answered(self) -> bool:
        """Whether the engine's head was a 200: its stream is an answer."""
        return self._head is not None and self._head.status == 200

    async def send(self, value: UpstreamHead | bytes, /) -> None:
        """Raises BrokenResourceError after ``stall_s`` without room in the channel,
        EngineFailed for a second head that is not a 200. It waits (a checkpoint) only
        when the channel is full: the engine's stream, which it is fed from, checkpoints
        on every read. Cancellation while it waits leaves the value unsent."""
        if isinstance(value, UpstreamHead):
            if self._head is not None:
                if value.status == 200 and self._head.status == 200:
                    return
                raise EngineFailed(f"the engine answered {value.status} when sent again")
            self._head = value
        try:
            self._channel.send_nowait(value)  # the usual case: no deadline to arm
        except trio.WouldBlock:
            with trio.move_on_after(self._stall_s) as waited:
                await self._channel.send(value)
            if waited.cancelled_caught:
                raise trio.BrokenResourceError(
                    f"the client read nothing for {self._stall_s:g}s"
                ) from None
        if not isinstance(value, UpstreamHead):
            self.events += 1
            self.tail.add(value)
            if self._progress is not None and self.answered:
                self._progress.add(value, self._shape)


@dataclass(slots=True)
class StreamJob:
    """A streamed completion running in a task of the host's nursery.

    ``recv`` yields the engine's head, then its raw chunks, then at most one
    :class:`GezelError`; it ends when the job ends. ``progress``, ``runtime`` and
    ``error`` say how far it got, where it ran and how it failed; ``client_left``
    that it ended because its reader went away or stopped reading. Cancelling
    ``scope`` (the client left, or never started reading) ends the job: the slot,
    lease and upstream connection are released by its scope exits."""

    recv: trio.MemoryReceiveChannel[Item]
    scope: trio.CancelScope
    runtime: ModelRuntime
    session: str | None
    progress: Progress = field(default_factory=Progress)
    clamps: tuple[Clamp, ...] = ()
    """What the request asked more of than it is served (see :class:`Completion`)."""
    error: GezelError | None = None
    client_left: bool = False
    reading: trio.Event = field(default_factory=trio.Event)
    """Set by the reader once it starts reading (see :meth:`CompletionService.expect_reader`)."""
    on_end: Callable[[], object] | None = None
    """Called once the job has ended (its task's last step)."""

    @property
    def grant(self) -> Grant | None:
        """The grant of the slot it holds (None until granted)."""
        return self.progress.grant

    def cancel(self) -> None:
        """End the job (its channel too), whatever it is doing."""
        self.scope.cancel()
        self.recv.close()


class SlotSource(Protocol):
    """What the service needs of the :class:`~gezel_trio.host.Host` that owns it."""

    @property
    def config(self) -> Config: ...

    @property
    def tasks(self) -> trio.Nursery: ...

    def completion_slot(
        self,
        runtime: ModelRuntime,
        *,
        session: str | None,
        keyless: bool,
        prefix: Prefix,
        caller: str | None = None,
        lead: LeadOf | None = None,
    ) -> AbstractAsyncContextManager[tuple[ModelRuntime, Grant]]: ...

    def resolve_model(
        self, model_id: object, *, session: str | None = None, avoid: Collection[str] = ()
    ) -> ModelRuntime: ...


class CompletionService:
    """Runs completions on the slots of ``host``'s engines (see the module docstring)."""

    def __init__(self, host: SlotSource) -> None:
        self._host = host
        self._resent = 0

    def statistics(self) -> CompletionStats:
        return CompletionStats(resent=self._resent)

    def __repr__(self) -> str:
        return f"<CompletionService of {self._host!r}>"

    @staticmethod
    def fit_limits(runtime: ModelRuntime, completion: Completion) -> Completion:
        """``completion`` as the engine will serve it: refused (400) for token ids out
        of the model's vocabulary (llama-server answers 500, or worse) and for an output
        limit the engine cannot read (above 2**31 - 1, its own 400); an output limit
        above a slot's context lowered to that context, which the engine serves exactly
        as the client's value (it stops when the slot is full; see :mod:`.limits`), the
        clamp added to ``completion.clamps``."""
        body = completion.body
        runtime.check_token_ids(body.get("prompt"), "prompt")
        ctx = runtime.ctx_per_slot
        fitted, clamps = fit_output_limits(
            body,
            ctx_per_slot=ENGINE_MAX if ctx is None else ctx,  # unknown yet: lower nothing
            context_shift=context_shift(runtime.engine.argv or runtime.config.args),
        )
        if not clamps:
            return completion
        return replace(completion, body=fitted, clamps=completion.clamps + clamps)

    def say_what_is_dropped(self, runtime: ModelRuntime, completion: Completion) -> None:
        """Warn, once per model, when a request carries ``tools`` to a model whose chat
        template does not render them: llama-server drops them silently (the prompt is
        the same without them). The engine is asked once per process (``/props``), in
        the host's tasks once it is ready; never waits, never raises."""
        tools = completion.body.get("tools")
        if not isinstance(tools, list) or not tools:
            return
        if runtime.tools_asked_now():
            _warn_if_tools_dropped(runtime)
            return
        try:
            self._host.tasks.start_soon(self._ask_then_say, runtime)
        except RuntimeError:  # the host is shutting down
            pass

    async def _ask_then_say(self, runtime: ModelRuntime) -> None:
        with trio.move_on_after(self._host.config.engine.load_timeout):
            await runtime.engine.state.wait_value(EngineState.READY)
            await runtime.ask_engine_tools()
        _warn_if_tools_dropped(runtime)

    def _slot(
        self, runtime: ModelRuntime, owner: Owner, prefix: Prefix, completion: Completion
    ) -> AbstractAsyncContextManager[tuple[ModelRuntime, Grant]]:
        return self._host.completion_slot(
            runtime,
            session=owner.session,
            keyless=owner.keyless,
            prefix=prefix,
            caller=owner.caller,
            lead=partial(request_lead, completion),
        )

    def _resend_to(self, failed: ModelRuntime, owner: Owner) -> ModelRuntime:
        """Where a request goes again after ``failed``'s engine went away before
        answering: another replica if one is left, else the same model (its engine
        restarts)."""
        if failed.config.replica_of is None:
            return failed
        return self._host.resolve_model(
            failed.config.replica_of, session=owner.route_session, avoid={failed.id}
        )

    # ------------------------------------------------------------------ not streamed

    async def complete(
        self,
        runtime: ModelRuntime,
        completion: Completion,
        owner: Owner,
        progress: Progress | None = None,
    ) -> Answer:
        """Run ``completion`` for ``owner`` and return the engine's whole answer; how far
        it got is kept in ``progress`` as it goes (the caller reads it when cancelled).

        It is streamed from the engine and assembled here, so a client that walks
        away (the caller is cancelled) stops generation at once. When the engine dies
        before it produced a single event of the answer (the request met a process
        being killed), the request is sent again, once, to the restarted engine or
        another replica: nothing of it reached the client, and nothing of it ran. So
        is one abandoned on a hung external engine (it may have run there, but the
        client has none of it). Cancellation exits the slot and closes the upstream
        request."""
        completion = self.fit_limits(runtime, completion)
        self.say_what_is_dropped(runtime, completion)
        prefix = prompt_blocks(completion.body)
        if progress is None:
            progress = Progress()
        for attempt in (1, 2):
            try:
                async with self._slot(runtime, owner, prefix, completion) as (runtime, grant):
                    progress.grant = grant
                    result = await _assembled(runtime, completion, grant, progress)
                    counts: Counts = (None, None, None)
                    if not isinstance(result, EngineAnswer):
                        counts = token_counts(result)
                        _answered_whole(grant, counts)  # before the slot is settled
                break
            except (_NothingGenerated, EngineAbandoned):
                # nothing of the answer reached the client: it may go elsewhere
                if attempt == 2 or not await _engine_went_away(runtime, grant):
                    raise
                log.info(
                    "the engine died before answering: sending the request again",
                    extra={"fields": {"model": runtime.id, "session": session_hash(owner.session)}},
                )
                self._resent += 1
                runtime = self._resend_to(runtime, owner)
        if not isinstance(result, EngineAnswer):
            _verify_restore(runtime, grant, counts)
        return Answer(result, runtime, grant, counts, completion.clamps)

    # ------------------------------------------------------------------ streamed

    def start_stream(
        self, runtime: ModelRuntime, completion: Completion, owner: Owner
    ) -> StreamJob:
        """Start ``completion`` for ``owner`` in a task of the host's nursery and return
        its :class:`StreamJob`. The job holds its slot while it relays the engine's
        stream into the job's channel; it ends (and the slot, lease and upstream
        connection with it) when the stream ends, when the job is cancelled, or when
        the reader stops taking chunks for ``stream_stall_timeout``. When the engine
        dies before the reader got any of the answer's events, the request is sent
        again, once: to another replica, else to the restarted engine. Raises (400) at
        once for what the model cannot read (:meth:`fit_limits`)."""
        completion = self.fit_limits(runtime, completion)
        self.say_what_is_dropped(runtime, completion)
        prefix = prompt_blocks(completion.body)
        send, recv = trio.open_memory_channel[Item](32)
        job = StreamJob(recv, trio.CancelScope(), runtime, owner.session, clamps=completion.clamps)
        guarded = StallGuard(
            send,
            self._host.config.server.stream_stall_timeout,
            progress=job.progress,
            shape=completion.shape,
        )

        async def run() -> None:
            try:
                async with send:
                    with job.scope:
                        try:
                            await self._stream_into(
                                runtime, completion, owner, prefix, guarded, job
                            )
                        except GezelError as exc:
                            job.error = exc
                        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                            # the client went away mid-stream (or stopped reading)
                            job.client_left = True
                            log.info(
                                "client left mid-stream",
                                extra={
                                    "fields": {
                                        "model": runtime.id,
                                        "session": session_hash(owner.session),
                                        "why": str(exc) or "disconnected",
                                    }
                                },
                            )
                        except Exception as exc:  # a bug: never leave the client hanging
                            log.exception("stream job failed")
                            job.error = EngineCrashed(f"internal error while relaying: {exc!r}")
                        # Once granted, the head may already be in the channel: end with the
                        # error (the reader also takes one that arrives before any head).
                        if job.error is not None and job.grant is not None:
                            with trio.move_on_after(1, shield=True):
                                try:
                                    await send.send(job.error)
                                except (trio.BrokenResourceError, trio.ClosedResourceError):
                                    pass
            finally:
                if job.on_end is not None:
                    job.on_end()

        self._host.tasks.start_soon(run)
        return job

    def expect_reader(self, job: StreamJob) -> None:
        """Cancel ``job`` unless its reader starts reading (sets ``job.reading``)
        within ``stream_start_timeout``: a response handed over whose body never
        starts (the client left before its head was sent) never runs the body's own
        cleanup, which would cancel the job. The wait runs in the host's nursery."""
        self._host.tasks.start_soon(self._reader_must_start, job)

    async def _reader_must_start(self, job: StreamJob) -> None:
        with trio.move_on_after(self._host.config.server.stream_start_timeout):
            await job.reading.wait()
            return
        log.info(
            "stream body never started: the client left before its head was sent",
            extra={"fields": {"model": job.runtime.id, "session": session_hash(job.session)}},
        )
        job.cancel()

    async def _stream_into(
        self,
        runtime: ModelRuntime,
        completion: Completion,
        owner: Owner,
        prefix: Prefix,
        guarded: StallGuard,
        job: StreamJob,
    ) -> None:
        """Relay one stream into ``guarded``, holding its slot; ``job`` gets the grant
        and the member it ran on. Sent again once when the engine went away before
        ``guarded`` passed anything on. A stream the engine answered (a 200) and ended
        verifies a KV restore with the counts of its last events. Raises the project's
        errors; cancellation exits the slot and closes the upstream stream."""
        for attempt in (1, 2):
            job.progress.grant = None
            try:
                async with self._slot(runtime, owner, prefix, completion) as (member, grant):
                    job.progress.grant, job.runtime = grant, member
                    try:
                        await member.client.stream(
                            completion.path,
                            upstream_body(completion.body, grant),
                            guarded,
                            slot=grant.slot_id,
                        )
                        if guarded.answered:
                            _answered_whole(grant, guarded.tail.counts())
                    finally:
                        job.progress.tell(grant)
                if guarded.answered:
                    _verify_restore(member, grant, guarded.tail.counts())
                return
            except EngineCrashed:
                granted = job.grant
                member = job.runtime
                if attempt == 2 or guarded.events or granted is None:
                    raise
                if not await _engine_went_away(member, granted):
                    raise
                log.info(
                    "the engine died before answering: sending the stream again",
                    extra={"fields": {"model": member.id, "session": session_hash(owner.session)}},
                )
                self._resent += 1
                runtime = self._resend_to(member, owner)


def _warn_if_tools_dropped(runtime: ModelRuntime) -> None:
    if runtime.engine_tools is False:
        runtime.warn_once(
            "tools dropped",
            f"the chat template of {runtime.id!r} does not render tools: llama-server "
            "drops a request's tools silently and the model never sees them. Serve a "
            "model whose template supports tools, or give this one such a template "
            "(--chat-template-file in its args)",
            why="chat_template_caps.supports_tools is false",
        )


def _verify_restore(runtime: ModelRuntime, grant: Grant, counts: Counts) -> None:
    """After a KV restore (``grant.restored_tokens``) or a start from a lead
    (``grant.lead_tokens``), hand the answer's (prompt, cached) tokens, as the engine
    reported them, to ``runtime``'s verification."""
    try:
        if grant.restored_tokens:
            runtime.verify_restore(grant.restored_tokens, counts[0], counts[1])
        if grant.lead_tokens:
            runtime.verify_lead(grant.lead_tokens, counts[1])
    except Exception:  # pragma: no cover - bookkeeping must never fail a completion
        log.exception("verifying a KV restore failed")


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


class _Assembling:
    """The :class:`~gezel_trio.engine.client.Sink` of a non-streamed completion: the
    engine's head, then its chunks decoded and merged as they come, in the task that
    reads the stream (no task or channel between them)."""

    __slots__ = ("assembler", "decoder", "events", "head", "progress", "raw", "shape")

    def __init__(self, completion: Completion, progress: Progress) -> None:
        self.assembler = StreamAssembler(completion.shape, keep_tokens=completion.keep_tokens)
        self.shape: Shape = completion.shape
        self.decoder = SseDecoder()
        self.head: UpstreamHead | None = None
        self.raw: list[bytes] = []
        self.progress = progress
        self.events = 0

    async def send(self, value: UpstreamHead | bytes, /) -> None:
        if isinstance(value, UpstreamHead):
            self.head = value
        elif self.head is not None and self.head.status != 200:
            self.raw.append(value)
        else:
            self.progress.add(value, self.shape)
            for event in self.decoder.feed(value):
                self.events += 1
                self.assembler.feed(event)


async def _assembled(
    runtime: ModelRuntime, completion: Completion, grant: Grant, progress: Progress
) -> dict[str, Any] | EngineAnswer:
    """Send ``completion`` on ``grant``'s slot as a stream and assemble the non-streamed
    answer, parsed once; ``progress`` counts its events as they come. An engine error
    before the stream is relayed as it came; an error event amid it becomes that
    error's status. Cancellation closes the stream, which stops the engine on its next
    write."""
    streamed = {**upstream_body(completion.body, grant), "stream": True}
    if completion.shape in ("chat", "text"):
        streamed["stream_options"] = {"include_usage": True}
    sink = _Assembling(completion, progress)
    try:
        await runtime.client.stream(completion.path, streamed, sink, slot=grant.slot_id)
    except EngineCrashed as exc:
        if sink.events == 0 and not isinstance(exc, _NothingGenerated):
            raise _NothingGenerated(exc.message) from exc
        raise
    finally:
        progress.tell(grant)
    head, assembler = sink.head, sink.assembler
    if head is None:  # pragma: no cover - the stream raised before its head
        raise EngineCrashed("the engine closed the stream before answering")
    if head.status != 200:
        return EngineAnswer(head.status, head.content_type, b"".join(sink.raw))
    if assembler.error is not None:
        error = assembler.error.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        content = json.dumps(assembler.error, ensure_ascii=False, separators=(",", ":")).encode()
        return EngineAnswer(status, "application/json; charset=utf-8", content)
    return assembler.result()


def _answered_whole(grant: Grant, counts: Counts) -> None:
    """A whole answer whose engine counted the prompt it read: the engine ran the
    request on its slot, even when it generated no token (an end of generation
    first), so a blind request emptied the slot first (``grant.answered``)."""
    prompt = counts[0]
    if prompt is not None and prompt > 0:
        grant.answered()
