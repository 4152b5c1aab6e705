"""Ollama's API, for apps built for Ollama: ``/api/chat``, ``/api/generate``,
``/api/embed``, ``/api/embeddings``, ``/api/tags``, ``/api/ps``, ``/api/show``,
``/api/version``; ``HEAD /`` (the probe Ollama's clients send) is the status
page's own route (Werkzeug answers HEAD for every GET rule, with no body).

Each request is translated by :mod:`.ollama_translate` (plain functions, no
I/O) into a request for a llama-server route that honours ``id_slot`` and
``cache_prompt``, and goes through the one completion path
(:func:`.relay.proxy_completion`) like every dialect: pinned, isolated by owner,
streamed token by token, stopped when the client walks away. The answer is
shaped back by :class:`OllamaShaper`: one JSON object, or NDJSON lines ending in
``done: true`` with the engine's own counts and times (``total_duration`` and
``load_duration`` are the host's wall times).

Ollama's bodies name no conversation: a request is keyless and follows
``[scheduler] keyless`` (the caller's keyless owner, or blind), unless one of
:data:`.auth.SESSION_HEADERS` names a session (:func:`.auth.request_owner`). It is
authenticated like every model route (any API key; see :mod:`.auth`), and its
errors are Ollama's ``{"error": "..."}`` (:mod:`.errors` picks the shape by path).

``keep_alive`` (applied when the request's answer ends, to every engine of the
model): 0 stops the engine once no request holds it; a duration is the model's
idle TTL from then on (:meth:`~gezel_trio.host.ModelRuntime.set_idle_ttl`); a
negative one keeps it until evicted; none restores the configured ``idle_ttl``,
as Ollama applies its default to every request that names none.

``/api/pull``, ``push``, ``create``, ``copy`` and ``delete`` answer 501 with what
to do instead: this host serves the models its config and models folder name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import trio
from quart import Blueprint, Response, current_app, request
from quart.wrappers.response import IterableBody

from ..engine.client import UpstreamResult
from ..engine.sse import SseDecoder
from ..engine.supervisor import EngineState
from ..engine.usage import token_counts
from ..errors import EngineFailed, FieldError, GezelError, UnknownModel
from ..host import Host, ModelRuntime
from ..host.completion import Completion, Owner
from ..host.limits import Clamp, fit_num_ctx
from .auth import request_owner
from .errors import json_response
from .exchange import Counts, current_exchange
from .metrics_endpoint import resolve_model
from .ollama_image_translate import image_answer, image_generate_request, image_progress
from .ollama_translate import (
    CHAT_PATH,
    EMBEDDINGS_PATH,
    EngineRequest,
    KeepAlive,
    LoadedFacts,
    ModelFacts,
    NdjsonStream,
    WallTimes,
    answer_body,
    chat_request,
    check_against_model,
    embed_request,
    embeddings_request,
    engine_error_message,
    error_body,
    generate_request,
    load_answer,
    model_capabilities,
    model_digest,
    model_id_candidates,
    ndjson_line,
    not_found_message,
    not_implemented_body,
    ps_body,
    show_body,
    show_request,
    tags_body,
    template_supports_thinking,
    version_body,
)
from .relay import proxy_completion
from .rendering import RenderEvent, is_image_model, render, stream_render
from .validation import read_json_object

__all__ = ["NDJSON", "OllamaShaper", "RequestClock", "bp", "has_projector", "model_facts"]

log = logging.getLogger("gezel_trio.api.ollama")

bp = Blueprint("ollama", __name__)

NDJSON: Final = "application/x-ndjson"

_PROJECTOR_FLAGS: Final = ("--mmproj", "-mm", "--mmproj-url", "-mmu")


def _host() -> Host:
    host: Host = current_app.config["GEZEL_HOST"]
    return host


# --------------------------------------------------------------------------- shaping


@dataclass(frozen=True, slots=True)
class RequestClock:
    """When a request arrived, and whether its model's engine was ready then: what
    :class:`WallTimes` (``total_duration``, ``load_duration``) are measured from."""

    runtime: ModelRuntime
    started_ns: int
    """``time.monotonic_ns()`` at the request's arrival."""
    started_at: float
    """``trio.current_time()`` at the same moment (the engine's clock)."""
    was_ready: bool

    @classmethod
    def start(cls, runtime: ModelRuntime, started_ns: int) -> RequestClock:
        elapsed_s = (time.monotonic_ns() - started_ns) / 1e9
        return cls(runtime, started_ns, trio.current_time() - elapsed_s, runtime.ready)

    def wall(self) -> WallTimes:
        """The wall times now: ``load_ns`` is the wait for the engine to become ready
        when it was not at the request's arrival (0 when it was)."""
        ready_at = self.runtime.engine.ready_at
        loaded_ns = None
        if not self.was_ready and ready_at is not None and ready_at >= self.started_at:
            loaded_ns = self.started_ns + round((ready_at - self.started_at) * 1e9)
        return WallTimes.since(self.started_ns, loaded_ns=loaded_ns)


