"""OpenAI-compatible endpoints: chat and text completions, embeddings, models.

A completion is validated just enough to route it (``model``, ``stream``,
the session key and the fields whose types the engine would otherwise choke
on), then forwarded untouched except ``id_slot``, which belongs to the
scheduler: a client's ``id_slot`` is removed and the scheduler's pin (when it
names one) is sent instead.

Embeddings are served by models configured with ``embeddings = true`` (their
engine runs with ``--embeddings``); any other model answers 400.
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response, request

from ..engine.assemble import Shape
from ..errors import FieldError
from ..host import Host, ModelRuntime
from ..host.capabilities import model_capabilities
from ..host.completion import Completion
from .auth import request_owner
from .errors import json_response
from .exchange import current_exchange
from .metrics_endpoint import resolve_model
from .relay import PassThrough, proxy_completion, rename_for, whole_engine_call
from .validation import check_completion_body, read_json_object

bp = Blueprint("openai", __name__)


def _host() -> Host:
    return current_exchange().host


async def passthrough_completion(path: str, *, kind: str, shape: Shape) -> Response:
    """A completion in the engine's own shape, on the engine route ``path``: checked,
    its model resolved once, pinned, and answered as the engine answers (``model``
    renamed to what the client sent)."""
    host = _host()
    body = await read_json_object()
    check_completion_body(body, kind=kind)
    owner = request_owner(host, body)
    runtime = resolve_model(host, body.get("model"), session=owner.route_session)
    upstream = Completion(
        path,
        body,
        shape,
        stream=body.get("stream") is True,
        keep_tokens=body.get("return_tokens") is True,
    )
    shaper = PassThrough(rename_for(body, runtime))
    return await proxy_completion(host, runtime, upstream, owner=owner, shaper=shaper)


@bp.post("/v1/chat/completions")
@bp.post("/chat/completions")
async def chat_completions() -> Response:
    return await passthrough_completion("/v1/chat/completions", kind="chat", shape="chat")


@bp.post("/v1/completions")
async def completions() -> Response:
    return await passthrough_completion("/v1/completions", kind="text", shape="text")


def check_embeddings_body(body: dict[str, Any]) -> None:
    """Check the fields of an embeddings request; a failure is a 400 naming the field."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise FieldError("model", "expected a string naming a model")
    inp = body.get("input")
    if not _valid_embedding_input(inp):
        raise FieldError(
            "input",
            "required: a non-empty string, an array of strings, an array of token ids, "
            "or an array of token-id arrays",
        )
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ("float", "base64"):
        raise FieldError("encoding_format", "expected 'float' or 'base64'")


def _is_token(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _valid_embedding_input(inp: object) -> bool:
    if isinstance(inp, str):
        return bool(inp)
    if not isinstance(inp, list) or not inp:
        return False
    if all(isinstance(p, str) and p for p in inp):
        return True
    if all(_is_token(t) for t in inp):
        return True
    return all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in inp)


@bp.post("/v1/embeddings")
@bp.post("/embeddings")
async def embeddings() -> Response:
    """Embeddings from a model whose engine serves them (``/embeddings`` in
    llama-server's own shape, as the engine answers it).

    The engine places each input on a slot of its own choosing (llama-server
    ignores ``id_slot`` for embeddings), so the request waits until it can hold
    every slot of the engine, and leaves them all unknown (erased before the
    next chat uses one): an embedding never lands on a chat's KV, nor leaves
    its text where a chat could reuse it. Keep embedding models apart from chat
    models for throughput.
    """
    host = _host()
    body = await read_json_object()
    check_embeddings_body(body)
    runtime = resolve_model(host, body.get("model"))
    if not runtime.config.embeddings:
        raise FieldError(
            "model",
            f"the model {runtime.id!r} does not serve embeddings "
            "(set embeddings = true in its [[models]] entry)",
        )
    return await whole_engine_call(host, runtime, request.path, body)


@bp.post("/v1/audio/transcriptions")
@bp.post("/audio/transcriptions")
async def audio_transcriptions() -> Response:
    """Speech to text (multipart, OpenAI's shape) on a model with an audio projector:
    the upload goes to the engine as it came, and the engine's answer comes back as it
    is (a model without audio gets the engine's own refusal).

    The engine turns it into a chat on a slot of its own choosing (it reads no
    ``id_slot`` from a form), so the request holds every slot of the engine, as
    embeddings do, and leaves them unknown (erased before a chat uses one)."""
    host = _host()
    content_type = request.headers.get("Content-Type", "")
    if not content_type.startswith("multipart/form-data"):
        raise FieldError("file", "send the audio as multipart/form-data (file, model)")
    raw = await request.get_data(cache=True, as_text=False)
    assert isinstance(raw, bytes)
    form = await request.form
    if "file" not in await request.files:
        raise FieldError("file", "required: the audio file to transcribe")
    runtime = resolve_model(host, form.get("model") or None)
    async with host.slot(runtime, any_slot=True):
        result = await runtime.client.forward(
            "POST", "/v1/audio/transcriptions", raw=(raw, content_type)
        )
    return Response(
        result.content, status=result.head.status, content_type=result.head.content_type
    )


async def _capabilities(rt: ModelRuntime) -> list[str]:
    """What the model can do, in the names llama-server's own ``/v1/models`` and
    Ollama's ``/api/show`` use: ``completion``, ``tools`` (its chat template renders
    them: the engine's word once asked, asked here once per engine process; see
    :attr:`ModelRuntime.supports_tools`), ``embedding``; an image model: ``image``."""
    config = rt.config
    if config.kind == "image":
        return ["image"]
    embedding_only = config.embeddings or config.reranking
    if not embedding_only:
        await rt.ask_engine_tools()
    return list(
        model_capabilities(
            completion=not embedding_only,
            tools=rt.supports_tools,
            embedding=config.embeddings,
        )
    )


@bp.get("/v1/models")
@bp.get("/models")
async def list_models() -> Response:
    host = _host()
    data: list[dict[str, Any]] = []
    for public in host.public_ids():
        members = host.replica_members(public)
        rt = members[0] if members else host.models[public]
        ready = [m for m in members if m.engine.state.value.value == "ready"]
        capabilities = await _capabilities(ready[0] if ready else rt)
        data.append(
            {
                "id": public,
                "object": "model",
                "created": rt.created,
                "owned_by": "external" if rt.config.external else "gezel-trio",
                "name": rt.config.display_name,
                "state": (ready[0] if ready else rt).engine.state.value.value,
                "parallel": sum(m.slot_count for m in members) if members else rt.slot_count,
                "ctx_per_slot": rt.ctx_per_slot,
                "capabilities": capabilities,
                **({"replicas": [m.id for m in members]} if members else {}),
                # llama-server's own /v1/models carries these; clients (and the bench
                # harness) read the vocabulary and context from here.
                "meta": {
                    "n_vocab": rt.vocab_size,
                    "n_ctx": rt.ctx_per_slot,
                    "n_ctx_train": rt.gguf.context_length if rt.gguf else None,
                    "architecture": rt.gguf.architecture if rt.gguf else None,
                },
            }
        )
    return json_response({"object": "list", "data": data})


@bp.get("/v1/models/<path:model_id>")
async def get_model(model_id: str) -> Response:
    host = _host()
    members = host.replica_members(model_id)
    rt = members[0] if members else host.resolve_model(model_id, kind=None)
    return json_response(
        {
            "id": rt.config.replica_of or rt.id,
            "object": "model",
            "created": rt.created,
            "owned_by": "external" if rt.config.external else "gezel-trio",
            "state": rt.engine.state.value.value,
        }
    )
