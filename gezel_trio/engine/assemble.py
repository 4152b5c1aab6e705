"""Assemble a non-streaming answer from an engine's stream.

A non-streaming request is sent to the engine as a stream and put back
together here, so that a client who walks away stops generation at once:
llama-server notices a closed stream on its next write, but checks a
non-streaming request's connection only after a second with no result for
any task, which under load can be never.

Plain functions over decoded SSE events (:class:`gezel_trio.engine.sse.SseDecoder`
decodes them), no I/O. Three shapes:

- ``chat``: ``/v1/chat/completions`` chunks merge into one ``chat.completion``
  the way OpenAI documents it: per choice, ``content`` and
  ``reasoning_content`` concatenate, ``tool_calls`` merge by ``index`` (their
  ``arguments`` concatenate), ``logprobs.content`` concatenates, the last
  ``finish_reason`` wins; ``usage`` and ``timings`` come from the chunk that
  carries them (the request asks for ``include_usage``).
- ``text``: ``/v1/completions`` chunks merge into one ``text_completion``.
- ``native``: ``/completion`` and ``/infill`` events: the final event (``stop``)
  carries every field of the whole answer but ``content`` (and ``tokens`` and
  ``completion_probabilities``), which concatenate over the events.
- ``responses``: ``/v1/responses`` events: the last, ``response.completed``,
  carries the whole response (with the engine's ``timings`` beside it).
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["Shape", "StreamAssembler"]

Shape = Literal["chat", "text", "native", "responses"]


class StreamAssembler:
    """Merges the events of one stream into the answer a non-streaming request gets."""

    def __init__(self, shape: Shape, *, keep_tokens: bool = False) -> None:
        self.shape: Shape = shape
        self.keep_tokens = keep_tokens
        self.error: dict[str, Any] | None = None
        """An ``{"error": ...}`` event the engine sent instead of (or amid) the answer."""
        self._top: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}
        self._content: list[str] = []
        self._tokens: list[Any] = []
        self._probs: list[Any] = []
        self._final: dict[str, Any] | None = None

    def feed(self, event: Any) -> None:
        if not isinstance(event, dict):
            return
        if "error" in event and "choices" not in event and "content" not in event:
            self.error = event
            return
        if self.shape == "native":
            self._feed_native(event)
        elif self.shape == "responses":
            if event.get("type") == "response.completed" and isinstance(
                event.get("response"), dict
            ):
                self._final = {**event["response"], **_timings_of(event)}
        else:
            self._feed_choices(event)

    # ------------------------------------------------------------------ native

    def _feed_native(self, event: dict[str, Any]) -> None:
        content = event.get("content")
        if isinstance(content, str):
            self._content.append(content)
        tokens = event.get("tokens")
        if isinstance(tokens, list):
            self._tokens.extend(tokens)
        probs = event.get("completion_probabilities")
        if isinstance(probs, list):
            self._probs.extend(probs)
        if event.get("stop") is True:
            self._final = event

    # ------------------------------------------------------------------ chat, text

    def _feed_choices(self, event: dict[str, Any]) -> None:
        for key, value in event.items():
            if key != "choices":
                self._top[key] = value
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            merged = self._choices.setdefault(
                index if isinstance(index, int) else 0, {"index": index}
            )
            if choice.get("finish_reason") is not None:
                merged["finish_reason"] = choice["finish_reason"]
            else:
                merged.setdefault("finish_reason", None)
            if self.shape == "text":
                merged["text"] = merged.get("text", "") + str(choice.get("text") or "")
                _merge_text_logprobs(merged, choice.get("logprobs"))
            else:
                _merge_delta(merged, choice.get("delta"))
                _merge_chat_logprobs(merged, choice.get("logprobs"))

    # ------------------------------------------------------------------ result

    def result(self) -> dict[str, Any]:
        """The assembled answer (what the engine answers a non-streaming request)."""
        if self.shape == "responses":
            if self._final is None:
                return {"object": "response", "status": "incomplete", "output": []}
            return self._final
        if self.shape == "native":
            native = dict(self._final or {})
            native["content"] = "".join(self._content)
            native["tokens"] = self._tokens if self.keep_tokens else []
            if self._probs:
                native["completion_probabilities"] = self._probs
            return native
        top = dict(self._top)
        out: dict[str, Any] = {"choices": [self._choice(i) for i in sorted(self._choices)]}
        for key in ("created", "model", "system_fingerprint"):
            if key in top:
                out[key] = top.pop(key)
        out["object"] = "chat.completion" if self.shape == "chat" else "text_completion"
        top.pop("object", None)
        usage = top.pop("usage", None)
        if usage is not None:
            out["usage"] = usage
        if "id" in top:
            out["id"] = top.pop("id")
        out.update(top)  # timings and anything else the engine adds
        return out

    def _choice(self, index: int) -> dict[str, Any]:
        merged = self._choices[index]
        if self.shape == "text":
            return {
                "text": merged.get("text", ""),
                "index": merged["index"],
                "logprobs": merged.get("logprobs"),
                "finish_reason": merged.get("finish_reason"),
            }
        message: dict[str, Any] = {"role": merged.get("role", "assistant")}
        message["content"] = merged.get("content")
        if merged.get("reasoning_content") is not None:
            message["reasoning_content"] = merged["reasoning_content"]
        calls = merged.get("tool_calls")
        if calls:
            message["tool_calls"] = [calls[k] for k in sorted(calls)]
        out = {"finish_reason": merged.get("finish_reason"), "index": merged["index"]}
        out["message"] = message
        if "logprobs" in merged:
            out["logprobs"] = merged["logprobs"]
        return out


def _timings_of(event: dict[str, Any]) -> dict[str, Any]:
    timings = event.get("timings")
    return {"timings": timings} if isinstance(timings, dict) else {}


def _merge_delta(merged: dict[str, Any], delta: object) -> None:
    if not isinstance(delta, dict):
        return
    if isinstance(delta.get("role"), str):
        merged["role"] = delta["role"]
    for key in ("content", "reasoning_content"):
        piece = delta.get(key)
        if isinstance(piece, str):
            merged[key] = (merged.get(key) or "") + piece
    for call in delta.get("tool_calls") or ():
        if not isinstance(call, dict):
            continue
        calls: dict[int, dict[str, Any]] = merged.setdefault("tool_calls", {})
        index = call.get("index", len(calls))
        into = calls.setdefault(index, {"type": "function", "function": {}})
        for key in ("id", "type"):
            if call.get(key) is not None:
                into[key] = call[key]
        function = call.get("function")
        if isinstance(function, dict):
            target = into["function"]
            if function.get("name") is not None:
                target["name"] = target.get("name", "") + str(function["name"])
            if function.get("arguments") is not None:
                target["arguments"] = target.get("arguments", "") + str(function["arguments"])


def _merge_chat_logprobs(merged: dict[str, Any], logprobs: object) -> None:
    if not isinstance(logprobs, dict):
        return
    into = merged.setdefault("logprobs", {"content": []})
    for key, value in logprobs.items():
        if isinstance(value, list):
            into.setdefault(key, []).extend(value)


def _merge_text_logprobs(merged: dict[str, Any], logprobs: object) -> None:
    if not isinstance(logprobs, dict):
        merged.setdefault("logprobs", logprobs)
        return
    into = merged.get("logprobs")
    if not isinstance(into, dict):
        into = merged["logprobs"] = {}
    for key, value in logprobs.items():
        if isinstance(value, list):
            into.setdefault(key, []).extend(value)
        else:
            into[key] = value