class OllamaShaper:
    """The engine's answer, streamed or not, as Ollama's: a JSON object, or NDJSON
    lines (the stream's keep-alive while it waits is nothing at all: the 200 head)."""

    media_type = NDJSON

    def __init__(self, request: EngineRequest, clock: RequestClock) -> None:
        self._request = request
        self._clock = clock
        self._decoder = SseDecoder()
        self._stream = NdjsonStream(request) if request.stream else None
        self._counts: Counts | None = None

    def __repr__(self) -> str:
        return f"<OllamaShaper {self._request.kind} {self._stream!r}>"

    def answer(self, data: dict[str, Any]) -> bytes:
        return _dumps(answer_body(self._request, data, self._clock.wall()))

    def failure(self, status: int, content_type: str, content: bytes) -> Response:
        return engine_failure(status, content)

    def chunk(self, chunk: bytes) -> bytes:
        assert self._stream is not None, "a chunk of a request that does not stream"
        out: list[bytes] = []
        for event in self._decoder.feed(chunk):
            if isinstance(event, dict) and (
                isinstance(event.get("usage"), dict) or isinstance(event.get("timings"), dict)
            ):
                self._counts = token_counts(event)
            out.extend(self._stream.feed(event))
        return b"".join(out)

    def end(self) -> bytes:
        assert self._stream is not None
        return self._stream.finish(self._clock.wall())

    def error_event(self, error: GezelError) -> bytes:
        if self._stream is None:  # pragma: no cover - only streams have events
            return _dumps(error_body(error.message)) + b"\n"
        return self._stream.error(error.message)

    def waiting(self) -> bytes:
        return b""

    def counts(self) -> Counts | None:
        return self._counts


def engine_failure(status: int, content: bytes) -> Response:
    """An engine's error answer (its own status) in Ollama's shape."""
    try:
        payload: object = json.loads(content)
    except ValueError:
        payload = content
    status = status if 400 <= status < 600 else 502
    return json_response(error_body(engine_error_message(payload)), status)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- models


def _resolve(host: Host, name: str, *, session: str | None = None) -> ModelRuntime:
    """The runtime a client's model name means (``name:latest`` is ``name``); 404
    ``model 'x' not found`` otherwise. Labels the request's metrics."""
    for candidate in model_id_candidates(name):
        try:
            return resolve_model(host, candidate, session=session)
        except UnknownModel:
            continue
    raise UnknownModel(not_found_message(name))


def has_projector(runtime: ModelRuntime, extra_args: Sequence[str] = ()) -> bool:
    """Whether the model's engine reads images: a spawned engine started with a
    multimodal projector (``--mmproj`` in its args or the host's ``extra_args``, as
    the models folder pairs an ``mmproj*.gguf`` with its model); an external engine
    is asked nothing here and answers for itself."""
    if runtime.config.external:
        return True
    for args in (runtime.config.args, extra_args, runtime.engine.argv):
        for arg in args:
            if arg in _PROJECTOR_FLAGS or arg.startswith(("--mmproj=", "--mmproj-url=")):
                return True
    return False


