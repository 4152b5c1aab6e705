"""``GET /``: the live status page (one static, dependency-free HTML file).

Its first paint has data: when the host has no keys (every caller may read
``/api/status``), the page is served with the host's status and recent activity
in it, as a JSON data block the page renders before its first poll. With keys
the page carries no data (``/`` is served without a key): it shows what it is
waiting for (the admin key, or the first answer) and reads ``/api/status``
every second with the admin key the operator types in (kept in the tab's
``sessionStorage`` only). Its Content-Security-Policy lets it talk to this
origin and nowhere else.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from quart import Blueprint, Response, current_app

bp = Blueprint("status_page", __name__)

CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)

INITIAL_STATE_MARK = b"<!--gezel:initial-state-->"
"""Where the page's initial state goes (a ``<script type="application/json">`` block)."""


@cache
def page_html() -> bytes:
    """The page's bytes, read once from the package."""
    return resources.files(__package__).joinpath("static/index.html").read_bytes()


def render_page(initial: dict[str, Any] | None) -> bytes:
    """The page, with ``initial`` (``{"status": ..., "activity": ...}``) as its first
    state, or none. The JSON cannot end the block early: ``<``, ``>`` and ``&`` are
    written as ``\\u`` escapes."""
    if initial is None:
        return page_html()
    data = (
        json.dumps(initial, separators=(",", ":"), default=str)
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
    )
    block = f'<script id="initial-state" type="application/json">{data}</script>'
    return page_html().replace(INITIAL_STATE_MARK, block.encode(), 1)


def initial_state() -> dict[str, Any] | None:
    """What the host would answer on ``/api/status`` and ``/api/activity`` now, when
    anyone may read them (no keys configured); None otherwise."""
    host = current_app.config.get("GEZEL_HOST")
    if host is None:
        return None
    server = host.config.server
    if server.api_keys or server.admin_keys:
        return None
    return {"status": host.status(), "activity": host.activity.snapshot().as_dict()}


@bp.get("/")
async def index() -> Response:
    return Response(
        render_page(initial_state()),
        status=200,
        content_type="text/html; charset=utf-8",
        headers={
            "Cache-Control": "no-store",
            "Content-Security-Policy": CSP,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
        },
    )
