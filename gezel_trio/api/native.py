"""llama.cpp-native passthrough: /completion, /tokenize, /detokenize, /props, /slots.

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

``/completion`` is scheduled like every completion (it waits its turn and
takes a slot). The other four do not occupy a slot: they are forwarded at
once to a ready engine; when the engine is not running they go through the
scheduler, which makes it resident first.
"""

from __future__ import annotations

import json
from typing import Any

from quart import Blueprint, Response, current_app, request

from ..engine.client import UpstreamResult
from ..errors import EngineCrashed, FieldError
from ..host import Host, ModelRuntime
from .metrics_endpoint import note_model
from .relay import proxy_completion
from .validation import read_json_object

bp = Blueprint("native", __name__)

# The only fields of a slot in ``GET /slots`` a client gets; nested ``next_token``
# keeps only its counters.
PUBLIC_SLOT_FIELDS = ("id", "id_task", "n_ctx", "is_processing", "speculative")
PUBLIC_NEXT_TOKEN_FIELDS = ("has_next_token", "n_remain", "n_decoded")


def _host() -> Host:
    host: Host = current_app.config["GEZEL_HOST"]
    return host


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


async def _engine_call(
    host: Host,
    runtime: ModelRuntime,
    method: str,
    path: str,
    *,
    body: dict[str, Any] | None = None,
) -> UpstreamResult:
    """Forward one slot-free call to the model's engine.

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


def _answer(result: UpstreamResult) -> Response:
    return Response(
        result.content, status=result.head.status, content_type=result.head.content_type
    )


# ------------------------------------------------------------------ /completion


async def _completion(model: str | None) -> Response:
    host = _host()
    body = _with_prefix_model(await read_json_object(), model)
    note_model(host, body.get("model"))
    return await proxy_completion(host, body, "/completion", kind="native")


@bp.post("/completion")
async def completion() -> Response:
    return await _completion(None)


@bp.post("/upstream/<model>/completion")
async def upstream_completion(model: str) -> Response:
    return await _completion(model)


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
    note_model(host, body.get("model"))
    runtime = host.resolve_model(body.get("model"))
    if path == "/detokenize":
        runtime.check_token_ids(body.get("tokens"), "tokens")
    return _answer(await _engine_call(host, runtime, "POST", path, body=body))


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
    name = _query_model(model)
    note_model(host, name)
    runtime = host.resolve_model(name)
    result = await _engine_call(host, runtime, "GET", path)
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