async def _facts(host: Host, runtime: ModelRuntime) -> ModelFacts:
    return await model_facts(runtime, extra_args=host.config.engine.extra_args)


def _public(runtime: ModelRuntime) -> str:
    return runtime.config.replica_of or runtime.id


def _members(host: Host, runtime: ModelRuntime) -> list[ModelRuntime]:
    """Every engine of ``runtime``'s model (a replicated model's members)."""
    public = runtime.config.replica_of
    return (host.replica_members(public) if public else []) or [runtime]


def _public_runtimes(host: Host) -> list[ModelRuntime]:
    """One runtime per model clients can name (a replicated model's first member)."""
    out = []
    for public in host.public_ids():
        members = host.replica_members(public)
        out.append(members[0] if members else host.models[public])
    return out


@dataclass(frozen=True, slots=True)
class _FileFacts:
    """A model file's identity and the GGUF keys Ollama's listings show."""

    path: str
    size: int
    modified_ns: int
    file_type: int | None = None
    parameter_count: int | None = None
    chat_template: str | None = None
    fim: bool = False


_FILE_FACTS: dict[tuple[str, int, int], _FileFacts] = {}
_FILE_FACTS_MAX: Final = 256


def _file_facts(path: str) -> _FileFacts:
    """Stat the model file and read its GGUF header once per version of the file
    (blocking I/O: from a thread). An unreadable header leaves the GGUF facts out."""
    resolved = os.path.realpath(path)
    st = os.stat(resolved)
    key = (resolved, st.st_size, st.st_mtime_ns)
    cached = _FILE_FACTS.get(key)
    if cached is not None:
        return cached
    facts = _FileFacts(resolved, st.st_size, st.st_mtime_ns)
    try:
        facts = _read_gguf_facts(facts)
    except Exception as exc:  # a listing must not fail on one odd file
        log.info("GGUF header of %s not read for Ollama's listings: %r", resolved, exc)
    if len(_FILE_FACTS) >= _FILE_FACTS_MAX:
        _FILE_FACTS.pop(next(iter(_FILE_FACTS)))
    _FILE_FACTS[key] = facts
    return facts


def _read_gguf_facts(facts: _FileFacts) -> _FileFacts:
    from gguf import GGUFReader

    reader = GGUFReader(facts.path, "r")

    def value(name: str) -> Any:
        field = reader.fields.get(name)
        return None if field is None else field.contents()

    file_type = value("general.file_type")
    count = value("general.parameter_count")
    if not isinstance(count, int) or count <= 0:
        count = sum(int(t.n_elements) for t in reader.tensors) or None
    template = value("tokenizer.chat_template")
    fim = all(
        value(f"tokenizer.ggml.fim_{part}_token_id") is not None for part in ("pre", "suf", "mid")
    )
    return _FileFacts(
        facts.path,
        facts.size,
        facts.modified_ns,
        file_type=file_type if isinstance(file_type, int) else None,
        parameter_count=count,
        chat_template=template if isinstance(template, str) else None,
        fim=fim,
    )


def _num_ctx(runtime: ModelRuntime) -> tuple[tuple[str, Any], ...]:
    """``num_ctx``: the context each slot runs (none when it is not known yet)."""
    ctx = runtime.ctx_per_slot
    return () if ctx is None else (("num_ctx", ctx),)


