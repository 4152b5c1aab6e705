"""The error contract, in one place: project errors -> HTTP status, in the shape of the
dialect the client speaks (:func:`dialect_of` its path): OpenAI's
``{"error": {"message", "type", "param", "code"}}``, Anthropic's
``{"type": "error", "error": {"type", "message"}}`` under ``/v1/messages``, and
``{"error": "..."}`` on Ollama's routes and on sd-server's own (``/sdapi/``, ``/sdcpp/``).

| Case                    | Status                                 |
|-------------------------|----------------------------------------|
| Malformed JSON          | 400                                    |
| Wrong types             | 400, naming the field                  |
| Body over the limit     | 413                                    |
| Unknown model           | 404                                    |
| Model locked            | 409                                    |
| Queue full              | 503 + Retry-After                      |
| Engine failed to start  | 503, with the engine's last log lines  |
| Engine crashed mid-call | 502                                    |
| Engine silent too long  | 504                                    |
| Upstream errors         | the engine's own status and body       |
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from quart import Response, has_request_context, request

from ..errors import FieldError, GezelError, QueueFull
from .anthropic_translate import error_body as anthropic_error_body
from .exchange import exchange_or_none

log = logging.getLogger("gezel_trio.api")

Dialect = Literal["openai", "anthropic", "ollama", "sdcpp"]

ANTHROPIC_PREFIX = "/v1/messages"
SDCPP_PREFIXES = ("/sdapi/", "/sdcpp/")
"""sd-server's SD-WebUI and native routes: their errors are sd-server's ``{"error": "..."}``."""
OLLAMA_PATHS = frozenset(
    {
        "/api/version",
        "/api/tags",
        "/api/ps",
        "/api/show",
        "/api/chat",
        "/api/generate",
        "/api/embed",
        "/api/embeddings",
        "/api/pull",
        "/api/push",
        "/api/create",
        "/api/copy",
        "/api/delete",
    }
)
"""Ollama's API: under ``/api/`` like the admin routes, but model routes open to every key."""


def dialect_of(path: str) -> Dialect:
    """Which API a path belongs to, and so the shape of its errors."""
    if path.startswith(ANTHROPIC_PREFIX):
        return "anthropic"
    if path in OLLAMA_PATHS:
        return "ollama"
    if path.startswith(SDCPP_PREFIXES):
        return "sdcpp"
    return "openai"


def error_body(
    message: str, *, type_: str, code: str | int | None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def json_response(
    payload: Any, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        json.dumps(payload, separators=(",", ":")),
        status=status,
        headers=headers or {},
        content_type="application/json",
    )


def http_error_message(
    status: int, method: str, path: str, description: str, *, max_body_bytes: int
) -> str:
    """The message of an HTTP-level refusal (404, 405, 413, 408, ...), given werkzeug's
    ``description`` of ``status``; both fronts use it."""
    messages = {
        404: f"no such endpoint: {method} {path[:200]}",
        405: f"method {method} is not allowed on {path[:200]}",
        413: (
            f"the request body is larger than the limit of {max_body_bytes} bytes: "
            "send a smaller one, or raise [server] max_body_bytes"
        ),
    }
    return messages.get(status, description)


def error_response(
    status: int,
    message: str,
    *,
    type_: str | None = None,
    code: str | int | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """An error answer in the shape of the request's dialect (OpenAI's outside a request)."""
    exchange = exchange_or_none()
    if exchange is not None:
        dialect = dialect_of(exchange.path)
    else:
        dialect = dialect_of(request.path) if has_request_context() else "openai"
    payload: dict[str, Any]
    if dialect == "anthropic":
        payload = anthropic_error_body(status, message)
    elif dialect in ("ollama", "sdcpp"):
        payload = {"error": message}
    else:
        if type_ is None:
            type_ = "invalid_request_error" if status < 500 else "server_error"
        payload = error_body(message, type_=type_, code=code, param=param)
    return json_response(payload, status, headers)


def response_for(exc: GezelError) -> Response:
    """Map a project error to its response. Upstream errors keep the engine's own body."""
    headers: dict[str, str] = {}
    if isinstance(exc, QueueFull):
        headers["Retry-After"] = str(exc.retry_after)
    param = exc.param if isinstance(exc, FieldError) else None
    if exc.status >= 500:
        log.warning("request failed: %s %s", exc.status, exc.message)
    return error_response(
        exc.status, exc.message, type_=exc.type, code=exc.code, param=param, headers=headers
    )


def unexpected_error_response(exc: Exception) -> Response:
    """A bug's answer: logged with its traceback, a 500 that names only its type."""
    log.exception("unhandled error", exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}", code="internal_error")
