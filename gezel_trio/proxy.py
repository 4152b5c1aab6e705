"""The upstream side: send one request to an engine with httpx, relay the answer.

Two shapes:

- :func:`forward` sends a request and returns the whole answer (non-streaming).
- :func:`relay_stream` sends a streaming request and pushes an
  :class:`UpstreamHead`, then raw body chunks, into a memory channel as they
  arrive (no buffering). Leaving it (a client disconnect cancels it) closes
  the upstream response, which makes llama-server stop generating.

Transport failures become project errors: a dead or crashed engine is
:class:`EngineCrashed` (502), silence past the read timeout is
:class:`EngineTimeout` (504). A pooled keep-alive connection that llama-server
closed on its own ("server disconnected without sending a response") is
retried once, because no byte of the request was processed; nothing else is
retried.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from .errors import EngineCrashed, EngineTimeout, GezelError

# Hop-by-hop and framing headers never relayed from the engine.
_DROP_HEADERS = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "content-encoding",
    "server",
    "date",
    "access-control-allow-origin",
    "access-control-allow-credentials",
    "access-control-allow-methods",
    "access-control-allow-headers",
}


@dataclass(frozen=True)
class UpstreamHead:
    status: int
    headers: tuple[tuple[str, str], ...]

    @property
    def content_type(self) -> str:
        for k, v in self.headers:
            if k == "content-type":
                return v
        return "application/octet-stream"


@dataclass(frozen=True)
class UpstreamResult:
    head: UpstreamHead
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)


ErrorFactory = Callable[[str], GezelError]


def _head(resp: httpx.Response) -> UpstreamHead:
    headers = tuple(
        (k.lower(), v) for k, v in resp.headers.multi_items() if k.lower() not in _DROP_HEADERS
    )
    return UpstreamHead(resp.status_code, headers)


def is_stale_connection(exc: httpx.HTTPError) -> bool:
    """llama-server closed a pooled keep-alive connection before reading the request."""
    return isinstance(exc, httpx.RemoteProtocolError) and "without sending a response" in str(exc)


async def engine_request(
    http: httpx.AsyncClient, method: str, url: str, **kwargs: Any
) -> httpx.Response:
    """One request to an engine, retried once if the pooled connection was stale.

    llama-server closes keep-alive connections on its own schedule; no byte of
    a request that meets a closed connection was processed, so that one case
    is safe to retry. Every other error propagates.
    """
    try:
        return await http.request(method, url, **kwargs)
    except httpx.HTTPError as exc:
        if not is_stale_connection(exc):
            raise
    return await http.request(method, url, **kwargs)


def _translate(exc: httpx.HTTPError, crashed: ErrorFactory, timeout_s: float | None) -> GezelError:
    if isinstance(exc, httpx.TimeoutException):
        what = f"{timeout_s:g}s" if timeout_s else "the configured time"
        return EngineTimeout(
            f"the engine sent nothing for {what} ({type(exc).__name__}); "
            "it may be hung or overloaded"
        )
    return crashed(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def _default_crashed(detail: str) -> GezelError:
    return EngineCrashed(f"the engine connection failed: {detail}")


def _timeout(read_timeout: float | None) -> httpx.Timeout:
    return httpx.Timeout(connect=10.0, read=read_timeout, write=60.0, pool=None)


async def forward(
    http: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    body: Mapping[str, Any] | None = None,
    params: Mapping[str, str] | None = None,
    read_timeout: float | None,
    crashed: ErrorFactory = _default_crashed,
) -> UpstreamResult:
    """Send one request and read the whole answer. Cancelling closes the connection."""
    for attempt in (1, 2):
        try:
            resp = await http.request(
                method, url, json=body, params=params, timeout=_timeout(read_timeout)
            )
            return UpstreamResult(_head(resp), resp.content)
        except httpx.HTTPError as exc:
            if attempt == 1 and is_stale_connection(exc):
                continue
            raise _translate(exc, crashed, read_timeout) from exc
    raise AssertionError("unreachable")  # pragma: no cover


async def relay_stream(
    http: httpx.AsyncClient,
    url: str,
    body: Mapping[str, Any],
    send: trio.MemorySendChannel[UpstreamHead | bytes],
    *,
    read_timeout: float | None,
    crashed: ErrorFactory = _default_crashed,
) -> UpstreamHead:
    """POST ``body`` with streaming on and push the head, then each chunk, into ``send``.

    Raises a project error if the engine fails before the head arrives, or
    mid-stream (after the head was sent). Cancellation (the client went away)
    closes the upstream response at once. ``send`` is not closed here.
    """
    for attempt in (1, 2):
        request = http.build_request("POST", url, json=body, timeout=_timeout(read_timeout))
        try:
            resp = await http.send(request, stream=True)
        except httpx.HTTPError as exc:
            if attempt == 1 and is_stale_connection(exc):
                continue
            raise _translate(exc, crashed, read_timeout) from exc
        break
    try:
        head = _head(resp)
        await send.send(head)
        try:
            async for chunk in resp.aiter_raw():
                await send.send(chunk)
        except httpx.HTTPError as exc:
            raise _translate(exc, crashed, read_timeout) from exc
        return head
    finally:
        with trio.move_on_after(2, shield=True):
            await resp.aclose()


def sse_error_event(error: GezelError) -> bytes:
    """An SSE event carrying an OpenAI-shaped error, sent when a stream fails midway."""
    payload = {"error": {"message": error.message, "type": error.type, "code": error.code}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