async def model_facts(runtime: ModelRuntime, *, extra_args: Sequence[str] = ()) -> ModelFacts:
    """What ``/api/tags``, ``/api/ps`` and ``/api/show`` say about a model: its file's
    size, date and digest and its GGUF header (read once per file version, in a
    thread: cancellation waits for that read). Whether it takes tools is its engine's
    word once asked (asked here once per engine process, when it runs), else a guess
    from its chat template (:attr:`ModelRuntime.supports_tools`)."""
    if is_image_model(runtime):
        return await trio.to_thread.run_sync(_image_facts, runtime)
    config = runtime.config
    public = _public(runtime)
    embedding_only = config.embeddings or config.reranking
    if not embedding_only:
        await runtime.ask_engine_tools()
    if config.path is None:  # an external engine: nothing to stat
        digest = hashlib.sha256(f"external\0{config.url}".encode()).hexdigest()
        return ModelFacts(
            model_id=public,
            size=0,
            modified_ns=runtime.created * 1_000_000_000,
            digest=digest,
            capabilities=model_capabilities(
                completion=not embedding_only,
                tools=runtime.engine_tools is True and not embedding_only,
                embedding=config.embeddings,
                vision=True,
            ),
            ctx_per_slot=runtime.ctx_per_slot,
            parameters=_num_ctx(runtime),
        )
    file = await trio.to_thread.run_sync(_file_facts, config.path)
    gguf = runtime.gguf
    template = file.chat_template
    arch = gguf.architecture if gguf else None
    metadata: list[tuple[str, Any]] = []
    if gguf is not None:
        metadata += [
            (f"{arch}.block_count", gguf.block_count),
            (f"{arch}.attention.head_count", gguf.head_count),
            (f"{arch}.attention.head_count_kv", max(gguf.head_count_kv, default=0)),
        ]
        if gguf.feed_forward_length:
            metadata.append((f"{arch}.feed_forward_length", gguf.feed_forward_length))
        if gguf.vocab_size:
            metadata.append((f"{arch}.vocab_size", gguf.vocab_size))
        if gguf.name:
            metadata.append(("general.name", gguf.name))
    return ModelFacts(
        model_id=public,
        size=file.size,
        modified_ns=file.modified_ns,
        digest=model_digest(file.path, file.size, file.modified_ns),
        architecture=arch,
        parameter_count=file.parameter_count,
        file_type=file.file_type,
        context_length=gguf.context_length if gguf else None,
        ctx_per_slot=runtime.ctx_per_slot,
        embedding_length=gguf.embedding_length if gguf else None,
        chat_template=template,
        capabilities=model_capabilities(
            completion=not embedding_only,
            tools=runtime.supports_tools,
            fim=not embedding_only and file.fim,
            vision=not embedding_only and has_projector(runtime, extra_args),
            embedding=config.embeddings,
            thinking=not embedding_only and template_supports_thinking(template),
        ),
        parameters=_num_ctx(runtime),
        metadata=tuple(metadata),
    )


def _image_facts(runtime: ModelRuntime) -> ModelFacts:
    """An image model as Ollama lists one: capabilities ``["image"]`` (what Ollama says
    of its own image models, which it serves through ``/api/generate``), the size of
    all its files, the newest file's date (blocking stats: from a thread)."""
    config: Any = runtime.config
    files = getattr(config, "files", None) or {}
    paths = (
        [str(config.path)] if getattr(config, "path", None) else [str(p) for p in files.values()]
    )
    stats = [os.stat(os.path.realpath(p)) for p in paths]
    size = sum(st.st_size for st in stats)
    modified_ns = max((st.st_mtime_ns for st in stats), default=runtime.created * 1_000_000_000)
    first = os.path.realpath(paths[0]) if paths else runtime.id
    return ModelFacts(
        model_id=_public(runtime),
        size=size,
        modified_ns=modified_ns,
        digest=model_digest(first, size, modified_ns),
        capabilities=("image",),
    )


