"""The token counts an engine reports for one answer: (prompt, cached, completion).

llama-server says them in OpenAI ``usage`` (a chat's, or a Responses answer's) and
in its own ``timings``; a stream says them in its last events. :func:`token_counts`
reads one answer or event, :func:`tail_counts` the tail of a stream, and
:class:`StreamTail` keeps that tail while a stream passes; :func:`generated_in` counts
the tokens of a stream as it passes, for one cut before its counts came. No I/O here.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from .sse import data_payloads

if TYPE_CHECKING:
    from .assemble import Shape

__all__ = ["TAIL_BYTES", "Counts", "StreamTail", "generated_in", "tail_counts", "token_counts"]

Counts = tuple[int | None, int | None, int | None]
"""(prompt, cached, completion) tokens; None where the engine did not say."""

TAIL_BYTES = 32 * 1024
"""How much of a stream's end is kept to read its counts from."""


def token_counts(obj: Any) -> Counts:
    """(prompt, cached, completion) tokens from one engine answer or SSE event.

    Reads OpenAI ``usage`` (``prompt_tokens``,
    ``prompt_tokens_details.cached_tokens``, ``completion_tokens``, or the Responses
    API's ``input_tokens``, ``input_tokens_details.cached_tokens``, ``output_tokens``,
    also inside a ``response.completed`` event), then
    llama.cpp ``timings`` (``prompt_n`` + ``cache_n``, ``cache_n``,
    ``predicted_n``). Missing parts are None.
    """
    if not isinstance(obj, dict):
        return None, None, None
    if isinstance(obj.get("response"), dict):  # a Responses stream's last event
        obj = obj["response"]
    prompt = cached = completion = None
    timings = obj.get("timings") if isinstance(obj.get("timings"), dict) else {}
    assert isinstance(timings, dict)
    usage = obj.get("usage")
    if isinstance(usage, dict):
        if "input_tokens" in usage:  # the Responses API's names
            prompt = _int(usage.get("input_tokens"))
            completion = _int(usage.get("output_tokens"))
            details = usage.get("input_tokens_details")
        else:
            prompt = _int(usage.get("prompt_tokens"))
            completion = _int(usage.get("completion_tokens"))
            details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached = _int(details.get("cached_tokens"))
    t_prompt, t_cache, t_pred = (
        _int(timings.get("prompt_n")),
        _int(timings.get("cache_n")),
        _int(timings.get("predicted_n")),
    )
    if prompt is None and t_prompt is not None:
        prompt = t_prompt + (t_cache or 0)
    if cached is None:
        cached = t_cache
    if completion is None:
        completion = t_pred
    return prompt, cached, completion


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def tail_counts(tail: bytes) -> Counts:
    """Token counts from the last SSE event that carries usage or timings."""
    best: Counts = (None, None, None)
    for data in reversed(list(data_payloads(tail))):
        if not data.startswith(b"{"):
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            continue
        counts = token_counts(obj)
        if counts[0] is not None:
            if isinstance(obj.get("usage"), dict):
                return counts
            if best[0] is None:
                best = counts
    return best


class StreamTail:
    """The last :data:`TAIL_BYTES` (at least) of a stream's chunks, kept as they pass,
    and the counts they say once it ended (:meth:`counts`)."""

    __slots__ = ("_chunks", "_held")

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._held = 0

    def add(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._held += len(chunk)
        if self._held >= 2 * TAIL_BYTES and len(self._chunks) > 1:
            # drop what lies wholly before the last TAIL_BYTES, at most twice as often
            # as the tail fills up
            kept: list[bytes] = []
            held = 0
            for piece in reversed(self._chunks):
                kept.append(piece)
                held += len(piece)
                if held >= TAIL_BYTES:
                    break
            kept.reverse()
            self._chunks, self._held = kept, held

    def counts(self) -> Counts:
        return tail_counts(b"".join(self._chunks)[-TAIL_BYTES:])


_GENERATED: dict[str, tuple[tuple[bytes, bytes], ...]] = {
    "chat": (
        (b'"content":"', b'"content":""'),
        (b'"reasoning_content":"', b'"reasoning_content":""'),
        (b'"tool_calls":[', b"\x00"),
    ),
    "text": ((b'"text":"', b'"text":""'),),
    "native": ((b'"content":"', b'"content":""'),),
    "responses": ((b'.delta"', b"\x00"),),
}


def generated_in(chunk: bytes, shape: Shape) -> int:
    """The generated tokens in ``chunk``, raw bytes of an engine's SSE stream of ``shape``:
    its events that carry a piece of output (a chat delta's non-empty ``content``,
    ``reasoning_content`` or ``tool_calls``; a text choice's ``text``; a native event's
    ``content``; a Responses ``*.delta`` event). llama-server sends one such event per
    token (measured on b10435: 10 for ``max_tokens: 10``, beside a role, a finish and a
    ``[DONE]`` event). Read from the bytes, without decoding the JSON (a key and its
    opening quote cannot occur unescaped inside a JSON string); an event split across
    two chunks may go uncounted."""
    n = 0
    for marker, empty in _GENERATED[shape]:
        n += chunk.count(marker) - chunk.count(empty)
    return n
