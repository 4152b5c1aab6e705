"""The OpenAI Responses API (``POST /v1/responses``), which Codex speaks.

llama-server serves it itself, and honours ``id_slot`` and ``cache_prompt`` on
it (measured; see ``tests/test_dialects.py``), so the host forwards it as it
came, pinned to the granted slot like a chat. A non-streamed answer is
assembled from the engine's stream, whose ``response.completed`` event carries
the whole response.

The engine keeps no state between requests: ``previous_response_id`` and
``conversation`` (which ask the server to remember a conversation) are a 400
that says to send the whole conversation in ``input``, never a silent drop.

An input item with a ``role`` and no ``type`` is a message, as OpenAI reads it
(Codex-like clients send ``{"role": "assistant", "content": ...}``): the host
gives it ``"type": "message"`` before the engine, whose converter otherwise
refuses an assistant item so written (``Cannot determine type of 'item'``).
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response

from ..errors import FieldError
from ..host.completion import Completion
from .auth import request_owner
from .exchange import current_exchange
from .metrics_endpoint import resolve_model
from .relay import PassThrough, proxy_completion, rename_for
from .validation import read_json_object

bp = Blueprint("responses", __name__)

STATEFUL_FIELDS = ("previous_response_id", "conversation")


def check_responses_body(body: dict[str, Any]) -> None:
    """The fields the host reads or the engine would misread; a 400 names the field."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise FieldError("model", "expected a string naming a model")
    for name in STATEFUL_FIELDS:
        if body.get(name) not in (None, ""):
            raise FieldError(
                name,
                "this host's engines keep no responses between requests: leave it out and "
                "send the whole conversation in input (and store: false)",
            )
    inp = body.get("input")
    if not isinstance(inp, str | list):  # empty is served, as the engine serves it
        raise FieldError("input", "required: a string, or an array of input items")
    if isinstance(inp, list):
        for i, item in enumerate(inp):
            if not isinstance(item, dict):
                raise FieldError(f"input[{i}]", "expected an input item object")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise FieldError("instructions", "expected a string")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise FieldError("stream", "expected true or false")
    limit = body.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < -1):
        # 0 and -1 (no limit: it stops when the slot is full) as the engine takes them
        raise FieldError("max_output_tokens", "expected an integer >= 0 (or -1: no limit)")
    key = body.get("prompt_cache_key")
    if key is not None and (not isinstance(key, str) or len(key) > 512):
        raise FieldError("prompt_cache_key", "expected a string of at most 512 characters")
    for name in ("temperature", "top_p"):
        v = body.get(name)
        if v is not None and (not isinstance(v, int | float) or isinstance(v, bool)):
            raise FieldError(name, "expected a number")


def typed_input(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with every input item that has a ``role`` but no ``type`` marked as a
    message (OpenAI's "easy input message"); the client's own dict is left as it is."""
    inp = body.get("input")
    if not isinstance(inp, list) or not any(_untyped_message(item) for item in inp):
        return body
    items = [{**item, "type": "message"} if _untyped_message(item) else item for item in inp]
    return {**body, "input": items}


def _untyped_message(item: object) -> bool:
    return isinstance(item, dict) and "type" not in item and "role" in item


@bp.post("/v1/responses")
@bp.post("/responses")
async def create_response() -> Response:
    host = current_exchange().host
    body = await read_json_object()
    check_responses_body(body)
    body = typed_input(body)
    owner = request_owner(host, body)
    runtime = resolve_model(host, body.get("model"), session=owner.route_session)
    upstream = Completion("/v1/responses", body, "responses", stream=body.get("stream") is True)
    shaper = PassThrough(rename_for(body, runtime))
    return await proxy_completion(host, runtime, upstream, owner=owner, shaper=shaper)
