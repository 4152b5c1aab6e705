"""llama.cpp's own routes: /completion (and /completions), /infill, rerank, /tokenize,
/detokenize, /apply-template, the input-token counts, /props, /slots.

Choose the model with a ``model`` field (the body for POST, the query string
for GET), or with a path prefix: ``/upstream/{model}/completion`` and so on.
Without either, the first configured model answers. A body whose ``model``
differs from the prefix's is a 400.

Bodies and answers pass through untouched, with two exceptions:

- ``id_slot``: slots belong to the scheduler, which pins each request to a
  slot it has checked (and erased, if another chat used it last). A client's
  ``id_slot`` is removed; the request runs on the slot the scheduler picks,
  which keeps KV affinity per ``prompt_cache_key`` (or ``X-Session-Id``).
- ``/slots`` is read-only (``GET``; the engine's save, restore and erase
  actions are refused with 405) and passes through an allow-list of fields
  (:data:`PUBLIC_SLOT_FIELDS`): a slot's id, whether it is busy, its context
  size and the token counts of its current task. Never prompts, generated
  text, sampling params, stop words, grammars or logit bias: one client must
  not read another's conversation or settings.

``/completion`` and ``/infill`` are scheduled like every completion (they wait
their turn and take a slot); rerank holds every slot of its engine, as
embeddings do. The others do not occupy a slot: they are forwarded at
once to a ready engine; when the engine is not running they go through the
scheduler, which makes it resident first.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from quart import Blueprint, Response, request

from ..engine.client import UpstreamResult
from ..errors import EngineCrashed, FieldError
from ..host import Host
from ..host.completion import Completion
from .auth import request_owner
from .exchange import current_exchange
from .metrics_endpoint import resolve_model
from .relay import PassThrough, proxy_completion, rename_for, slot_free_call, whole_engine_call
from .responses import typed_input
from .validation import check_completion_body, check_infill_body, read_json_object

bp = Blueprint("native", __name__)

# The only fields of a slot in ``GET /slots`` a client gets; nested ``next_token``
# keeps only its counters.
PUBLIC_SLOT_FIELDS = ("id", "id_task", "n_ctx", "is_processing", "speculative")
PUBLIC_NEXT_TOKEN_FIELDS = ("has_next_token", "n_remain", "n_decoded")


def _host() -> Host:
    return current_exchange().host


def _with_prefix_model(body: dict[str, Any], model: str | None) -> dict[str, Any]:
    if model is None:
        return body
    named = body.get("model")
    if named is not None and named != model:
        raise FieldError(
            "model", f"the body names {str(named)[:200]!r} but the path names {model[:200]!r}"
        )
    return {**body, "model": model}


def _query_model(model: str | None) -> str | None:
    if model is not None:
        return model
    return request.args.get("model") or None


def _answer(result: UpstreamResult) -> Response:
    return Response(
        result.content, status=result.head.status, content_type=result.head.content_type
    )


# ------------------------------------------------------------------ /completion


async def _completion(model: str | None, path: str = "/completion") -> Response:
    host = _host()
    body = _with_prefix_model(await read_json_object(), model)
    if path == "/infill":
        check_infill_body(body)
    else:
        check_completion_body(body, kind="native")
    owner = request_owner(host, body)
    runtime = resolve_model(host, body.get("model"), session=owner.route_session)
    upstream = Completion(
        path,
        body,
        "native",
        stream=body.get("stream") is True,
        keep_tokens=body.get("return_tokens") is True,
    )
    shaper = PassThrough(rename_for(body, runtime))
    return await proxy_completion(host, runtime, upstream, owner=owner, shaper=shaper)


@bp.post("/completion")
@bp.post("/completions")
async def completion() -> Response:
    return await _completion(None)


@bp.post("/upstream/<model>/completion")
async def upstream_completion(model: str) -> Response:
    return await _completion(model)


@bp.post("/infill")
async def infill() -> Response:
    """Fill-in-the-middle in llama.vscode's shape (``input_prefix``, ``input_suffix``,
    ``input_extra``, ``prompt``), pinned like every completion: the client's
    ``id_slot`` (llama.vscode hard-codes 0) is replaced by the granted slot. Its
    ``n_predict: 0`` warm-ups fill the slot's cache and generate nothing."""
    return await _completion(None, "/infill")


@bp.post("/upstream/<model>/infill")
async def upstream_infill(model: str) -> Response:
    return await _completion(model, "/infill")


# ------------------------------------------------------------------ /tokenize, /detokenize


async def _tokenize(model: str | None, path: str) -> Response:
    host = _host()
    body = _with_prefix_model(await read_json_object(), model)
    if path == "/tokenize":
        content = body.get("content")
        if not isinstance(content, str):
            raise FieldError("content", "required: the text to tokenize, as a string")
        for flag in ("add_special", "parse_special", "with_pieces"):
            if flag in body and not isinstance(body[flag], bool):
                raise FieldError(flag, "expected true or false")
    else:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
        ):
            raise FieldError("tokens", "required: an array of non-negative token ids")
    runtime = resolve_model(host, body.get("model"))
    if path == "/detokenize":
        runtime.check_token_ids(body.get("tokens"), "tokens")
    return _answer(await slot_free_call(host, runtime, "POST", path, body=body))