def _loaded_facts(members: Sequence[ModelRuntime], now_ns: int) -> LoadedFacts | None:
    """A model's loaded engines as ``/api/ps`` shows them (None: none is loaded)."""
    ready = [m for m in members if m.engine.state.value is EngineState.READY]
    if not ready:
        return None
    size = vram = 0
    expires: int | None = 0
    for member in ready:
        plan = member.active_plan
        if plan is not None:
            size += plan.total_bytes
        elif member.gguf is not None:
            size += member.gguf.file_size
        if plan is not None and plan.device == "gpu":
            vram += max(0, plan.total_bytes - plan.host_bytes)
        ttl = member.engine.timing.idle_ttl
        if ttl <= 0 or expires is None:
            expires = None
        else:
            left = max(0.0, ttl - member.engine.idle_for())
            expires = max(expires, now_ns + round(left * 1e9))
    ctx = ready[0].ctx_per_slot
    return LoadedFacts(size=size, size_vram=vram, expires_ns=expires, context_length=ctx)


# --------------------------------------------------------------------------- keep_alive


def _apply_keep_alive(host: Host, runtime: ModelRuntime, keep_alive: KeepAlive | None) -> None:
    """What the request's ``keep_alive`` asks of its model's engines, once its answer
    has ended. Never raises and never waits: an unload runs in the host's tasks."""
    for member in _members(host, runtime):
        if keep_alive is None:
            member.set_idle_ttl(None)
        elif keep_alive.forever:
            member.set_idle_ttl(0)
        elif not keep_alive.unload:
            member.set_idle_ttl(keep_alive.seconds)
        else:
            try:
                host.tasks.start_soon(unload_when_idle, member)
            except RuntimeError:  # the host is shutting down: its engines stop anyway
                pass


async def unload_when_idle(runtime: ModelRuntime) -> None:
    """Stop ``runtime``'s engine as soon as no request holds it (its sessions parked
    first, as any planned stop). Cancellation (the host shutting down) abandons the
    wait; a stop already asked for goes on."""
    engine = runtime.engine
    while engine.busy:
        await engine.wait_idle()
    await engine.stop()


def _after_answer(resp: Response, done: Callable[[], None]) -> Response:
    """Run ``done`` once ``resp`` has been sent: at once for a whole answer, when its
    body ends (finished, failed, or the client gone) for a stream."""
    body = resp.response
    if not isinstance(body, IterableBody):
        done()
        return resp

    async def relayed() -> AsyncIterator[bytes]:
        try:
            async with body as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            done()

    resp.response = IterableBody(relayed())
    return resp


async def _load_only(host: Host, runtime: ModelRuntime, request: EngineRequest) -> Response:
    """A request with nothing to generate: load the model (through the scheduler, as a
    request would), or unload it with ``keep_alive`` 0. Cancellation abandons the wait
    for the load; a start under way goes on."""
    unload = request.keep_alive is not None and request.keep_alive.unload
    if not unload and not runtime.ready:
        async with host.slot(runtime, needs_slot=False):
            pass
    _apply_keep_alive(host, runtime, request.keep_alive)
    return json_response(load_answer(request))


# --------------------------------------------------------------------------- routes


def _refuse_unsupported(runtime: ModelRuntime, request: EngineRequest) -> None:
    config = runtime.config
    if request.kind in ("embed", "embeddings"):
        if not config.embeddings:
            raise FieldError(
                "model",
                f"{request.model!r} does not support embeddings "
                "(set embeddings = true in its [[models]] entry)",
            )
    elif config.embeddings or config.reranking:
        what = "embeddings" if config.embeddings else "reranking"
        raise FieldError(
            "model", f"{request.model!r} does not support {request.kind}: it serves {what} only"
        )


async def _prepared(
    translate: Callable[[Mapping[str, Any]], EngineRequest],
    *,
    owned: bool,
    body: Mapping[str, Any] | None = None,
) -> tuple[Host, ModelRuntime, EngineRequest, Owner | None, RequestClock]:
    started_ns = time.monotonic_ns()
    host = _host()
    if body is None:
        body = await read_json_object()
    translated = translate(body)
    owner = request_owner(host, body) if owned else None
    session = owner.route_session if owner is not None else None
    runtime = _resolve(host, translated.model, session=session)
    _refuse_unsupported(runtime, translated)
    translated = check_against_model(
        translated, has_projector=has_projector(runtime, host.config.engine.extra_args)
    )
    return host, runtime, translated, owner, RequestClock.start(runtime, started_ns)


