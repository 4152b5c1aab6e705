"""``GET /``: the live status page (one static, dependency-free HTML file).

The page itself carries no data, so it is served without a key; it reads
``/api/status`` every second with the admin key the operator types in (kept
in the tab's ``sessionStorage`` only). Its Content-Security-Policy lets it
talk to this origin and nowhere else.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from quart import Blueprint, Response

bp = Blueprint("status_page", __name__)

CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)


@cache
def page_html() -> bytes:
    """The page's bytes, read once from the package."""
    return resources.files(__package__).joinpath("static/index.html").read_bytes()


@bp.get("/")
async def index() -> Response:
    return Response(
        page_html(),
        status=200,
        content_type="text/html; charset=utf-8",
        headers={
            "Cache-Control": "no-store",
            "Content-Security-Policy": CSP,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
        },
    )
