"""The OpenAI Responses API (``POST /v1/responses``), which Codex speaks.

llama-server serves it itself, and honours ``id_slot`` and ``cache_prompt`` on
it (measured; see ``tests/test_dialects.py``), so the host forwards it as it
came, pinned to the granted slot like a chat. A non-streamed answer is
assembled from the engine's stream, whose ``response.completed`` event carries
the whole response.

The engine keeps no state between requests: ``previous_response_id`` and
``conversation`` (which ask the server to remember a conversation) are a 400
that says to send the whole conversation in ``input``, never a silent drop.
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
    if not isinstance(inp, str | list) or not inp:
        raise FieldError("input", "required: a string, or a non-empty array of input items")
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
    if limit is not None and (
        not isinstance(limit, int) or isinstance(limit, bool) or (limit < 1 and limit != -1)
    ):
        # -1: no limit, as the engine takes it (it stops when the slot is full)
        raise FieldError("max_output_tokens", "expected a positive integer (or -1: no limit)")
    key = body.get("prompt_cache_key")
    if key is not None and (not isinstance(key, str) or len(key) > 512):
        raise FieldError("prompt_cache_key", "expected a string of at most 512 characters")
    for name in ("temperature", "top_p"):
        v = body.get(name)
        if v is not None and (not isinstance(v, int | float) or isinstance(v, bool)):
            raise FieldError(name, "expected a number")


@bp.post("/v1/responses")
@bp.post("/responses")
async def create_response() -> Response:
    host = current_exchange().host
    body = await read_json_object()
    check_responses_body(body)
    owner = request_owner(host, body)
    runtime = resolve_model(host, body.get("model"), session=owner.route_session)
    upstream = Completion("/v1/responses", body, "responses", stream=body.get("stream") is True)
    shaper = PassThrough(rename_for(body, runtime))
    return await proxy_completion(host, runtime, upstream, owner=owner, shaper=shaper)
