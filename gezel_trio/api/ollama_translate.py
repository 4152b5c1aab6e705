"""Ollama's API, translated to and from llama-server's. Plain functions, no I/O.

Apps built for Ollama speak ``/api/chat``, ``/api/generate``, ``/api/embed`` and
friends. Each request becomes an :class:`EngineRequest` for a llama-server route
that honours ``id_slot`` and ``cache_prompt`` (the caller adds those two):

============================  =========================================================
Ollama                        engine
============================  =========================================================
``/api/chat``                 ``/v1/chat/completions``
``/api/generate``             ``/v1/chat/completions`` (``system`` + ``prompt`` as chat
                              messages, the model's template applied)
``/api/generate`` ``raw``     ``/completion`` (the prompt as is)
``/api/generate`` ``suffix``  ``/infill`` (``input_prefix`` = prompt,
                              ``input_suffix`` = suffix)
``/api/embed``                ``/v1/embeddings``
``/api/embeddings``           ``/v1/embeddings``
============================  =========================================================

The field names and shapes follow Ollama's ``docs/api.md`` and ``api/types.go``
(checked at release :data:`OLLAMA_API_VERSION`), its own llama-server bridge
(``llm/llama_server.go``: the same option, ``format``, ``think`` and figure
mappings), and the official ``ollama`` Python client's pydantic types.

Request fields
--------------
- ``options``: ``num_predict`` (``max_tokens`` on the chat route, ``n_predict``
  on the native ones; a negative value means no limit and is left out),
  ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``typical_p``, ``seed``,
  ``stop``, ``repeat_penalty``, ``repeat_last_n``, ``presence_penalty``,
  ``frequency_penalty``, ``num_keep`` (``n_keep``), ``mirostat*``. ``num_ctx`` is
  returned: the host serves the slot's context whatever it asks (see
  :mod:`gezel_trio.host.limits`). Runner
  options (``num_gpu``, ``num_thread``, ``use_mmap`` ...) and unknown ones are
  ignored, as Ollama ignores unknown ones.
- ``format``: ``"json"`` -> ``response_format`` ``json_object`` (``json_schema``
  ``{"type": "object"}`` on the native routes); a JSON schema -> ``json_schema``.
- ``think``: ``true``/``false`` -> ``chat_template_kwargs.enable_thinking``; a
  level (``low``/``medium``/``high``/``max``) also sets ``reasoning_effort``
  there, as Ollama's bridge does. Ignored on the native routes (no template).
- ``tools``, assistant ``tool_calls`` (arguments as objects -> JSON strings, an id
  made up where the client sent none), ``role: "tool"`` messages (``tool_name``
  -> ``name``; ``tool_call_id`` taken from the matching call when absent),
  ``thinking`` in history -> ``reasoning_content``.
- ``images``: base64 -> an ``image_url`` data URI part (PNG, JPEG, GIF, WebP, BMP
  sniffed; anything else is sent as JPEG, as Ollama does). Refused with ``raw``
  and ``suffix``.
- ``template`` (a Go template) and a non-empty ``context`` (token ids from an
  earlier answer, which this host never hands out) are refused with 400;
  ``truncate``, ``shift``, ``logprobs``, ``top_logprobs`` are ignored.
- ``raw`` with ``system``, ``template`` or ``context``: 400, as in Ollama.
- ``keep_alive``: a number of seconds or a Go duration (``"5m"``, ``"1h30m"``,
  ``"0"``); negative keeps the model loaded (:class:`KeepAlive`).
- ``stream`` defaults to **true**.
- An empty ``messages`` (chat) or ``prompt`` (generate) asks only to load the
  model, or to unload it with ``keep_alive`` 0 (:func:`load_answer`).

Answers
-------
Every figure comes from the engine: ``prompt_eval_count`` is ``cache_n +
prompt_n`` (the whole prompt, as Ollama's bridge counts it),
``prompt_eval_duration`` is ``prompt_ms``, ``eval_count``/``eval_duration`` are
``predicted_n``/``predicted_ms`` (``usage`` or ``tokens_evaluated``/
``tokens_predicted`` when ``timings`` are missing). ``total_duration`` and
``load_duration`` are the host's own wall times (:class:`WallTimes`). Like
Ollama's ``omitempty``, a zero figure is left out. ``created_at`` is RFC 3339 in
UTC with nanoseconds. ``context`` is never sent.

Streaming is NDJSON: :class:`NdjsonStream` turns decoded engine SSE events into
lines, the last one ``done: true``. Tool calls go out whole, in one
``done: false`` line when the engine finishes (as in Ollama's docs).

Errors
------
``{"error": "..."}`` with Ollama's status codes (:func:`error_status`):

===========================================  ======
Case                                         Status
===========================================  ======
bad JSON, wrong field types (FieldError)     400
unknown model (``model 'x' not found``)      404
model locked to another                      409
queue full                                   503 (+ Retry-After)
engine failed to start / crashed / timed out 503 / 502 / 504
/api/pull, push, create, copy, delete        501 (:func:`not_implemented_body`)
===========================================  ======
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal

from ..errors import FieldError, GezelError, UnknownModel
from ..host.capabilities import (
    model_capabilities,
    template_supports_thinking,
    template_supports_tools,
)

__all__ = [
    "CHAT_PATH",
    "COMPLETION_PATH",
    "EMBEDDINGS_PATH",
    "INFILL_PATH",
    "OLLAMA_API_VERSION",
    "BadEngineAnswer",
    "EngineRequest",
    "KeepAlive",
    "LoadedFacts",
    "ModelFacts",
    "NdjsonStream",
    "WallTimes",
    "answer_body",
    "chat_answer",
    "chat_request",
    "check_against_model",
    "embed_answer",
    "embed_request",
    "embeddings_answer",
    "embeddings_request",
    "engine_error_message",
    "error_body",
    "error_status",
    "generate_answer",
    "generate_request",
    "human_parameter_count",
    "load_answer",
    "model_capabilities",
    "model_digest",
    "model_id_candidates",
    "ndjson_line",
    "not_found_message",
    "not_implemented_body",
    "ollama_name",
    "parse_keep_alive",
    "ps_body",
    "quantization_name",
    "resolve_model_name",
    "rfc3339_nano",
    "show_body",
    "show_request",
    "tags_body",
    "template_supports_thinking",
    "template_supports_tools",
    "version_body",
]

OLLAMA_API_VERSION: Final = "0.32.15"
"""The Ollama release whose API these shapes were checked against; ``/api/version``
reports it, since apps gate features (tools, structured outputs, thinking) on it."""

CHAT_PATH: Final = "/v1/chat/completions"
COMPLETION_PATH: Final = "/completion"
INFILL_PATH: Final = "/infill"
EMBEDDINGS_PATH: Final = "/v1/embeddings"

Kind = Literal["chat", "generate", "embed", "embeddings"]

_NS_PER_S: Final = 1_000_000_000
_FOREVER_NS: Final = 2**63 - 1  # Go's time.Duration(math.MaxInt64): Ollama's "forever"


# --------------------------------------------------------------------------- errors


class BadEngineAnswer(GezelError):
    """The engine's answer cannot be put in Ollama's shape (e.g. tool call arguments
    that are not a JSON object). Ollama answers 500 for the same case."""

    status = 500
    code = "bad_engine_answer"


def error_body(message: str) -> dict[str, str]:
    """Ollama's error shape."""
    return {"error": message}