@bp.post("/tokenize")
async def tokenize() -> Response:
    return await _tokenize(None, "/tokenize")


@bp.post("/detokenize")
async def detokenize() -> Response:
    return await _tokenize(None, "/detokenize")


@bp.post("/upstream/<model>/tokenize")
async def upstream_tokenize(model: str) -> Response:
    return await _tokenize(model, "/tokenize")


@bp.post("/upstream/<model>/detokenize")
async def upstream_detokenize(model: str) -> Response:
    return await _tokenize(model, "/detokenize")


# ------------------------------------------------------------------ /props, /slots


async def _read_only(model: str | None, path: str) -> Response:
    host = _host()
    runtime = resolve_model(host, _query_model(model))
    result = await slot_free_call(host, runtime, "GET", path)
    if path == "/slots" and result.head.status == 200:
        return Response(_redact_slots(result.content), status=200, content_type="application/json")
    return _answer(result)


def _redact_slots(content: bytes) -> bytes:
    try:
        slots = json.loads(content)
    except ValueError as exc:
        raise EngineCrashed("the engine's /slots answer is not JSON") from exc
    public: list[dict[str, Any]] = []
    for slot in slots if isinstance(slots, list) else ():
        if not isinstance(slot, dict):
            continue
        row = {key: slot[key] for key in PUBLIC_SLOT_FIELDS if key in slot}
        nxt = slot.get("next_token")
        if isinstance(nxt, list):  # llama-server reports one entry per sequence
            row["next_token"] = [
                {k: t[k] for k in PUBLIC_NEXT_TOKEN_FIELDS if k in t}
                for t in nxt
                if isinstance(t, dict)
            ]
        elif isinstance(nxt, dict):
            row["next_token"] = {k: nxt[k] for k in PUBLIC_NEXT_TOKEN_FIELDS if k in nxt}
        public.append(row)
    return json.dumps(public, separators=(",", ":")).encode()


@bp.get("/props")
async def props() -> Response:
    return await _read_only(None, "/props")


@bp.get("/slots")
async def slots() -> Response:
    return await _read_only(None, "/slots")


@bp.get("/upstream/<model>/props")
async def upstream_props(model: str) -> Response:
    return await _read_only(model, "/props")


@bp.get("/upstream/<model>/slots")
async def upstream_slots(model: str) -> Response:
    return await _read_only(model, "/slots")


# ------------------------------------------------------------------ no slot: templates, counts


def _slot_free_body(body: dict[str, Any]) -> dict[str, Any]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise FieldError("model", "expected a string naming a model")
    return {k: v for k, v in body.items() if k != "id_slot"}


async def _slot_free(
    path: str, shape: Callable[[dict[str, Any]], dict[str, Any]] | None = None
) -> Response:
    """A call that needs the model's engine but none of its slots: the chat template
    applied, or a request's input tokens counted (its body given the dialect's
    ``shape`` first, as its completion route gives it)."""
    host = _host()
    body = _slot_free_body(await read_json_object())
    if shape is not None:
        body = shape(body)
    runtime = resolve_model(host, body.get("model"))
    return _answer(await slot_free_call(host, runtime, "POST", path, body=body))


@bp.post("/apply-template")
async def apply_template() -> Response:
    return await _slot_free("/apply-template")


@bp.post("/v1/chat/completions/input_tokens")
@bp.post("/chat/completions/input_tokens")
async def chat_input_tokens() -> Response:
    return await _slot_free("/v1/chat/completions/input_tokens")


@bp.post("/v1/responses/input_tokens")
@bp.post("/responses/input_tokens")
async def responses_input_tokens() -> Response:
    return await _slot_free("/v1/responses/input_tokens", typed_input)


# ------------------------------------------------------------------ rerank


def check_rerank_body(body: dict[str, Any]) -> None:
    """The fields of a rerank request; a failure is a 400 naming the field."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise FieldError("model", "expected a string naming a model")
    if not isinstance(body.get("query"), str):
        raise FieldError("query", "required: the text to rank the documents against")
    documents = body.get("documents", body.get("texts"))
    if not isinstance(documents, list) or not documents:
        raise FieldError("documents", "required: a non-empty array of documents")
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1):
        raise FieldError("top_n", "expected a positive integer")


@bp.post("/v1/rerank")
@bp.post("/rerank")
@bp.post("/v1/reranking")
@bp.post("/reranking")
async def rerank() -> Response:
    """Documents ranked against a query by a model whose engine runs with
    ``--reranking`` (``reranking = true``); any other model answers 400.

    Like embeddings, the engine places each document on a slot of its own
    choosing, so the request holds every slot of the engine and leaves them
    unknown (erased before a chat uses one)."""
    host = _host()
    body = await read_json_object()
    check_rerank_body(body)
    runtime = resolve_model(host, body.get("model"))
    if not runtime.config.reranking:
        raise FieldError(
            "model",
            f"the model {runtime.id!r} does not rerank "
            "(set reranking = true in the [[models]] entry of a reranker)",
        )
    return await whole_engine_call(host, runtime, request.path, body)
