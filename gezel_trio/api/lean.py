"""The lean front: the hot completion routes, served without Quart's per-request machinery.

A 1-token completion costs the host about as much in Quart's per-request machinery
(request and context objects, hooks, a nursery with two tasks) as in its own work.
:class:`LeanFront` is the ASGI app hypercorn serves: a ``POST`` to one of
:data:`HOT_PATHS` runs the *same route function* Quart would run (the dialect's
parsing, the completion service, the relay), and everything else goes to the Quart
app unchanged. What Quart's hooks do for those routes is done here with the same
shared functions:

- the API key (:func:`.auth.authenticate`), refused in the dialect's shape;
- the body: the same limit (``max_body_bytes``: 413) and deadline (``body_timeout``:
  408) as Quart's, parsed by the route as before (:func:`.validation.read_json_object`);
- errors: a project error is :func:`.errors.response_for`, a bug a logged 500;
- CORS (:func:`.app.with_cors`), the request log and metrics
  (:func:`.metrics_endpoint.record_answer`), and the record of a request whose client
  left before its answer (:func:`.metrics_endpoint.record_unanswered`), here for both
  fronts;
- the walk-away: a client that disconnects cancels the request, as quart-trio does
  (the slot is released and the engine stops generating).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, HTTPScope, Scope
from quart import Response
from quart.wrappers.response import DataBody, ResponseBody
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestTimeout

from ..errors import GezelError
from ..front_guard import cancelled_when_client_leaves
from ..host import Host
from . import anthropic, native, openai, responses
from .app import with_cors
from .auth import NAMES_ATTR, authenticate
from .errors import error_response, http_error_message, response_for, unexpected_error_response
from .exchange import Exchange, LowerHeaders, open_exchange, watch_exchanges
from .metrics_endpoint import record_answer, record_unanswered

__all__ = ["HOT_PATHS", "LeanFront", "LeanStatistics"]

Route = Callable[[], Awaitable[Response]]

HOT_PATHS: dict[str, Route] = {
    "/v1/chat/completions": openai.chat_completions,
    "/chat/completions": openai.chat_completions,
    "/v1/completions": openai.completions,
    "/completion": native.completion,
    "/completions": native.completion,
    "/v1/messages": anthropic.messages,
    "/v1/responses": responses.create_response,
    "/responses": responses.create_response,
}
"""The routes the lean front serves (``POST`` only), and the Quart route each one runs."""

ASGIReceive = Callable[[], Awaitable[Any]]
ASGISend = Callable[[Any], Awaitable[None]]


class _ClientLeft(Exception):
    """The client disconnected before its request's body had arrived."""


@dataclass(frozen=True, slots=True)
class LeanStatistics:
    served: int
    """Requests the lean front answered (the rest went to Quart)."""
    walked_away: int
    """Of those, requests cancelled because their client disconnected."""


