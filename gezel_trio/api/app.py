"""The Quart-Trio application factory.

The app holds a reference to the :class:`~gezel_trio.host.Host`; it runs no
components of its own (they live in ``open_host``'s nursery tree).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from ..errors import GezelError
from ..host import Host
from .auth import SESSION_HEADERS, install_auth
from .errors import (
    error_response,
    http_error_message,
    json_response,
    response_for,
    unexpected_error_response,
)

log = logging.getLogger("gezel_trio.api")


def with_cors(resp: Response, origin: str | None, allowed: Collection[str]) -> Response:
    """``resp`` with the CORS headers for ``origin`` when it is one of ``allowed``."""
    if origin and origin in allowed:
        resp.headers["Access-Control-Allow-Origin"] = origin
        resp.headers["Vary"] = "Origin"
        resp.headers["Access-Control-Allow-Headers"] = ", ".join(
            (
                "Authorization",
                "Content-Type",
                "X-Api-Key",
                "Anthropic-Version",
                *SESSION_HEADERS,
            )
        )
    return resp


def create_app(host: Host) -> QuartTrio:
    app = QuartTrio(__name__, static_folder=None)  # the status page serves its own file
    cfg = host.config.server
    app.config.update(
        GEZEL_HOST=host,
        MAX_CONTENT_LENGTH=cfg.max_body_bytes,
        RESPONSE_TIMEOUT=None,  # long prefills and long streams must not be cut
        BODY_TIMEOUT=cfg.body_timeout,
        PROVIDE_AUTOMATIC_OPTIONS=True,
        JSON_SORT_KEYS=False,
    )

    install_auth(app, host)

    @app.after_request
    async def cors(resp: Response) -> Response:
        return with_cors(resp, request.headers.get("Origin"), cfg.cors_origins)

    @app.errorhandler(GezelError)
    async def on_gezel_error(exc: GezelError) -> Response:
        return response_for(exc)

    @app.errorhandler(HTTPException)
    async def on_http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        if status in (404, 405):
            # Read (and drop) the unread body, bounded by the body limit, so the
            # next request on this keep-alive connection is parsed, not stuck
            # behind it.
            with trio.move_on_after(5), contextlib.suppress(Exception):
                await request.get_data(cache=False)
        message = http_error_message(
            status,
            request.method,
            request.path,
            exc.description or exc.name,
            max_body_bytes=cfg.max_body_bytes,
        )
        return error_response(status, message)

    @app.errorhandler(Exception)
    async def on_unexpected(exc: Exception) -> Response:
        return unexpected_error_response(exc)

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    from .admin import bp as admin_bp
    from .anthropic import bp as anthropic_bp
    from .images_edits import bp as images_edits_bp
    from .images_openai import bp as images_openai_bp
    from .metrics_endpoint import install_metrics
    from .native import bp as native_bp
    from .ollama import bp as ollama_bp
    from .openai import bp as openai_bp
    from .openapi import bp as openapi_bp
    from .responses import bp as responses_bp
    from .sdapi import bp as sdapi_bp
    from .sdcpp import bp as sdcpp_bp
    from .sessions import bp as sessions_bp
    from .status_page import bp as status_page_bp

    app.register_blueprint(openai_bp)
    app.register_blueprint(images_openai_bp)
    app.register_blueprint(native_bp)
    app.register_blueprint(responses_bp)
    app.register_blueprint(anthropic_bp)
    app.register_blueprint(ollama_bp)
    app.register_blueprint(images_edits_bp)
    app.register_blueprint(sdapi_bp)
    app.register_blueprint(sdcpp_bp)
    app.register_blueprint(admin_bp)
    app.register_blueprint(sessions_bp)
    app.register_blueprint(openapi_bp)
    app.register_blueprint(status_page_bp)
    install_metrics(app, host.metrics)
    return app
