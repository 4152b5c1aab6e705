"""Who sends a request, and which of their conversations it belongs to.

Two things every route needs, in one place:

- **The caller.** :func:`install_auth` checks the API key of every request
  (``Authorization: Bearer``, or ``X-Api-Key`` as Anthropic's SDK sends it) and
  records whose key it was as the caller: the HMAC identity of the key, never the
  key itself. Without keys every request is the one local caller's.
- **The owner.** :func:`request_owner` names the chat a request continues, from
  whichever field its client uses (:data:`SESSION_HEADERS` and the body fields
  in :func:`session_name`), scoped by the caller: two keys that use one name
  get two owners, so KV never crosses callers.

Errors are shaped for the dialect of the path (see :mod:`.errors`).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
from collections.abc import Mapping
from typing import Any

from quart import Response, current_app, g, request
from quart_trio import QuartTrio
from werkzeug.datastructures import Headers

from ..host import Host
from ..host.completion import Owner
from .errors import OLLAMA_PATHS, error_response
from .exchange import Exchange, current_exchange, open_exchange
from .session_names import SessionNames

__all__ = [
    "ADMIN_ATTR",
    "CALLER_ATTR",
    "SESSION_HEADERS",
    "Owner",
    "authenticate",
    "conversation_opening",
    "install_auth",
    "request_owner",
    "session_name",
    "session_names",
]

# ``/`` is the status page's static HTML: it holds no data and asks for the
# admin key itself (a browser cannot send a bearer header when navigating).
# ``HEAD /`` is how Ollama's clients check that a server is there.
PUBLIC_PATHS = frozenset({"/health", "/"})
ADMIN_PREFIXES = ("/api/",)
CALLER_PREFIXES = ("/api/sessions",)
"""Under ``/api/`` but open to every key: each caller sees and removes its own sessions."""
# Everything else, /metrics and /openapi.json included, needs an API key when keys are set.

ADMIN_ATTR = "gezel_admin"
"""The attribute of quart's ``g`` that is True when an admin key (or no keys at all)
authenticated the request."""

CALLER_ATTR = "gezel_caller"
"""The attribute of quart's ``g`` that holds the request's caller: the HMAC identity
of the key that authenticated it (``SessionKeys.caller``), never the key itself."""

SESSION_HEADERS = (
    "X-Session-Id",
    "X-Claude-Code-Session-Id",  # Claude Code
    "session_id",  # Codex, Roo
    "conversation_id",  # Codex
    "X-OpenWebUI-Chat-Id",  # Open WebUI, with header forwarding on
    "x-litellm-session-id",  # LiteLLM
)
"""Headers that name a conversation, in the order they are read."""

MAX_SESSION_NAME = 512


NAMES_ATTR = "GEZEL_SESSION_NAMES"
"""The app's config key for its :class:`SessionNames`."""