class LeanFront:
    """The ASGI app in front of ``app`` (see the module docstring)."""

    def __init__(self, app: QuartTrio, host: Host) -> None:
        self.app = app
        self.host = host
        self._names = app.config[NAMES_ATTR]
        self._metrics = app.config["GEZEL_METRICS"]
        self._served = 0
        self._walked_away = 0

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<LeanFront {len(HOT_PATHS)} routes served={s.served} walked_away={s.walked_away}>"

    def statistics(self) -> LeanStatistics:
        return LeanStatistics(served=self._served, walked_away=self._walked_away)

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            route = HOT_PATHS.get(scope["path"])
            if route is not None:
                await self._serve(route, scope, receive, send)
                return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with watch_exchanges() as opened:  # Quart opens them, in a task of its own
            try:
                await self.app(scope, receive, send)
            finally:
                for exchange in opened:
                    record_unanswered(exchange)

    async def _serve(
        self, route: Route, scope: HTTPScope, receive: ASGIReceive, send: ASGISend
    ) -> None:
        """Answer one request on a hot route. A client that disconnects cancels it (the
        route's slot and upstream request end with it); cancellation from outside (the
        server's shutdown) propagates. Either way the request is recorded."""
        self._served += 1
        headers = LowerHeaders.from_asgi(scope["headers"])
        exchange = open_exchange(Exchange(self.host, scope["path"], headers, self._names))
        exchange.traced = True
        try:
            await self._serve_exchange(route, exchange, receive, send)
        finally:
            record_unanswered(exchange)

    async def _serve_exchange(
        self, route: Route, exchange: Exchange, receive: ASGIReceive, send: ASGISend
    ) -> None:
        resp = authenticate(exchange, "POST")
        try:
            if resp is None:
                resp = await self._read_body(exchange, receive)
        except _ClientLeft:
            return
        sent = False
        watched = cancelled_when_client_leaves()
        if watched is not None:  # served by serve_front: its connection cancels the scope
            with watched:
                sent = await self._respond(route, exchange, resp, send)
        else:  # another server: a task waits for the ASGI disconnect
            async with trio.open_nursery() as nursery:
                if exchange.raw is not None:  # the whole body came: next is a disconnect
                    nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                sent = await self._respond(route, exchange, resp, send)
                nursery.cancel_scope.cancel()
        if not sent:  # the client left: its disconnect cancelled the request
            self._walked_away += 1

    async def _respond(
        self, route: Route, exchange: Exchange, resp: Response | None, send: ASGISend
    ) -> bool:
        """Answer (``resp``, or the route's) and send it; True once it is sent. A
        response that could not be sent (the client left, or a failure) has its body
        closed at once: a stream's job ends then, not at its ``stream_start_timeout``."""
        if resp is None:
            resp = await _answer(route)
        route_body = resp.response  # record_answer wraps a stream's in a generator
        try:
            cors = self.host.config.server.cors_origins
            resp = with_cors(resp, exchange.headers.get("origin"), cors)
            resp = await record_answer(exchange, resp, self._metrics)
            await _send_response(send, resp)
        except BaseException:
            # a generator that never started ignores its close: close what it wraps too
            await _close_body(resp.response)
            await _close_body(route_body)
            raise
        return True

    async def _read_body(self, exchange: Exchange, receive: ASGIReceive) -> Response | None:
        """Read the body into ``exchange.raw``; the refusal when it is over
        ``max_body_bytes`` (413) or has not all come within ``body_timeout`` (408), as
        Quart's. Raises :class:`_ClientLeft` when the client disconnected first."""
        cfg = self.host.config.server
        limit = cfg.max_body_bytes
        declared = exchange.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return _http_error(413, exchange, "")
        parts: list[bytes] = []
        size = 0
        timeout = cfg.body_timeout
        with trio.move_on_after(timeout if timeout is not None else math.inf):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _ClientLeft
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limit:
                        return _http_error(413, exchange, "")
                    parts.append(chunk)
                if not message.get("more_body", False):
                    exchange.raw = parts[0] if len(parts) == 1 else b"".join(parts)
                    return None
        return _http_error(408, exchange, RequestTimeout.description or "")


async def _cancel_on_disconnect(receive: ASGIReceive, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` once the client disconnects."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _answer(route: Route) -> Response:
    """The route's answer, or its error's, as Quart's error handlers would give it."""
    try:
        return await route()
    except GezelError as exc:
        return response_for(exc)
    except HTTPException as exc:
        status = exc.code or 500
        return error_response(status, exc.description or exc.name)
    except Exception as exc:
        return unexpected_error_response(exc)


def _http_error(status: int, exchange: Exchange, description: str) -> Response:
    max_body = exchange.host.config.server.max_body_bytes
    message = http_error_message(
        status, "POST", exchange.path, description, max_body_bytes=max_body
    )
    return error_response(status, message)


async def _close_body(body: ResponseBody) -> None:
    """Close a response's body (shielded: it ends a stream's job, and waits on nothing);
    again is a no-op."""
    if not isinstance(body, DataBody):
        with trio.CancelScope(shield=True):
            await body.__aexit__(None, None, None)  # type: ignore[arg-type]


async def _send_response(send: ASGISend, resp: Response) -> None:
    """Send ``resp`` as Quart does; a whole body goes in one message with its end."""
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.items()]
    await send({"type": "http.response.start", "status": resp.status_code, "headers": headers})
    body = resp.response
    if isinstance(body, DataBody):
        await send({"type": "http.response.body", "body": body.data, "more_body": False})
        return
    async with body as chunks:
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": bytes(chunk), "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
