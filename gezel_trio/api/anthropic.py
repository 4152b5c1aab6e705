"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``,
which Claude Code speaks.

llama-server's own ``/v1/messages`` ignores ``id_slot`` and ``cache_prompt``
(measured: a request pinned to slot 1 ran where LRU put it, and a keyless one
read another's cached tokens), so the host never forwards it: each request is
translated (:mod:`.anthropic_translate`) into a chat request for the engine's
``/v1/chat/completions``, which honours both, and goes through the one
completion path like every dialect. The answer, streamed or not, is translated
back; errors, the host's own included, are in Anthropic's shape.

The conversation is named by Claude Code's ``metadata.user_id`` (its session
part) or its ``X-Claude-Code-Session-Id`` header (see :mod:`.auth`).
"""

from __future__ import annotations

import json
from typing import Any

from quart import Blueprint, Response

from ..engine.sse import SseDecoder
from ..engine.usage import token_counts
from ..errors import EngineFailed, GezelError
from ..host import Host
from ..host.completion import Completion
from .anthropic_translate import (
    MessageStream,
    chat_to_message,
    count_tokens_to_chat,
    engine_error,
    error_type_for,
    messages_to_chat,
)
from .auth import request_owner
from .errors import json_response
from .exchange import Counts, current_exchange
from .metrics_endpoint import resolve_model
from .relay import proxy_completion, requested_model, slot_free_call
from .validation import read_json_object

bp = Blueprint("anthropic", __name__)


class AnthropicShaper:
    """The engine's chat answer, streamed or not, as an Anthropic message."""

    media_type = "text/event-stream"

    def __init__(self, model: str, stop_sequences: list[str]) -> None:
        self._model = model
        self._stop_sequences = stop_sequences
        self._decoder = SseDecoder()
        self._stream = MessageStream(model, stop_sequences=stop_sequences)
        self._counts: Counts | None = None

    def answer(self, data: dict[str, Any]) -> bytes:
        message = chat_to_message(data, model=self._model, stop_sequences=self._stop_sequences)
        return json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode()

    def failure(self, status: int, content_type: str, content: bytes) -> Response:
        try:
            payload: object = json.loads(content)
        except ValueError:
            payload = {"message": content[:500].decode("utf-8", "replace"), "code": status}
        if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            payload["error"].setdefault("code", status)
        status, body = engine_error(payload)
        return json_response(body, status)

    def chunk(self, chunk: bytes) -> bytes:
        out: list[bytes] = []
        for event in self._decoder.feed(chunk):
            if isinstance(event, dict) and isinstance(event.get("usage"), dict):
                self._counts = token_counts(event)
            out.append(self._stream.feed(event))
        return b"".join(out)

    def end(self) -> bytes:
        return self._stream.finish()

    def error_event(self, error: GezelError) -> bytes:
        return self._stream.error(error_type_for(error.status), error.message)

    def waiting(self) -> bytes:
        # An SSE comment: the SDK's event accumulator refuses any event (a ping too)
        # before message_start, which needs the engine's first chunk.
        return b": waiting for a slot\n\n"

    def counts(self) -> Counts | None:
        return self._counts


def _host() -> Host:
    return current_exchange().host


@bp.post("/v1/messages")
async def messages() -> Response:
    host = _host()
    body = await read_json_object()
    chat = messages_to_chat(body)
    owner = request_owner(host, body)
    runtime = resolve_model(host, body.get("model"), session=owner.route_session)
    stream = chat["stream"] is True
    upstream = Completion("/v1/chat/completions", chat, "chat", stream=stream)
    stop_sequences = [s for s in body.get("stop_sequences") or () if isinstance(s, str)]
    shaper = AnthropicShaper(requested_model(body, runtime), stop_sequences)
    return await proxy_completion(host, runtime, upstream, owner=owner, shaper=shaper)


@bp.post("/v1/messages/count_tokens")
async def count_tokens() -> Response:
    """The input tokens of a Messages request, counted by the engine's tokenizer and chat
    template; it needs no slot."""
    host = _host()
    body = await read_json_object()
    chat = count_tokens_to_chat(body)
    runtime = resolve_model(host, body.get("model"))
    result = await slot_free_call(
        host, runtime, "POST", "/v1/chat/completions/input_tokens", body=chat
    )
    if result.head.status != 200:
        return AnthropicShaper(runtime.id, []).failure(
            result.head.status, result.head.content_type, result.content
        )
    return json_response({"input_tokens": _input_tokens(result.content)})


def _input_tokens(content: bytes) -> int:
    try:
        count = json.loads(content).get("input_tokens")
    except (ValueError, AttributeError):
        count = None
    if isinstance(count, int) and not isinstance(count, bool):
        return count
    raise EngineFailed(f"the engine's token count is not a number: {content[:200]!r}")