def _presented_key(headers: Headers | Mapping[str, str]) -> str | None:
    """The key a request presents: ``Authorization: Bearer <key>``, ``X-Api-Key``, or
    HTTP Basic with the key as the password (``user:key``, the user ignored): Open
    WebUI's AUTOMATIC1111 engine sends its "API auth" setting that way."""
    auth = headers.get("Authorization") or ""
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    if auth[:6].lower() == "basic ":
        try:
            decoded = base64.b64decode(auth[6:].strip(), validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            return None
        return decoded.partition(":")[2] or decoded or None
    key = headers.get("X-Api-Key")
    return key.strip() if key else None


def _matches(candidate: str, keys: list[str]) -> bool:
    """Constant-time comparison against every key (no early exit on a match)."""
    found = False
    c = candidate.encode("utf-8", "surrogatepass")
    for key in keys:
        found |= hmac.compare_digest(c, key.encode("utf-8"))
    return found


def _is_admin_path(path: str) -> bool:
    return (
        path.startswith(ADMIN_PREFIXES)
        and not path.startswith(CALLER_PREFIXES)
        and path not in OLLAMA_PATHS
    )


def install_auth(app: QuartTrio, host: Host) -> None:
    """Check every request's key before its route runs (:func:`authenticate`), and record
    its caller; keep the names its sessions were given (:class:`SessionNames`)."""
    names = app.config[NAMES_ATTR] = SessionNames()

    @app.before_request
    async def _authenticate() -> Response | None:
        exchange = open_exchange(Exchange(host, request.path, request.headers, names))
        refused = authenticate(exchange, request.method)
        if refused is None and exchange.caller is not None:
            setattr(g, CALLER_ATTR, exchange.caller)
            setattr(g, ADMIN_ATTR, exchange.admin)
        return refused


def authenticate(exchange: Exchange, method: str) -> Response | None:
    """Check the API key of ``exchange`` (either front's) and record its caller and
    whether it is an admin in it; the refusal (401, 403) in the shape of its dialect,
    or None to go on."""
    host = exchange.host
    cfg = host.config.server
    keys = cfg.api_keys
    admin_keys = cfg.admin_keys
    if not keys and not admin_keys:
        exchange.caller = host.sessions.caller(None)
        exchange.admin = True
        return None
    path = exchange.path
    if path in PUBLIC_PATHS or method == "OPTIONS":
        return None
    token = _presented_key(exchange.headers)
    if token is None:
        return error_response(
            401,
            "missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            " (or as the password of HTTP Basic auth)",
            type_="invalid_request_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    admin_ok = _matches(token, admin_keys) if admin_keys else _matches(token, keys)
    if _is_admin_path(path):
        if not admin_ok:
            status = 403 if _matches(token, keys) else 401
            return error_response(
                status,
                "this endpoint needs an admin key" if status == 403 else "invalid API key",
                type_="invalid_request_error",
                code="insufficient_permissions" if status == 403 else "invalid_api_key",
            )
        exchange.caller = host.sessions.caller(token)
        exchange.admin = True
        return None
    if not (_matches(token, keys) or admin_ok):
        return error_response(
            401,
            "invalid API key",
            type_="invalid_request_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    exchange.caller = host.sessions.caller(token)  # the key that matched
    exchange.admin = admin_ok
    return None


def request_caller() -> str:
    """The authenticated caller of this request. Refuses (RuntimeError) when the auth
    hook did not run: never share a cache by accident."""
    caller = current_exchange().caller
    if not isinstance(caller, str):
        raise RuntimeError("no authenticated caller for this request")
    return caller


def session_name(body: Mapping[str, Any], headers: Headers | Mapping[str, str]) -> str | None:
    """The name of the conversation a request continues, from its client's own field.

    In order: ``prompt_cache_key`` (OpenAI, Codex); Anthropic's ``metadata.user_id``
    (Claude Code: ``user_<hash>_account_<id>_session_<uuid>``, or a JSON string with
    ``session_id``), read for its session part alone so one user's chats stay apart;
    then the first of :data:`SESSION_HEADERS`. None when the client sent none.
    """
    key = body.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return key[:MAX_SESSION_NAME]
    metadata = body.get("metadata")
    if isinstance(metadata, Mapping):
        from_user = _claude_code_session(metadata.get("user_id"))
        if from_user:
            return from_user[:MAX_SESSION_NAME]
    for header in SESSION_HEADERS:
        value = headers.get(header)
        if value:
            return value[:MAX_SESSION_NAME]
    return None


def _claude_code_session(user_id: object) -> str | None:
    if not isinstance(user_id, str) or not user_id:
        return None
    if user_id.startswith("{"):
        try:
            parsed = json.loads(user_id)
        except ValueError:
            return None
        found = parsed.get("session_id") if isinstance(parsed, dict) else None
        return found if isinstance(found, str) and found else None
    _, marker, session = user_id.rpartition("_session_")
    return session if marker and session else None


def request_owner(host: Host, body: Mapping[str, Any]) -> Owner:
    """The owner of this request's KV: the caller's chat that :func:`session_name`
    names, else as ``[scheduler] keyless`` says: the caller's keyless owner
    (``shared``), the conversation its opening names (``conversation``, see
    :func:`conversation_opening`), or none (``blind``). Never shared across callers."""
    exchange = current_exchange()
    name = session_name(body, exchange.headers)
    caller = request_caller()
    mode = host.config.scheduler.keyless
    opening = conversation_opening(body) if name is None and mode == "conversation" else None
    session = host.sessions.owner(caller, name, keyless=mode, opening=opening)
    if session is not None and host.kv is not None:
        host.kv.note_caller(session, caller)  # whose parked KV it will be
    if session is not None and name is not None:
        exchange.names.note(session, name)
    # A keyless conversation is parked and routed like a named chat, but shares no
    # prefix with the caller's other owners: "conversation" is the mode that narrows the
    # side channel to conversations that open alike (docs/isolation.md).
    return Owner(
        session,
        keyless=name is None and opening is None,
        caller=caller if opening is None else None,
    )


OPENING_CHARS = 256
OPENING_TOKENS = 64


def conversation_opening(body: Mapping[str, Any]) -> str | None:
    """How a keyless conversation opens, which names it in ``keyless = "conversation"``
    mode: a chat's system prompt and messages up to its first user message (every
    later turn repeats them), a Responses request's instructions and first input
    item, or the first 256 characters (64 tokens) of a prompt. None when the body has
    none of these, or a token prompt does not open with 64 ids (the request goes to the
    caller's keyless owner)."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        opening: list[Any] = [body.get("system")] if body.get("system") is not None else []
        for message in messages:
            opening.append(message)
            if isinstance(message, Mapping) and message.get("role") == "user":
                break
        return _canonical(opening)
    inp = body.get("input")
    if isinstance(inp, list) and inp:
        return _canonical([body.get("instructions"), inp[0]])
    if isinstance(inp, str) and inp:
        return _canonical([body.get("instructions"), inp])
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return _canonical(prompt[:OPENING_CHARS])
    if isinstance(prompt, list) and prompt:
        opening_ids = prompt[:OPENING_TOKENS]  # what follows does not name it: not read
        if all(isinstance(t, int) for t in opening_ids):
            return _canonical(opening_ids)
    return None


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def session_names() -> SessionNames:
    """The app's :class:`SessionNames`."""
    names: SessionNames = current_app.config[NAMES_ATTR]
    return names