async def _completion(
    translate: Callable[[Mapping[str, Any]], EngineRequest],
    *,
    body: Mapping[str, Any] | None = None,
) -> Response:
    """``/api/chat`` and ``/api/generate``: through the one completion path.
    Cancellation (the client left) stops the engine's generation."""
    host, runtime, translated, owner, clock = await _prepared(translate, owned=True, body=body)
    assert owner is not None
    clamp = _fit_num_ctx(runtime, translated)
    if translated.load_only:
        return await _load_only(host, runtime, translated)
    upstream = Completion(
        translated.path,
        translated.body,
        "chat" if translated.path == CHAT_PATH else "native",
        stream=translated.stream,
        clamps=() if clamp is None else (clamp,),
    )
    shaper = OllamaShaper(translated, clock)

    def done() -> None:
        _apply_keep_alive(host, runtime, translated.keep_alive)

    try:
        resp = await proxy_completion(host, runtime, upstream, owner=owner, shaper=shaper)
    except BaseException:
        done()
        raise
    return _after_answer(resp, done)


def _fit_num_ctx(runtime: ModelRuntime, request: EngineRequest) -> Clamp | None:
    """An ``options.num_ctx`` above the model's context per slot is served with that
    context (llama-server cannot widen a slot per request; Ollama lowers a ``num_ctx``
    above the model's trained context the same way), with a warning once per model
    (and context): clients such as aider ask for 1.25 x the prompt + 8,192 on every
    request. The clamp goes in the request's log line."""
    ctx = runtime.ctx_per_slot
    if ctx is None:  # not known yet (an external engine never seen): nothing to fit to
        return None
    clamp = fit_num_ctx(request.num_ctx, ctx_per_slot=ctx)
    if clamp is not None:
        runtime.warn_once(
            ("num_ctx", ctx),
            f"options.num_ctx {clamp.asked} asked of {_public(runtime)!r} is more than its "
            f"context per slot: served with {ctx} tokens (raise ctx_per_slot in its "
            "[[models]] entry for more). Said once per model",
            asked=clamp.asked,
            served=ctx,
        )
    return clamp


@bp.post("/api/chat")
async def chat() -> Response:
    return await _completion(chat_request)


@bp.post("/api/generate")
async def generate() -> Response:
    body = await read_json_object()
    runtime = _image_runtime(_host(), body.get("model") or body.get("name"))
    if runtime is not None:
        return await _image_generate(runtime, body)
    return await _completion(generate_request, body=body)


def _image_runtime(host: Host, name: object) -> ModelRuntime | None:
    """The image model a generate request names, or None (a text model, or no model)."""
    if not isinstance(name, str) or not name:
        return None
    for candidate in model_id_candidates(name):
        for runtime in host.models.values():
            if candidate in (runtime.id, runtime.config.name):
                return runtime if is_image_model(runtime) else None
    return None


async def _image_generate(runtime: ModelRuntime, body: Mapping[str, Any]) -> Response:
    """``/api/generate`` with an image model: the image, whole or streamed with progress
    (see :mod:`.ollama_image_translate`); ``keep_alive`` applies once it ends, as for a
    text model. Cancellation (the client left) cancels the render."""
    started_ns = time.monotonic_ns()
    host = _host()
    translated = image_generate_request(body)
    clock = RequestClock.start(runtime, started_ns)
    current_exchange().model = runtime.id
    if translated.load_only:
        request = EngineRequest(
            kind="generate",
            path="",
            body={},
            stream=False,
            model=translated.model,
            keep_alive=translated.keep_alive,
            load_only=True,
        )
        return await _load_only(host, runtime, request)

    def done() -> None:
        _apply_keep_alive(host, runtime, translated.keep_alive)

    if not translated.stream:
        try:
            result = await render(host, runtime.id, translated.job)
        finally:
            done()
        return json_response(image_answer(translated.model, result, clock.wall()))

    def shape(event: RenderEvent) -> bytes | None:
        if event.progress is not None:
            line = image_progress(translated.model, event.progress)
            return None if line is None else ndjson_line(line)
        if event.result is not None:
            return ndjson_line(image_answer(translated.model, event.result, clock.wall()))
        assert event.error is not None
        return ndjson_line(error_body(event.error.message))

    try:
        resp = await stream_render(host, runtime.id, translated.job, media_type=NDJSON, shape=shape)
    except BaseException:
        done()
        raise
    return _after_answer(resp, done)


