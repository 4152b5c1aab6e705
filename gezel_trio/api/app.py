"""The Quart-Trio application factory.

The app holds a reference to the :class:`~gezel_trio.host.Host`; it runs no
components of its own (they live in ``open_host``'s nursery tree).
"""

from __future__ import annotations

import contextlib
import hmac
import logging

import trio
from quart import Response, current_app, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from ..errors import GezelError
from ..host import Host
from .errors import error_response, json_response, response_for

log = logging.getLogger("gezel_trio.api")

# ``/`` is the status page's static HTML: it holds no data and asks for the
# admin key itself (a browser cannot send a bearer header when navigating).
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


def _bearer() -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    key = request.headers.get("X-Api-Key")
    return key.strip() if key else None


def request_session(name: str) -> str:
    """The session of the authenticated caller's chat ``name`` (see
    :meth:`~gezel_trio.sessions.SessionKeys.session`): two keys that use one name
    get two sessions; without keys every request is the one local caller's."""
    host: Host = current_app.config["GEZEL_HOST"]
    caller = g.get(CALLER_ATTR)
    if not isinstance(caller, str):  # the auth hook did not run: refuse, never share
        raise RuntimeError("no authenticated caller for this request")
    session = host.sessions.session(caller, name)
    if host.kv is not None:
        host.kv.note_caller(session, caller)  # whose parked KV it will be
    return session


def _matches(candidate: str, keys: list[str]) -> bool:
    """Constant-time comparison against every key (no early exit on a match)."""
    found = False
    c = candidate.encode("utf-8", "surrogatepass")
    for key in keys:
        found |= hmac.compare_digest(c, key.encode("utf-8"))
    return found


def create_app(host: Host) -> QuartTrio:
    app = QuartTrio(__name__, static_folder=None)  # the status page serves its own file
    cfg = host.config.server
    app.config.update(
        GEZEL_HOST=host,
        MAX_CONTENT_LENGTH=cfg.max_body_bytes,
        RESPONSE_TIMEOUT=None,  # long prefills and long streams must not be cut
        BODY_TIMEOUT=60,
        PROVIDE_AUTOMATIC_OPTIONS=True,
        JSON_SORT_KEYS=False,
    )

    @app.before_request
    async def authenticate() -> Response | None:
        """Check the request's key, and record whose it is (``g.gezel_caller``), which
        scopes its sessions."""
        keys = cfg.api_keys
        admin_keys = cfg.admin_keys
        if not keys and not admin_keys:
            setattr(g, CALLER_ATTR, host.sessions.caller(None))
            setattr(g, ADMIN_ATTR, True)
            return None
        if request.path in PUBLIC_PATHS or request.method == "OPTIONS":
            return None
        token = _bearer()
        is_admin_path = request.path.startswith(ADMIN_PREFIXES) and not request.path.startswith(
            CALLER_PREFIXES
        )
        if token is None:
            return error_response(
                401,
                "missing API key: send it as 'Authorization: Bearer <key>'",
                type_="invalid_request_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        admin_ok = _matches(token, admin_keys) if admin_keys else _matches(token, keys)
        if is_admin_path:
            if not admin_ok:
                status = 403 if _matches(token, keys) else 401
                return error_response(
                    status,
                    "this endpoint needs an admin key" if status == 403 else "invalid API key",
                    type_="invalid_request_error",
                    code="insufficient_permissions" if status == 403 else "invalid_api_key",
                )
            setattr(g, CALLER_ATTR, host.sessions.caller(token))
            setattr(g, ADMIN_ATTR, True)
            return None
        if not (_matches(token, keys) or admin_ok):
            return error_response(
                401,
                "invalid API key",
                type_="invalid_request_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        setattr(g, CALLER_ATTR, host.sessions.caller(token))  # the key that matched
        setattr(g, ADMIN_ATTR, admin_ok)
        return None

    @app.after_request
    async def cors(resp: Response) -> Response:
        origin = request.headers.get("Origin")
        if origin and origin in cfg.cors_origins:
            resp.headers["Access-Control-Allow-Origin"] = origin
            resp.headers["Vary"] = "Origin"
            resp.headers["Access-Control-Allow-Headers"] = (
                "Authorization, Content-Type, X-Session-Id"
            )
        return resp

    @app.errorhandler(GezelError)
    async def on_gezel_error(exc: GezelError) -> Response:
        return response_for(exc)

    @app.errorhandler(HTTPException)
    async def on_http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        messages = {
            404: f"no such endpoint: {request.method} {request.path[:200]}",
            405: f"method {request.method} is not allowed on {request.path[:200]}",
            413: f"the request body is larger than the limit of {cfg.max_body_bytes} bytes",
        }
        if status in (404, 405):
            # Read (and drop) the unread body, bounded by the body limit, so the
            # next request on this keep-alive connection is parsed, not stuck
            # behind it.
            with trio.move_on_after(5), contextlib.suppress(Exception):
                await request.get_data(cache=False)
        return error_response(status, messages.get(status, exc.description or exc.name))

    @app.errorhandler(Exception)
    async def on_unexpected(exc: Exception) -> Response:
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}", code="internal_error")

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    from .admin import bp as admin_bp
    from .metrics_endpoint import install_metrics
    from .native import bp as native_bp
    from .openai import bp as openai_bp
    from .openapi import bp as openapi_bp
    from .sessions import bp as sessions_bp
    from .status_page import bp as status_page_bp

    app.register_blueprint(openai_bp)
    app.register_blueprint(native_bp)
    app.register_blueprint(admin_bp)
    app.register_blueprint(sessions_bp)
    app.register_blueprint(openapi_bp)
    app.register_blueprint(status_page_bp)
    install_metrics(app, host.metrics)
    return app