def not_found_message(model: str) -> str:
    """Ollama's words for an unknown model (status 404)."""
    return f"model '{model}' not found"


def error_status(exc: GezelError, *, model: str | None = None) -> tuple[int, dict[str, str]]:
    """The status and ``{"error": ...}`` body for a project error.

    Statuses are the project's own (they match Ollama's for every shared case:
    400 bad input, 404 unknown model, 503 busy); an unknown model gets Ollama's
    message when ``model`` (the name the client sent) is given. The caller adds
    ``Retry-After`` for :class:`~gezel_trio.errors.QueueFull` as elsewhere.
    """
    if isinstance(exc, UnknownModel) and model is not None:
        return 404, error_body(not_found_message(model))
    return exc.status, error_body(exc.message)


_NOT_IMPLEMENTED_ADVICE: Final = {
    "pull": "put the model's GGUF file in the models folder ([engine] models_dir)",
    "push": "this host does not publish models",
    "create": "add a [[models]] entry to the config (its args set parameters)",
    "copy": "add another [[models]] entry pointing at the same file",
    "delete": "remove the file from the models folder, or its [[models]] entry",
}


def not_implemented_body(route: str) -> dict[str, str]:
    """The 501 body for ``/api/pull``, ``push``, ``create``, ``copy`` and ``delete``
    (``route`` is the last path segment) saying what to do instead."""
    advice = _NOT_IMPLEMENTED_ADVICE.get(route, "configure models in the config file")
    return error_body(
        f"/api/{route} is not supported: gezel-trio serves the models its config and "
        f"models folder name; {advice}"
    )


def engine_error_message(answer: object) -> str:
    """The message of an engine error body or SSE error event
    (``{"error": {"message": ...}}``, ``{"error": "..."}``)."""
    if isinstance(answer, Mapping):
        error = answer.get("error")
        if isinstance(error, Mapping) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if isinstance(answer.get("message"), str):
            return str(answer["message"])
    if isinstance(answer, bytes):
        return answer.decode("utf-8", "replace").strip() or "the engine failed"
    return "the engine failed" if answer is None else str(answer)


# --------------------------------------------------------------------------- names


def _has_tag(name: str) -> bool:
    return ":" in name.rsplit("/", 1)[-1]


def ollama_name(model_id: str) -> str:
    """The name Ollama lists for a model: ``demo`` -> ``demo:latest``."""
    return model_id if _has_tag(model_id) else f"{model_id}:latest"


def model_id_candidates(name: str) -> tuple[str, ...]:
    """The host ids a client's model name may mean, best first: the name itself,
    then without ``:latest`` (``demo:latest`` -> ``demo``). Other tags are kept:
    ``demo:7b`` naming ``demo`` could silently pick the wrong weights."""
    if name.endswith(":latest") and _has_tag(name):
        return (name, name[: -len(":latest")])
    return (name,)


def resolve_model_name(name: str, known: Collection[str]) -> str | None:
    """The first of :func:`model_id_candidates` that is a known model id, else None
    (the caller answers 404 with :func:`not_found_message`)."""
    for candidate in model_id_candidates(name):
        if candidate in known:
            return candidate
    return None


# --------------------------------------------------------------------------- keep_alive


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """How long the client wants the model kept loaded after this request.

    ``seconds`` is None for "forever" (a negative value); 0 means unload as soon
    as the request is done; otherwise the model's idle TTL from now.
    """

    seconds: float | None

    @property
    def forever(self) -> bool:
        return self.seconds is None

    @property
    def unload(self) -> bool:
        return self.seconds == 0


_DURATION_UNITS: Final = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_DURATION_PART: Final = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def _parse_go_duration(text: str) -> float:
    """Seconds in a Go duration string (``time.ParseDuration``: ``"1h30m"``,
    ``"-1s"``, ``"0"``); a bare number is taken as seconds. Raises ValueError."""
    body = text
    sign = 1.0
    if body[:1] in ("-", "+"):
        sign = -1.0 if body[0] == "-" else 1.0
        body = body[1:]
    if not body:
        raise ValueError(text)
    try:
        number = float(body)
    except ValueError:
        pass
    else:
        if math.isfinite(number):
            return sign * number
        raise ValueError(text)
    total = 0.0
    pos = 0
    while pos < len(body):
        part = _DURATION_PART.match(body, pos)
        if part is None:
            raise ValueError(text)
        total += float(part.group(1)) * _DURATION_UNITS[part.group(2)]
        pos = part.end()
    return sign * total


def parse_keep_alive(value: object, *, param: str = "keep_alive") -> KeepAlive | None:
    """``keep_alive`` as Ollama reads it; None when the client sent none (the
    model's own policy applies). Numbers are seconds, strings Go durations;
    negative means forever. Raises :class:`FieldError` naming ``param``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise FieldError(param, "expected a number of seconds or a duration such as '5m'")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise FieldError(param, "expected a finite number of seconds")
        seconds = float(value)
    elif isinstance(value, str):
        try:
            seconds = _parse_go_duration(value)
        except ValueError:
            raise FieldError(
                param,
                f"{value!r} is not a duration: use seconds or units such as '30s', '5m', "
                "'1h30m'; 0 unloads after the request, a negative value keeps the model loaded",
            ) from None
    else:
        raise FieldError(param, "expected a number of seconds or a duration such as '5m'")
    return KeepAlive(None if seconds < 0 else seconds)


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One Ollama request, translated: what to send to which engine route, and what
    the host needs to know to serve it and to shape the answer.

    ``body`` lacks ``id_slot`` and ``cache_prompt`` (the host adds them) and
    ``model`` (the host routes by ``model_id_candidates(model)``). ``stream`` is
    what the client asked (Ollama's default: true); ``body["stream"]`` says the
    same. ``load_only``: nothing to generate; answer with :func:`load_answer`
    once the model is loaded (or unloaded, when ``keep_alive.unload``).
    """

    kind: Kind
    path: str
    body: dict[str, Any] = field(repr=False)  # may carry megabytes of images
    stream: bool
    model: str
    keep_alive: KeepAlive | None = None
    num_ctx: int | None = None
    images: int = 0
    load_only: bool = False
    dimensions: int | None = None

    @property
    def model_ids(self) -> tuple[str, ...]:
        """The host ids the client's model name may mean, best first."""
        return model_id_candidates(self.model)