async def _embedding(translate: Callable[[Mapping[str, Any]], EngineRequest]) -> Response:
    """``/api/embed`` and ``/api/embeddings``: like ``/v1/embeddings``, the request
    holds every slot of its engine (llama-server places embeddings itself).
    Cancellation closes the upstream request."""
    host, runtime, translated, _, clock = await _prepared(translate, owned=False)
    if translated.load_only:
        return await _load_only(host, runtime, translated)
    try:
        async with host.slot(runtime, any_slot=True):
            result = await runtime.client.forward("POST", EMBEDDINGS_PATH, body=translated.body)
    finally:
        _apply_keep_alive(host, runtime, translated.keep_alive)
    if result.head.status != 200:
        return engine_failure(result.head.status, result.content)
    data = _engine_json(result)
    current_exchange().counts = token_counts(data)
    return json_response(answer_body(translated, data, clock.wall()))


def _engine_json(result: UpstreamResult) -> dict[str, Any]:
    try:
        data = json.loads(result.content)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise EngineFailed(f"the engine's answer is not a JSON object: {result.content[:200]!r}")
    return data


@bp.post("/api/embed")
async def embed() -> Response:
    return await _embedding(embed_request)


@bp.post("/api/embeddings")
async def embeddings() -> Response:
    return await _embedding(embeddings_request)


@bp.get("/api/version")
async def version() -> Response:
    return json_response(version_body())


@bp.get("/api/tags")
async def tags() -> Response:
    """Every model clients can name, newest file first."""
    host = _host()
    facts = [await _facts(host, rt) for rt in _public_runtimes(host)]
    return json_response(tags_body(facts))


@bp.get("/api/ps")
async def ps() -> Response:
    """The models whose engines are loaded, with the memory they hold and when their
    idle TTL would release them."""
    host = _host()
    now_ns = time.time_ns()
    loaded = []
    for runtime in _public_runtimes(host):
        state = _loaded_facts(_members(host, runtime), now_ns)
        if state is not None:
            loaded.append((await _facts(host, runtime), state))
    return json_response(ps_body(loaded, now_ns=now_ns))


@bp.post("/api/show")
async def show() -> Response:
    host = _host()
    name, verbose = show_request(await read_json_object())
    runtime = _image_runtime(host, name) or _resolve(host, name)
    return json_response(show_body(await _facts(host, runtime), verbose=verbose))


async def _not_implemented(route: str) -> Response:
    # Read (and drop) the body, bounded by the body limit, so the next request on this
    # keep-alive connection is parsed, not stuck behind it.
    with trio.move_on_after(5), contextlib.suppress(Exception):
        await request.get_data(cache=False)
    return json_response(not_implemented_body(route), 501)


@bp.post("/api/pull")
async def pull() -> Response:
    return await _not_implemented("pull")


@bp.post("/api/push")
async def push() -> Response:
    return await _not_implemented("push")


@bp.post("/api/create")
async def create() -> Response:
    return await _not_implemented("create")


@bp.post("/api/copy")
async def copy() -> Response:
    return await _not_implemented("copy")


@bp.delete("/api/delete")
async def delete() -> Response:
    return await _not_implemented("delete")