def check_against_model(request: EngineRequest, *, has_projector: bool) -> EngineRequest:
    """Check a request against the model that will serve it: images for a model without
    a projector are a 400 naming the field. (``options.num_ctx`` and ``num_predict``
    above the model's context are served with that context, as Ollama lowers them:
    see :mod:`gezel_trio.host.limits`.)
    """
    if request.images and not has_projector:
        raise FieldError(
            "images",
            f"the model {request.model!r} has no multimodal projector, so it cannot read "
            "images (put its mmproj*.gguf beside it, or pick a vision model)",
        )
    return request


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _as_int(value: object, param: str) -> int:
    """An integer option; an integral float is accepted (Go decodes JSON numbers as
    floats and Ollama truncates them)."""
    if _is_int(value):
        assert isinstance(value, int)
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise FieldError(param, "expected an integer")


def _as_number(value: object, param: str) -> float | int:
    if not _is_number(value):
        raise FieldError(param, "expected a finite number")
    assert isinstance(value, int | float)
    return value


def _optional_str(body: Mapping[str, Any], key: str) -> str:
    value = body.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise FieldError(key, "expected a string")
    return value


def _optional_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise FieldError(key, "expected true or false")
    return value


def _model_name(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if model is None or model == "":
        model = body.get("name")  # the deprecated spelling some clients still send
    if not isinstance(model, str) or not model:
        raise FieldError("model", "required: the name of a model (see /api/tags)")
    return model


_INT_OPTIONS: Final = {
    "seed": "seed",
    "top_k": "top_k",
    "num_keep": "n_keep",
    "repeat_last_n": "repeat_last_n",
    "mirostat": "mirostat",
}
_FLOAT_OPTIONS: Final = {
    "temperature": "temperature",
    "top_p": "top_p",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "repeat_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
}


@dataclass(frozen=True, slots=True)
class _Options:
    sampling: dict[str, Any]
    num_predict: int | None
    num_ctx: int | None

    def engine_fields(self, limit_key: str) -> dict[str, Any]:
        fields = dict(self.sampling)
        if self.num_predict is not None and self.num_predict >= 0:
            fields[limit_key] = self.num_predict
        return fields


def _options(value: object) -> _Options:
    if value is None:
        return _Options({}, None, None)
    if not isinstance(value, Mapping):
        raise FieldError("options", "expected an object of model parameters")
    sampling: dict[str, Any] = {}
    for name, key in _INT_OPTIONS.items():
        if value.get(name) is not None:
            sampling[key] = _as_int(value[name], f"options.{name}")
    for name, key in _FLOAT_OPTIONS.items():
        if value.get(name) is not None:
            sampling[key] = _as_number(value[name], f"options.{name}")
    if sampling.get("temperature", 0) < 0:
        raise FieldError("options.temperature", "expected a number >= 0")
    stop = value.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise FieldError("options.stop", "expected an array of strings")
        if stop:
            sampling["stop"] = list(stop)
    num_predict = value.get("num_predict")
    if num_predict is not None:
        num_predict = _as_int(num_predict, "options.num_predict")
    num_ctx = value.get("num_ctx")
    if num_ctx is not None:
        num_ctx = _as_int(num_ctx, "options.num_ctx")
        if num_ctx < 1:
            raise FieldError("options.num_ctx", "expected a positive number of tokens")
    return _Options(sampling, num_predict, num_ctx)


_THINK_LEVELS: Final = ("low", "medium", "high", "max")


def _think_kwargs(value: object) -> dict[str, Any] | None:
    """``think`` as llama-server's chat route understands it (the template's
    ``enable_thinking``, and ``reasoning_effort`` for a level)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return {"enable_thinking": value}
    if isinstance(value, str) and value in _THINK_LEVELS:
        return {"enable_thinking": True, "reasoning_effort": value}
    raise FieldError("think", 'expected true, false, "low", "medium", "high" or "max"')


def _chat_format(value: object) -> dict[str, Any] | None:
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, Mapping):
        return {"type": "json_schema", "json_schema": {"name": "schema", "schema": dict(value)}}
    raise FieldError("format", 'expected "json" or a JSON schema object')


def _native_format(value: object) -> dict[str, Any] | None:
    """``format`` for ``/completion`` and ``/infill``: a ``json_schema``."""
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "object"}
    if isinstance(value, Mapping):
        return dict(value)
    raise FieldError("format", 'expected "json" or a JSON schema object')


_IMAGE_MAGIC: Final = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)


def _image_mime(head: bytes) -> str:
    for magic, mime in _IMAGE_MAGIC:
        if head.startswith(magic):
            return mime
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return "image/jpeg"  # Ollama's fallback


def _image_part(value: object, param: str) -> dict[str, Any]:
    """One base64 image as an OpenAI ``image_url`` part with a data URI."""
    if not isinstance(value, str) or not value:
        raise FieldError(param, "expected a base64-encoded image")
    if value.startswith("data:image/"):
        return {"type": "image_url", "image_url": {"url": value}}
    data = "".join(value.split())
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise FieldError(param, "expected a base64-encoded image") from None
    if not raw:
        raise FieldError(param, "expected a base64-encoded image")
    url = f"data:{_image_mime(raw[:16])};base64,{data}"
    return {"type": "image_url", "image_url": {"url": url}}


def _images(value: object, param: str) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise FieldError(param, "expected an array of base64-encoded images")
    return [_image_part(image, f"{param}[{i}]") for i, image in enumerate(value)]


def _content_with_images(text: str, images: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if not images:
        return text
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    return parts + images


def _tools(value: object) -> list[Any] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise FieldError("tools", "expected an array of tool objects")
    for i, tool in enumerate(value):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("type", "function"), str):
            raise FieldError(f"tools[{i}]", "expected an object with a type")
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise FieldError(f"tools[{i}].function", "expected an object with a string name")
    return list(value) or None


_ROLES: Final = ("system", "user", "assistant", "tool")


class _ToolCallIds:
    """Ids for tool calls the client sent without one, and for the tool results
    that answer them (chat templates and llama-server pair them by id)."""

    def __init__(self) -> None:
        self._open: list[tuple[str, str]] = []  # (id, function name), not yet answered

    def call_id(self, given: object, name: str, where: str) -> str:
        call_id = given if isinstance(given, str) and given else f"call_{where}"
        self._open.append((call_id, name))
        return call_id

    def result_id(self, given: str, tool_name: str) -> str | None:
        if given:
            self._open = [(i, n) for i, n in self._open if i != given]
            return given
        if not self._open:
            return None
        match = next((k for k, (_, n) in enumerate(self._open) if n == tool_name), 0)
        return self._open.pop(match)[0]


def _tool_calls(value: object, i: int, ids: _ToolCallIds) -> list[dict[str, Any]]:
    where = f"messages[{i}]"
    if not isinstance(value, list):
        raise FieldError(f"{where}.tool_calls", "expected an array of tool calls")
    calls: list[dict[str, Any]] = []
    for j, call in enumerate(value):
        param = f"{where}.tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise FieldError(param, "expected an object with function.name")
        function = call.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise FieldError(param, "expected an object with function.name")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = {}
        if isinstance(arguments, Mapping):
            arguments = json.dumps(arguments, ensure_ascii=False)
        elif not isinstance(arguments, str):
            raise FieldError(f"{param}.function.arguments", "expected an object")
        name = function["name"]
        calls.append(
            {
                "id": ids.call_id(call.get("id"), name, f"{i}_{j}"),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return calls


def _chat_message(message: object, i: int, ids: _ToolCallIds) -> tuple[dict[str, Any], int]:
    """One Ollama message as an OpenAI one, and how many images it carries."""
    where = f"messages[{i}]"
    if not isinstance(message, Mapping):
        raise FieldError(where, "expected an object with role and content")
    role = message.get("role")
    if not isinstance(role, str) or role.lower() not in _ROLES:
        raise FieldError(f"{where}.role", "expected system, user, assistant or tool")
    role = role.lower()
    text = message.get("content")
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise FieldError(f"{where}.content", "expected a string")
    for key in ("thinking", "tool_name", "tool_call_id"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise FieldError(f"{where}.{key}", "expected a string")
    images = _images(message.get("images"), f"{where}.images")
    out: dict[str, Any] = {"role": role, "content": _content_with_images(text, images)}
    if message.get("thinking"):
        out["reasoning_content"] = message["thinking"]
    if message.get("tool_calls") is not None:
        calls = _tool_calls(message["tool_calls"], i, ids)
        if calls:
            out["tool_calls"] = calls
    if role == "tool":
        tool_name = message.get("tool_name") or ""
        if tool_name:
            out["name"] = tool_name
        call_id = ids.result_id(message.get("tool_call_id") or "", tool_name)
        if call_id is not None:
            out["tool_call_id"] = call_id
    elif message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    return out, len(images)


def _chat_messages(value: object) -> tuple[list[dict[str, Any]], int]:
    if not isinstance(value, list):
        raise FieldError("messages", "expected an array of messages")
    ids = _ToolCallIds()
    messages: list[dict[str, Any]] = []
    images = 0
    for i, message in enumerate(value):
        converted, count = _chat_message(message, i, ids)
        messages.append(converted)
        images += count
    return messages, images


def _chat_body(
    body: Mapping[str, Any],
    messages: list[dict[str, Any]],
    options: _Options,
    stream: bool,
) -> dict[str, Any]:
    engine: dict[str, Any] = {"messages": messages, "stream": stream}
    if stream:
        engine["stream_options"] = {"include_usage": True}
    engine.update(options.engine_fields("max_tokens"))
    response_format = _chat_format(body.get("format"))
    if response_format is not None:
        engine["response_format"] = response_format
    kwargs = _think_kwargs(body.get("think"))
    if kwargs is not None:
        engine["chat_template_kwargs"] = kwargs
    return engine


def chat_request(body: Mapping[str, Any]) -> EngineRequest:
    """``POST /api/chat`` -> ``/v1/chat/completions``. Raises :class:`FieldError`."""
    model = _model_name(body)
    stream = _optional_bool(body, "stream", True)
    keep_alive = parse_keep_alive(body.get("keep_alive"))
    options = _options(body.get("options"))
    raw_messages = body.get("messages")
    messages, images = _chat_messages([] if raw_messages is None else raw_messages)
    engine = _chat_body(body, messages, options, stream)
    tools = _tools(body.get("tools"))
    if tools is not None:
        engine["tools"] = tools
    return EngineRequest(
        kind="chat",
        path=CHAT_PATH,
        body=engine,
        stream=stream,
        model=model,
        keep_alive=keep_alive,
        num_ctx=options.num_ctx,
        images=images,
        load_only=not messages,
    )


def _refuse_context(value: object) -> None:
    if value is None or value == []:
        return
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise FieldError("context", "expected an array of token ids")
    raise FieldError(
        "context",
        "the deprecated context (token ids of an earlier answer) is not supported; "
        "send the conversation to /api/chat instead",
    )


def generate_request(body: Mapping[str, Any]) -> EngineRequest:
    """``POST /api/generate`` -> the chat route (``system`` and ``prompt`` as chat
    messages), ``/completion`` (``raw``) or ``/infill`` (``suffix``).
    Raises :class:`FieldError`."""
    model = _model_name(body)
    stream = _optional_bool(body, "stream", True)
    keep_alive = parse_keep_alive(body.get("keep_alive"))
    options = _options(body.get("options"))
    prompt = _optional_str(body, "prompt")
    suffix = _optional_str(body, "suffix")
    system = _optional_str(body, "system")
    raw = _optional_bool(body, "raw", False)
    if _optional_str(body, "template"):
        raise FieldError(
            "template",
            "per-request Go templates are not supported: the model's own chat template is "
            "applied; send raw: true with a prompt you formatted yourself instead",
        )
    _refuse_context(body.get("context"))
    if raw and system:
        raise FieldError("raw", "raw mode does not support template, system, or context")
    images = _images(body.get("images"), "images")
    if suffix or raw:
        if images:
            which = "suffix (fill-in-the-middle)" if suffix else "raw: true"
            raise FieldError("images", f"images cannot be sent with {which}")
        _think_kwargs(body.get("think"))  # checked, then ignored: no template applies
        path, engine = _native_body(body, options, stream, prompt=prompt, suffix=suffix)
    else:
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": _content_with_images(prompt, images)})
        path, engine = CHAT_PATH, _chat_body(body, messages, options, stream)
    return EngineRequest(
        kind="generate",
        path=path,
        body=engine,
        stream=stream,
        model=model,
        keep_alive=keep_alive,
        num_ctx=options.num_ctx,
        images=len(images),
        load_only=not prompt,
    )


def _native_body(
    body: Mapping[str, Any], options: _Options, stream: bool, *, prompt: str, suffix: str
) -> tuple[str, dict[str, Any]]:
    """The path and body for ``/infill`` (a suffix) or ``/completion`` (raw)."""
    engine: dict[str, Any] = {"stream": stream, **options.engine_fields("n_predict")}
    schema = _native_format(body.get("format"))
    if schema is not None:
        engine["json_schema"] = schema
    if suffix:
        engine.update({"input_prefix": prompt, "input_suffix": suffix, "prompt": ""})
        return INFILL_PATH, engine
    engine["prompt"] = prompt
    return COMPLETION_PATH, engine


def embed_request(body: Mapping[str, Any]) -> EngineRequest:
    """``POST /api/embed`` -> ``/v1/embeddings``. An empty input is ``load_only``
    (Ollama answers an empty list). Raises :class:`FieldError`."""
    model = _model_name(body)
    keep_alive = parse_keep_alive(body.get("keep_alive"))
    options = _options(body.get("options"))
    value = body.get("input")
    if value is None or value == "":
        inputs: list[str] = []
    elif isinstance(value, str):
        inputs = [value]
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        inputs = list(value)
    else:
        raise FieldError("input", "expected a string or an array of strings")
    _optional_bool(body, "truncate", True)
    dimensions = body.get("dimensions")
    if dimensions is not None:
        dimensions = _as_int(dimensions, "dimensions")
        if dimensions < 0:
            raise FieldError("dimensions", "expected a positive number of dimensions")
    return EngineRequest(
        kind="embed",
        path=EMBEDDINGS_PATH,
        body={"input": inputs},
        stream=False,
        model=model,
        keep_alive=keep_alive,
        num_ctx=options.num_ctx,
        load_only=not inputs,
        dimensions=dimensions or None,
    )


def embeddings_request(body: Mapping[str, Any]) -> EngineRequest:
    """``POST /api/embeddings`` (the legacy route) -> ``/v1/embeddings``. An empty
    prompt is ``load_only`` (Ollama answers an empty embedding)."""
    model = _model_name(body)
    keep_alive = parse_keep_alive(body.get("keep_alive"))
    options = _options(body.get("options"))
    prompt = _optional_str(body, "prompt")
    return EngineRequest(
        kind="embeddings",
        path=EMBEDDINGS_PATH,
        body={"input": [prompt] if prompt else []},
        stream=False,
        model=model,
        keep_alive=keep_alive,
        num_ctx=options.num_ctx,
        load_only=not prompt,
    )


def show_request(body: Mapping[str, Any]) -> tuple[str, bool]:
    """``POST /api/show``: the model name and ``verbose``."""
    return _model_name(body), _optional_bool(body, "verbose", False)


# --------------------------------------------------------------------------- answers


@functools.lru_cache(maxsize=4)
def _utc_second(seconds: int) -> str:
    """``YYYY-MM-DDTHH:MM:SS`` in UTC; cached, as a stream stamps every line within the
    same few seconds (``strftime`` was a third of the cost of a streamed line)."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def rfc3339_nano(epoch_ns: int) -> str:
    """An RFC 3339 UTC time with nanoseconds, trailing zeros trimmed (Go's
    ``time.RFC3339Nano``, what Ollama sends): ``2024-06-04T21:38:31.83753Z``."""
    seconds, nanos = divmod(epoch_ns, _NS_PER_S)
    stamp = _utc_second(seconds)
    if nanos:
        stamp += "." + f"{nanos:09d}".rstrip("0")
    return stamp + "Z"


@dataclass(frozen=True, slots=True)
class WallTimes:
    """The host's own measures of one request, in nanoseconds: ``total_ns`` from
    its arrival to the answer's end, ``load_ns`` of that spent waiting for the
    model to load (0 when it was resident)."""

    total_ns: int
    load_ns: int = 0

    @classmethod
    def since(
        cls, started_ns: int, *, loaded_ns: int | None = None, now_ns: int | None = None
    ) -> WallTimes:
        """From ``time.monotonic_ns()`` stamps: the request's arrival, and the moment
        its model was ready (None: it was ready at once)."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        load = 0 if loaded_ns is None else max(0, loaded_ns - started_ns)
        return cls(max(0, now - started_ns), load)


def _count(value: object) -> int | None:
    """A token count the engine reported (llama-server writes -1 for "none")."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _ms_to_ns(value: object) -> int | None:
    """Milliseconds (llama-server's timings) as whole nanoseconds."""
    if _is_number(value) and isinstance(value, int | float) and value >= 0:
        return round(value * 1_000_000)
    return None


class _Figures:
    """The engine's own counts and times, from whichever events carry them."""

    __slots__ = ("eval_count", "eval_ns", "prompt_count", "prompt_ns")

    def __init__(self) -> None:
        self.prompt_count: int | None = None
        self.prompt_ns: int | None = None
        self.eval_count: int | None = None
        self.eval_ns: int | None = None

    def note(self, answer: Mapping[str, Any]) -> None:
        usage = answer.get("usage")
        if isinstance(usage, Mapping):
            self.prompt_count = _count(usage.get("prompt_tokens")) or self.prompt_count
            self.eval_count = _count(usage.get("completion_tokens")) or self.eval_count
        self.prompt_count = _count(answer.get("tokens_evaluated")) or self.prompt_count
        self.eval_count = _count(answer.get("tokens_predicted")) or self.eval_count
        timings = answer.get("timings")
        if isinstance(timings, Mapping):
            prompt_n = _count(timings.get("prompt_n"))
            if prompt_n is not None:
                self.prompt_count = prompt_n + (_count(timings.get("cache_n")) or 0)
            self.eval_count = _count(timings.get("predicted_n")) or self.eval_count
            self.prompt_ns = _ms_to_ns(timings.get("prompt_ms")) or self.prompt_ns
            self.eval_ns = _ms_to_ns(timings.get("predicted_ms")) or self.eval_ns

    def metrics(self, wall: WallTimes) -> dict[str, int]:
        """Ollama's figures, zeros left out (its ``omitempty``)."""
        values = {
            "total_duration": wall.total_ns,
            "load_duration": wall.load_ns,
            "prompt_eval_count": self.prompt_count,
            "prompt_eval_duration": self.prompt_ns,
            "eval_count": self.eval_count,
            "eval_duration": self.eval_ns,
        }
        return {key: value for key, value in values.items() if value}


def _done_reason(finish_reason: object) -> str:
    """Ollama's ``done_reason`` for an OpenAI ``finish_reason`` or a native
    ``stop_type``: ``length`` for a token limit, ``stop`` otherwise."""
    return "length" if finish_reason in ("length", "limit") else "stop"


def _ollama_tool_calls(calls: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool calls (arguments as JSON strings) in Ollama's shape (objects)."""
    out: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        function = call.get("function")
        if not isinstance(function, Mapping):
            continue
        name = str(function.get("name") or "")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                arguments = None
        if not isinstance(arguments, Mapping):
            raise BadEngineAnswer(
                f"the engine returned tool call arguments for {name!r} that are not a JSON object"
            )
        converted: dict[str, Any] = {
            "function": {"index": index, "name": name, "arguments": dict(arguments)}
        }
        if isinstance(call.get("id"), str) and call["id"]:
            converted = {"id": call["id"], **converted}
        out.append(converted)
    return out


def _first_choice(answer: Mapping[str, Any]) -> Mapping[str, Any]:
    choices = answer.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        return choices[0]
    return {}


def _chat_parts(answer: Mapping[str, Any]) -> tuple[str, str, list[dict[str, Any]], str]:
    """Content, thinking, tool calls and done reason of a ``chat.completion``."""
    choice = _first_choice(answer)
    message = choice.get("message")
    message = message if isinstance(message, Mapping) else {}
    content = message.get("content") if isinstance(message.get("content"), str) else ""
    thinking = message.get("reasoning_content")
    calls = message.get("tool_calls")
    tool_calls = _ollama_tool_calls(
        c for c in (calls if isinstance(calls, list) else ()) if isinstance(c, Mapping)
    )
    return (
        str(content),
        thinking if isinstance(thinking, str) else "",
        tool_calls,
        _done_reason(choice.get("finish_reason")),
    )


def _message(content: str, thinking: str = "", tool_calls: Sequence[Any] = ()) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["thinking"] = thinking
    if tool_calls:
        message["tool_calls"] = list(tool_calls)
    return message


def _figures_of(answer: Mapping[str, Any]) -> _Figures:
    figures = _Figures()
    figures.note(answer)
    return figures


def chat_answer(
    request: EngineRequest,
    answer: Mapping[str, Any],
    wall: WallTimes,
    *,
    clock_ns: Callable[[], int] = time.time_ns,
) -> dict[str, Any]:
    """An engine ``chat.completion`` (assembled or not) as Ollama's ``/api/chat``
    answer."""
    content, thinking, tool_calls, reason = _chat_parts(answer)
    return {
        "model": request.model,
        "created_at": rfc3339_nano(clock_ns()),
        "message": _message(content, thinking, tool_calls),
        "done_reason": reason,
        "done": True,
        **_figures_of(answer).metrics(wall),
    }


def generate_answer(
    request: EngineRequest,
    answer: Mapping[str, Any],
    wall: WallTimes,
    *,
    clock_ns: Callable[[], int] = time.time_ns,
) -> dict[str, Any]:
    """An engine answer as Ollama's ``/api/generate`` one: a ``chat.completion``
    when the request went to the chat route, else a native ``/completion`` or
    ``/infill`` answer (``content``, ``stop_type``, ``timings`` ...)."""
    if request.path == CHAT_PATH:
        content, thinking, _, reason = _chat_parts(answer)
    else:
        value = answer.get("content")
        content, thinking = (value if isinstance(value, str) else ""), ""
        reason = _done_reason(answer.get("stop_type"))
    out: dict[str, Any] = {
        "model": request.model,
        "created_at": rfc3339_nano(clock_ns()),
        "response": content,
    }
    if thinking:
        out["thinking"] = thinking
    out.update(done_reason=reason, done=True, **_figures_of(answer).metrics(wall))
    return out


def _normalized(vector: Sequence[float], dimensions: int | None) -> list[float]:
    """L2-normalized (as Ollama does), cut to ``dimensions`` first if asked."""
    values = [float(v) for v in vector]
    if dimensions is not None and dimensions < len(values):
        values = values[:dimensions]
    norm = max(math.sqrt(sum(v * v for v in values)), 1e-12)
    return [v / norm for v in values]


def _embedding_vectors(answer: Mapping[str, Any]) -> list[Sequence[float]]:
    data = answer.get("data")
    if not isinstance(data, list):
        raise BadEngineAnswer("the engine's embeddings answer has no data")
    items = sorted(
        (item for item in data if isinstance(item, Mapping)),
        key=lambda item: item.get("index", 0) if _is_int(item.get("index")) else 0,
    )
    vectors: list[Sequence[float]] = []
    for item in items:
        vector = item.get("embedding")
        if not isinstance(vector, list) or not all(_is_number(v) for v in vector):
            raise BadEngineAnswer("the engine returned an embedding that is not a list of numbers")
        vectors.append(vector)
    return vectors


def embed_answer(
    request: EngineRequest, answer: Mapping[str, Any], wall: WallTimes
) -> dict[str, Any]:
    """An engine ``/v1/embeddings`` answer as Ollama's ``/api/embed`` one."""
    vectors = [_normalized(v, request.dimensions) for v in _embedding_vectors(answer)]
    figures = _figures_of(answer)
    out: dict[str, Any] = {"model": request.model, "embeddings": vectors}
    metrics = figures.metrics(wall)
    for key in ("total_duration", "load_duration", "prompt_eval_count"):
        if key in metrics:
            out[key] = metrics[key]
    return out


def embeddings_answer(answer: Mapping[str, Any]) -> dict[str, Any]:
    """An engine ``/v1/embeddings`` answer as the legacy ``/api/embeddings`` one."""
    vectors = _embedding_vectors(answer)
    return {"embedding": [float(v) for v in vectors[0]] if vectors else []}


def answer_body(
    request: EngineRequest,
    answer: Mapping[str, Any],
    wall: WallTimes,
    *,
    clock_ns: Callable[[], int] = time.time_ns,
) -> dict[str, Any]:
    """The non-streamed Ollama answer for any request kind."""
    if request.kind == "chat":
        return chat_answer(request, answer, wall, clock_ns=clock_ns)
    if request.kind == "generate":
        return generate_answer(request, answer, wall, clock_ns=clock_ns)
    if request.kind == "embed":
        return embed_answer(request, answer, wall)
    return embeddings_answer(answer)


def load_answer(
    request: EngineRequest, *, clock_ns: Callable[[], int] = time.time_ns
) -> dict[str, Any]:
    """The answer to a ``load_only`` request, once the model is loaded
    (``done_reason`` ``load``) or unloaded (``unload``, with ``keep_alive`` 0)."""
    if request.kind == "embed":
        return {"model": request.model, "embeddings": []}
    if request.kind == "embeddings":
        return {"embedding": []}
    reason = "unload" if request.keep_alive is not None and request.keep_alive.unload else "load"
    out: dict[str, Any] = {"model": request.model, "created_at": rfc3339_nano(clock_ns())}
    if request.kind == "chat":
        out["message"] = _message("")
    else:
        out["response"] = ""
    out.update(done_reason=reason, done=True)
    return out


def ndjson_line(value: Mapping[str, Any]) -> bytes:
    """One NDJSON line: compact JSON, UTF-8, ending in a newline."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


class NdjsonStream:
    """Decoded engine SSE events in, Ollama's NDJSON lines out, for one streamed
    ``/api/chat`` or ``/api/generate`` request.

    ``feed`` takes one event (the engine's chat chunks, or ``/completion`` and
    ``/infill`` events, as the request's ``path`` says) and returns zero or more
    lines; ``finish`` returns the last line (``done: true``, the reason and every
    figure) once the engine's stream has ended; ``error`` returns an
    ``{"error": ...}`` line for a failure the host meets mid-stream. After an
    error (fed or raised), ``finish`` returns nothing.
    """

    def __init__(
        self, request: EngineRequest, *, clock_ns: Callable[[], int] = time.time_ns
    ) -> None:
        if request.kind not in ("chat", "generate"):
            raise ValueError(f"no stream for {request.kind} requests")
        self.request = request
        self._clock_ns = clock_ns
        self._native = request.path != CHAT_PATH
        self._figures = _Figures()
        self._calls: dict[int, dict[str, Any]] = {}
        self._reason: str | None = None
        self.failed = False
        self.lines = 0

    def __repr__(self) -> str:
        return (
            f"<NdjsonStream {self.request.kind} {self.request.model!r} lines={self.lines} "
            f"reason={self._reason} failed={self.failed}>"
        )

    # ------------------------------------------------------------------ input

    def feed(self, event: object) -> list[bytes]:
        if self.failed or not isinstance(event, Mapping):
            return []
        if "error" in event and "choices" not in event and "content" not in event:
            return [self.error(engine_error_message(event))]
        self._figures.note(event)
        if self._native:
            return self._feed_native(event)
        return self._feed_chat(event)

    def _feed_native(self, event: Mapping[str, Any]) -> list[bytes]:
        lines = []
        content = event.get("content")
        if isinstance(content, str) and content:
            lines.append(self._line(content))
        if event.get("stop") is True:
            self._reason = _done_reason(event.get("stop_type"))
        return lines

    def _feed_chat(self, event: Mapping[str, Any]) -> list[bytes]:
        choice = _first_choice(event)
        delta = choice.get("delta")
        delta = delta if isinstance(delta, Mapping) else {}
        lines = []
        content = delta.get("content") if isinstance(delta.get("content"), str) else ""
        thinking = delta.get("reasoning_content")
        thinking = thinking if isinstance(thinking, str) else ""
        if content or thinking:
            lines.append(self._line(str(content), thinking))
        self._note_tool_calls(delta.get("tool_calls"))
        if choice.get("finish_reason") is not None:
            self._reason = _done_reason(choice["finish_reason"])
            try:
                calls = self._take_tool_calls()
            except BadEngineAnswer as exc:
                return [*lines, self.error(exc.message)]
            if calls:
                lines.append(self._line("", tool_calls=calls))
        return lines

    def _note_tool_calls(self, deltas: object) -> None:
        for call in deltas if isinstance(deltas, list) else ():
            if not isinstance(call, Mapping):
                continue
            given = call.get("index")
            index = given if isinstance(given, int) else len(self._calls)
            into = self._calls.setdefault(index, {"function": {"name": "", "arguments": ""}})
            if isinstance(call.get("id"), str):
                into["id"] = call["id"]
            function = call.get("function")
            if isinstance(function, Mapping):
                for key in ("name", "arguments"):
                    if isinstance(function.get(key), str):
                        into["function"][key] += function[key]

    def _take_tool_calls(self) -> list[dict[str, Any]]:
        calls = [self._calls[k] for k in sorted(self._calls)]
        self._calls.clear()
        return _ollama_tool_calls(calls)

    # ------------------------------------------------------------------ output

    def _head(self) -> dict[str, Any]:
        return {"model": self.request.model, "created_at": rfc3339_nano(self._clock_ns())}

    def _line(self, content: str, thinking: str = "", tool_calls: Sequence[Any] = ()) -> bytes:
        out = self._head()
        if self.request.kind == "chat":
            out["message"] = _message(content, thinking, tool_calls)
        else:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        out["done"] = False
        self.lines += 1
        return ndjson_line(out)

    def finish(self, wall: WallTimes) -> bytes:
        """The ``done: true`` line (and a line of tool calls the engine left without
        a finish reason); empty after an error."""
        if self.failed:
            return b""
        try:
            pending = self._take_tool_calls()
        except BadEngineAnswer as exc:
            return self.error(exc.message)
        first = self._line("", tool_calls=pending) if pending else b""
        out = self._head()
        if self.request.kind == "chat":
            out["message"] = _message("")
        else:
            out["response"] = ""
        out.update(done_reason=self._reason or "stop", done=True, **self._figures.metrics(wall))
        self.lines += 1
        return first + ndjson_line(out)

    def error(self, message: str) -> bytes:
        """An ``{"error": ...}`` line; the stream is over."""
        self.failed = True
        self.lines += 1
        return ndjson_line(error_body(message))


# --------------------------------------------------------------------------- listings


def model_digest(path: str, size: int, modified_ns: int) -> str:
    """A stable 64-hex digest for a model file without reading it: the SHA-256 of
    its resolved path, size and modification time (``path\\0size\\0mtime_ns``). It
    changes whenever the file is replaced, which is what clients compare it for."""
    key = f"{path}\0{size}\0{modified_ns}".encode()
    return hashlib.sha256(key).hexdigest()


def human_parameter_count(count: int | None) -> str:
    """``parameter_size`` as Ollama writes it (``format.HumanNumber``): 8030261248
    -> ``8B``, 7615616512 -> ``7.6B``, 135000000 -> ``135M``."""
    if count is None or count <= 0:
        return ""
    for scale, unit, decimals in ((1e9, "B", 1), (1e6, "M", 2)):
        if count >= scale:
            number = count / scale
            if number == math.floor(number):
                return f"{number:.0f}{unit}"
            return f"{number:.{decimals}f}{unit}"
    if count >= 1000:
        return f"{count / 1000:.0f}K"
    return str(count)


# llama_ftype by value, as Ollama's fs/ggml names them; "" for retired values.
_FILE_TYPES: Final = (
    *("F32", "F16", "Q4_0", "Q4_1", "", "", "", "Q8_0", "Q5_0", "Q5_1", "Q2_K"),
    *("Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K"),
    *("IQ2_XXS", "IQ2_XS", "Q2_K_S", "IQ3_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S"),
    *("IQ3_M", "IQ2_S", "IQ2_M", "IQ4_XS", "IQ1_M", "BF16", "", "", "", "TQ1_0", "TQ2_0"),
    *("MXFP4_MOE", "NVFP4", "Q1_0"),
)


def quantization_name(file_type: int | str | None) -> str:
    """``quantization_level`` from GGUF ``general.file_type`` (llama_ftype), as
    Ollama names it; a name is passed through, an unknown number is ``unknown``."""
    if file_type is None:
        return ""
    if isinstance(file_type, str):
        return file_type
    if 0 <= file_type < len(_FILE_TYPES) and _FILE_TYPES[file_type]:
        return _FILE_TYPES[file_type]
    return "unknown"


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the host knows about one model, for ``/api/tags``, ``/api/ps`` and
    ``/api/show``. Everything is cheap: the file's stat and GGUF header."""

    model_id: str
    size: int
    modified_ns: int
    digest: str
    architecture: str | None = None
    parameter_count: int | None = None
    file_type: int | str | None = None
    context_length: int | None = None
    """The trained context (the GGUF's, in ``model_info``)."""
    ctx_per_slot: int | None = None
    """The context a request gets: each slot's, as the engine runs it."""
    embedding_length: int | None = None
    chat_template: str | None = None
    capabilities: tuple[str, ...] = ("completion",)
    #: Default generation parameters to show (``num_ctx``, ``temperature`` ...).
    parameters: tuple[tuple[str, Any], ...] = ()
    #: Further GGUF metadata for ``model_info`` (``llama.block_count`` ...).
    metadata: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class LoadedFacts:
    """A loaded model: memory it holds (``size``, ``size_vram`` in bytes), when it
    will be unloaded if idle (epoch ns; None: never) and its context per slot."""

    size: int
    size_vram: int
    expires_ns: int | None
    context_length: int | None = None


def _details(model: ModelFacts) -> dict[str, Any]:
    family = model.architecture or ""
    return {
        "parent_model": "",
        "format": "gguf",
        "family": family,
        "families": [family] if family else [],
        "parameter_size": human_parameter_count(model.parameter_count),
        "quantization_level": quantization_name(model.file_type),
    }


def tags_body(models: Iterable[ModelFacts]) -> dict[str, Any]:
    """``GET /api/tags``: newest first, with capabilities and the context a request
    gets (each slot's, else the trained one) and the embedding length in ``details``."""
    rows = []
    for m in sorted(models, key=lambda m: -m.modified_ns):
        details = _details(m)
        if m.ctx_per_slot or m.context_length:
            details["context_length"] = m.ctx_per_slot or m.context_length
        if m.embedding_length:
            details["embedding_length"] = m.embedding_length
        rows.append(
            {
                "name": ollama_name(m.model_id),
                "model": ollama_name(m.model_id),
                "modified_at": rfc3339_nano(m.modified_ns),
                "size": m.size,
                "digest": m.digest,
                "details": details,
                "capabilities": list(m.capabilities),
            }
        )
    return {"models": rows}


def ps_body(
    loaded: Iterable[tuple[ModelFacts, LoadedFacts]], *, now_ns: int | None = None
) -> dict[str, Any]:
    """``GET /api/ps``: loaded models, the longest to live first. A model kept
    forever expires, as in Ollama, ``MaxInt64`` nanoseconds from now."""
    now = time.time_ns() if now_ns is None else now_ns
    rows = []
    for model, state in loaded:
        expires = now + _FOREVER_NS if state.expires_ns is None else state.expires_ns
        row: dict[str, Any] = {
            "name": ollama_name(model.model_id),
            "model": ollama_name(model.model_id),
            "size": state.size,
            "digest": model.digest,
            "details": _details(model),
            "expires_at": rfc3339_nano(expires),
            "size_vram": state.size_vram,
            "context_length": state.context_length or 0,
        }
        rows.append((expires, row))
    rows.sort(key=lambda item: -item[0])
    return {"models": [row for _, row in rows]}


def _parameter_value(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str) else str(value)


def _parameters_text(parameters: Iterable[tuple[str, Any]]) -> str:
    """Ollama's ``parameters``: one ``name value`` line per value, the name padded
    to 30 columns, strings quoted, list values one line each."""
    lines = []
    for name, value in parameters:
        for item in value if isinstance(value, list | tuple) else (value,):
            lines.append(f"{name:<30} {_parameter_value(item)}")
    return "\n".join(lines)


def _model_info(model: ModelFacts) -> dict[str, Any]:
    info: dict[str, Any] = {}
    arch = model.architecture
    if arch:
        info["general.architecture"] = arch
    if isinstance(model.file_type, int):
        info["general.file_type"] = model.file_type
    if model.parameter_count:
        info["general.parameter_count"] = model.parameter_count
    if arch and model.context_length:
        info[f"{arch}.context_length"] = model.context_length
    if arch and model.embedding_length:
        info[f"{arch}.embedding_length"] = model.embedding_length
    info.update(model.metadata)
    return info


def _modelfile(model: ModelFacts) -> str:
    name = ollama_name(model.model_id)
    lines = [
        '# Modelfile generated by "ollama show"',
        "# To build a new Modelfile based on this, replace FROM with:",
        f"# FROM {name}",
        "",
        f"FROM {name}",
    ]
    if model.chat_template:
        lines.append(f'TEMPLATE """{model.chat_template}"""')
    lines.extend(f"PARAMETER {line}" for line in _parameters_text(model.parameters).splitlines())
    return "\n".join(lines) + "\n"


def show_body(model: ModelFacts, *, verbose: bool = False) -> dict[str, Any]:
    """``POST /api/show``. ``template`` is the model's own (Jinja) chat template,
    not a Go template. ``verbose`` adds nothing: the host keeps no token lists."""
    del verbose
    return {
        "modelfile": _modelfile(model),
        "parameters": _parameters_text(model.parameters),
        "template": model.chat_template or "",
        "details": _details(model),
        "model_info": _model_info(model),
        "capabilities": list(model.capabilities),
        "modified_at": rfc3339_nano(model.modified_ns),
    }


def version_body(version: str = OLLAMA_API_VERSION) -> dict[str, str]:
    """``GET /api/version``."""
    return {"version": version}
