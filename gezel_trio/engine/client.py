"""``EngineClient``: the one owner of upstream HTTP to an engine.

Everything the host sends to a llama-server goes through here: control calls
(``/slots`` and its save, restore and erase actions), forwarded requests, and
streams, through :class:`EngineClient`; and the calls of those who hold only a
bare URL: health checks (:func:`check_health`: the supervisor's, the benchmark's)
and one-off requests (:func:`request_once`: calibration's co-batch probe, the
speed benchmark). Two rules live here and nowhere else:

- **One retry rule.** A request is retried once, and only when it went out on
  a *reused* keep-alive connection that the engine had closed: the connection
  failed before a single byte of a response came back. llama-server
  (cpp-httplib) closes a keep-alive connection only while it waits for the
  next request on it, never with a request half read, so none of such a
  request was processed. (Measured here: requests that meet such a connection
  usually get their bytes written into the kernel before the reset arrives,
  so "no byte written" alone would turn every one of them into a 502.) A
  fresh connection is never retried, nor is anything once the engine has
  started to answer.
- **One error map.** Transport failures become project errors: silence past
  the read timeout is :class:`EngineTimeout` (504); any other failure, a dead
  or crashed engine, is the engine's :meth:`crash_error` (502).

The client also counts what it sends (``calls`` by action, and a short ring of
recent calls), which is how tests and ``/api/status`` see the upstream calls a
request cost; ``calls["tcp_connect"]`` counts the TCP connections it opened.
llama-server closes the connection after every streamed answer (measured on b10435
whatever the request's ``Connection`` header: its chunked writer ends the response
by reporting a cancelled write), and every completion is streamed from the engine,
so each one opens a connection. A stream says so (``Connection: close``), which sends
it over a connection of its own on the transport's lean path
(:class:`~.transport.EngineTransport`), never back to the pool; control calls and
other forwarded requests reuse the pool's.
"""

from __future__ import annotations

import collections
import itertools
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import trio

from ..errors import (
    BadRequest,
    EngineCrashed,
    EngineFailed,
    EngineTimeout,
    GezelError,
    QueueFull,
)
from .transport import EngineTransport

__all__ = [
    "EngineClient",
    "EngineEndpoint",
    "HealthCheck",
    "Sink",
    "SlotShape",
    "UpstreamCall",
    "UpstreamHead",
    "UpstreamResult",
    "check_health",
    "read_slot_shape",
    "request_once",
    "sse_error_event",
]

# Hop-by-hop and framing headers never relayed from the engine.
_DROP_HEADERS = frozenset(
    {
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
)


@dataclass(frozen=True, slots=True)
class UpstreamHead:
    status: int
    headers: tuple[tuple[str, str], ...]

    @property
    def content_type(self) -> str:
        for k, v in self.headers:
            if k == "content-type":
                return v
        return "application/octet-stream"


@dataclass(frozen=True, slots=True)
class UpstreamResult:
    head: UpstreamHead
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)


@dataclass(frozen=True, slots=True)
class UpstreamCall:
    """One request sent to the engine: its order, what it was, and the slot it named."""

    seq: int
    action: str
    slot: int | None


class Sink(Protocol):
    """Where :meth:`EngineClient.stream` puts the head and then each chunk."""

    async def send(self, value: UpstreamHead | bytes, /) -> None: ...


class EngineEndpoint(Protocol):
    """Where the engine is now (it moves on every restart) and how its death reads."""

    @property
    def base_url(self) -> str | None: ...

    def crash_error(self, detail: str) -> EngineCrashed: ...


CONNECT = "tcp_connect"
"""The key of :attr:`EngineClient.calls` that counts the TCP connections opened."""


def _head(resp: httpx.Response) -> UpstreamHead:
    headers = tuple(
        (k.lower(), v) for k, v in resp.headers.multi_items() if k.lower() not in _DROP_HEADERS
    )
    return UpstreamHead(resp.status_code, headers)


class _Trace:
    """httpcore's trace events for one attempt: was the connection reused, and did any
    byte of the engine's answer arrive? ``opened`` is called when it opened a new one."""

    __slots__ = ("answered", "fresh", "opened")

    def __init__(self, opened: Callable[[], None] | None = None) -> None:
        self.fresh = False
        self.answered = False
        self.opened = opened

    async def __call__(self, name: str, info: Mapping[str, Any]) -> None:
        if name.startswith(("connection.connect_tcp", "connection.connect_unix")):
            self.fresh = True
            if self.opened is not None and name.endswith(".complete"):
                self.opened()
        elif name in (
            "http11.receive_response_headers.complete",
            "http2.receive_response_headers.complete",
        ):
            self.answered = True

    def retryable(self, exc: httpx.HTTPError) -> bool:
        """A reused connection the engine had closed: it failed, not by a timeout,
        before any byte of an answer (see the module docstring)."""
        return (
            not self.fresh
            and not self.answered
            and isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError))
        )


async def _send(
    send: Callable[[httpx.Request], Awaitable[httpx.Response]],
    request: httpx.Request,
    opened: Callable[[], None] | None = None,
) -> httpx.Response:
    """``send(request)`` under the one retry rule (see the module docstring); ``opened``
    is called for each new connection it opens."""
    for attempt in (1, 2):
        trace = _Trace(opened)
        request.extensions = {**request.extensions, "trace": trace}
        try:
            return await send(request)
        except httpx.HTTPError as exc:
            if attempt == 1 and trace.retryable(exc):
                continue
            raise
    raise AssertionError("unreachable")  # pragma: no cover


async def request_once(
    http: httpx.AsyncClient, method: str, url: str, **kwargs: Any
) -> httpx.Response:
    """One request to an engine under the one retry rule; httpx errors propagate.

    For callers that hold a bare URL (the co-batch probe, the speed benchmark,
    tools pointed at any llama-server). Cancellation closes the connection.
    """
    timeout = kwargs.pop("timeout", httpx.USE_CLIENT_DEFAULT)
    request = http.build_request(method, url, timeout=timeout, **kwargs)
    return await _send(http.send, request)


@dataclass(frozen=True, slots=True)
class HealthCheck:
    """One ``GET /health``: ``ok`` when it answered 200; ``why`` says what it answered
    (``/health answered 503``) or why nothing came (``unreachable: ConnectError: ...``)."""

    ok: bool
    why: str


async def check_health(
    http: httpx.AsyncClient, base_url: str, *, answer_within: float, path: str = "/health"
) -> HealthCheck:
    """Ask the engine at ``base_url`` once whether it is ready (``path``: another route
    that answers 200 when ready), each phase of the request bounded by
    ``answer_within``. Never raises for the engine's failure: that is the answer. Not
    retried: a failed check is what a health watch counts. For callers that hold a
    bare URL: the supervisor (before a process's URL is published, and for external
    engines) and the benchmark's launched targets. Cancellation closes the
    connection."""
    try:
        resp = await http.get(base_url + path, timeout=answer_within)
    except httpx.HTTPError as exc:
        return HealthCheck(False, f"unreachable: {type(exc).__name__}: {exc}")
    return HealthCheck(resp.status_code == 200, f"{path} answered {resp.status_code}")


@dataclass(frozen=True, slots=True)
class SlotShape:
    """What an engine runs: its slots and the context of each (``n_ctx``)."""

    slots: int
    n_ctx: int


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


async def read_slot_shape(
    http: httpx.AsyncClient, base_url: str, *, answer_within: float
) -> SlotShape | None:
    """The slots the engine at ``base_url`` runs and each one's context: ``GET /slots``
    (its rows and their ``n_ctx``, the smallest should they differ), else ``GET /props``
    (``total_slots`` and ``default_generation_settings.n_ctx``) for an engine started
    with ``--no-slots``. None when neither says. Never raises for the engine's failure.
    For the supervisor, once ``/health`` answers 200 and before the process is
    published. Cancellation closes the connection."""
    try:
        resp = await http.get(base_url + "/slots", timeout=answer_within)
        rows = resp.json() if resp.status_code == 200 else None
        if isinstance(rows, list) and rows:
            sizes = [_positive_int(r.get("n_ctx")) if isinstance(r, dict) else None for r in rows]
            if all(sizes):
                return SlotShape(len(rows), min(n for n in sizes if n))
        resp = await http.get(base_url + "/props", timeout=answer_within)
        props = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(props, dict):
        return None
    settings = props.get("default_generation_settings")
    n_ctx = _positive_int(settings.get("n_ctx")) if isinstance(settings, dict) else None
    slots = _positive_int(props.get("total_slots"))
    return SlotShape(slots, n_ctx) if slots and n_ctx else None


_CLOSE = {"Connection": "close"}


def _json_object(resp: httpx.Response) -> dict[str, Any]:
    """The answer's JSON object; {} when it is none."""
    try:
        body = resp.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _engine_message(resp: httpx.Response, answer: Mapping[str, Any]) -> str:
    """What an engine's error answer says: its ``error.message`` (or ``error`` text),
    else the start of its body."""
    error = answer.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(error, str):
        return error
    return resp.text[:300] or f"status {resp.status_code}"


def _timeout(read_timeout: float | None) -> httpx.Timeout:
    return httpx.Timeout(connect=10.0, read=read_timeout, write=60.0, pool=None)


def sse_error_event(error: GezelError) -> bytes:
    """An SSE event carrying an OpenAI-shaped error, sent when a stream fails midway."""
    payload = {"error": {"message": error.message, "type": error.type, "code": error.code}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class EngineClient:
    """Upstream HTTP to one engine (wherever it runs now). See the module docstring.

    It drives an httpx transport (the connection pool) directly: what
    ``httpx.AsyncClient`` adds on top (cookies, redirects, auth, URL merging) is
    nothing an engine needs, and cost a fifth of a millisecond per request here.
    ``read_timeout`` bounds the silence between bytes of a forwarded request or
    stream (``None``: unbounded); control calls have short fixed timeouts.
    """

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport,
        endpoint: EngineEndpoint,
        *,
        read_timeout: float | None,
        model_id: str = "",
        recent: int = 256,
    ) -> None:
        self._transport = transport
        self._endpoint = endpoint
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        self.read_timeout = read_timeout
        self.model_id = model_id
        self.calls: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[UpstreamCall] = collections.deque(maxlen=recent)
        self._seq = itertools.count(1)

    def __repr__(self) -> str:
        return f"<EngineClient {self.model_id} {self._endpoint.base_url or '-'}>"

    async def drop_idle(self) -> None:
        """Close the idle pooled connections to the engine (run before it is told to
        stop: it then exits at once; see :meth:`.EngineTransport.drop_idle`). Nothing
        to do for an engine not running or another transport."""
        base = self._endpoint.base_url
        if base is not None and isinstance(self._transport, EngineTransport):
            await self._transport.drop_idle(base)

    # ------------------------------------------------------------------ plumbing

    def _url(self, path: str) -> httpx.URL:
        base = self._endpoint.base_url
        if base is None:
            raise self._endpoint.crash_error("the engine is not running")
        url = self._urls.get((base, path))
        if url is None:
            if len(self._urls) > 64:  # the engine moved (a restart): forget old ports
                self._urls.clear()
            url = self._urls[(base, path)] = httpx.URL(base + path)
        return url

    def _request(
        self,
        method: str,
        path: str,
        *,
        timeout: httpx.Timeout,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        raw: tuple[bytes, str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Request:
        """``json`` as the body, or ``raw``: (bytes, content type) sent as they are."""
        url = self._url(path)
        if params:
            url = url.copy_merge_params(params)
        extensions = {"timeout": timeout.as_dict()}
        if raw is not None:
            content, content_type = raw
            headers = {"Content-Type": content_type}
            return httpx.Request(
                method, url, content=content, headers=headers, extensions=extensions
            )
        return httpx.Request(method, url, json=json, headers=headers, extensions=extensions)

    async def _exchange(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        """Send under the retry rule; the body is read unless ``stream``."""

        async def send(attempt: httpx.Request) -> httpx.Response:
            resp = await self._transport.handle_async_request(attempt)
            resp.request = attempt
            if not stream:
                try:
                    await resp.aread()
                finally:
                    await resp.aclose()
            return resp

        return await _send(send, request, self._opened)

    def _opened(self) -> None:
        self.calls[CONNECT] += 1

    def _note(self, action: str, slot: int | None = None) -> None:
        self.calls[action] += 1
        self.recent.append(UpstreamCall(next(self._seq), action, slot))

    def error_for(self, exc: httpx.HTTPError, timeout_s: float | None) -> GezelError:
        """The one map from an httpx failure to the project's error."""
        if isinstance(exc, httpx.TimeoutException):
            what = f"{timeout_s:g}s" if timeout_s else "the configured time"
            return EngineTimeout(
                f"the engine sent nothing for {what} ({type(exc).__name__}); "
                "it may be hung or overloaded"
            )
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return self._endpoint.crash_error(detail)

    async def _control(
        self,
        method: str,
        path: str,
        *,
        action: str,
        slot: int | None = None,
        answer_within: float,
        json: Any = None,
        params: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        request = self._request(
            method, path, timeout=httpx.Timeout(answer_within), json=json, params=params
        )
        self._note(action, slot)
        try:
            return await self._exchange(request)
        except httpx.HTTPError as exc:
            raise self.error_for(exc, answer_within) from exc

    # ------------------------------------------------------------------ control calls

    async def slots(self, *, answer_within: float = 2.0) -> list[Any] | None:
        """``GET /slots``: the engine's slot rows, or ``None`` when it answers
        something other than a JSON list. Raises a project error on failure."""
        resp = await self._control("GET", "/slots", action="slots", answer_within=answer_within)
        if resp.status_code != 200:
            return None
        try:
            rows = resp.json()
        except ValueError:
            return None
        return rows if isinstance(rows, list) else None

    async def props(self, *, answer_within: float = 5.0) -> dict[str, Any] | None:
        """``GET /props``: the engine's properties (its chat template and what the
        engine found it can render, ``chat_template_caps``), or ``None`` when it answers
        something other than a JSON object. Raises a project error on failure."""
        resp = await self._control("GET", "/props", action="props", answer_within=answer_within)
        if resp.status_code != 200:
            return None
        try:
            body = resp.json()
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    async def slot_action(
        self,
        slot: int,
        action: str,
        *,
        filename: str | None = None,
        answer_within: float = 30.0,
    ) -> dict[str, Any]:
        """``POST /slots/{slot}?action=erase|save|restore``; the engine's answer.

        Returns once the engine acknowledged (200). Raises EngineFailed naming the
        slot and status otherwise, or a project error on a transport failure.
        Cancellation closes the connection; the engine may still carry it out.
        """

        resp = await self._control(
            "POST",
            f"/slots/{slot}",
            action=action,
            slot=slot,
            answer_within=answer_within,
            params={"action": action},
            json=None if filename is None else {"filename": filename},
        )
        if resp.status_code != 200:
            raise EngineFailed(
                f"{action} of slot {slot} answered {resp.status_code}: {resp.text[:200]}"
            )
        try:
            body = resp.json()
        except ValueError:
            body = {}
        return body if isinstance(body, dict) else {}

    # ------------------------------------------------------------------ image jobs

    async def image_submit(
        self, kind: str, body: Mapping[str, Any], *, answer_within: float = 30.0
    ) -> str:
        """``POST /sdcpp/v1/{kind}`` (``img_gen``, ``vid_gen``): sd-server's job id.

        sd-server's 400 (a body it refuses) is a :class:`BadRequest` carrying its
        message; 429 (its queue is full) :class:`QueueFull`; anything else but 202
        EngineFailed. Cancellation closes the connection: a job it created meanwhile is
        not known to the caller (it runs; the caller stops the engine when that matters).
        """
        resp = await self._control(
            "POST", f"/sdcpp/v1/{kind}", action=kind, answer_within=answer_within, json=body
        )
        answer = _json_object(resp)
        if resp.status_code == 202 and isinstance(answer.get("id"), str):
            job_id: str = answer["id"]
            return job_id
        message = _engine_message(resp, answer)
        if resp.status_code == 400:
            raise BadRequest(f"the image engine refused the request: {message}")
        if resp.status_code == 429:
            raise QueueFull(f"the image engine's queue is full: {message}")
        raise EngineFailed(f"the image engine answered {resp.status_code} to {kind}: {message}")

    async def image_job(self, job_id: str, *, answer_within: float = 10.0) -> dict[str, Any]:
        """``GET /sdcpp/v1/jobs/{id}``: the job's state as sd-server reports it (``status``,
        ``result``, ``error``). EngineFailed when it does not know the job (404, 410:
        a restart lost it). Cancellation closes the connection."""
        resp = await self._control(
            "GET", f"/sdcpp/v1/jobs/{job_id}", action="job", answer_within=answer_within
        )
        answer = _json_object(resp)
        if resp.status_code != 200 or not isinstance(answer.get("status"), str):
            raise EngineFailed(
                f"the image engine lost job {job_id} ({resp.status_code}: "
                f"{_engine_message(resp, answer)})"
            )
        return answer

    async def image_cancel(self, job_id: str, *, answer_within: float = 2.0) -> bool:
        """``POST /sdcpp/v1/jobs/{id}/cancel``: whether sd-server cancelled it (a queued
        job; one that is generating answers 409 and runs on). Cancellation closes the
        connection."""
        resp = await self._control(
            "POST",
            f"/sdcpp/v1/jobs/{job_id}/cancel",
            action="job_cancel",
            answer_within=answer_within,
        )
        return resp.status_code == 200

    # ------------------------------------------------------------------ requests

    async def forward(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
        slot: int | None = None,
        raw: tuple[bytes, str] | None = None,
    ) -> UpstreamResult:
        """Send one request (``body`` as JSON, or ``raw``: bytes and their content type,
        for a multipart upload) and read the whole answer. Cancellation closes the
        connection (llama-server stops the task when it notices)."""
        request = self._request(
            method, path, json=body, params=params, raw=raw, timeout=_timeout(self.read_timeout)
        )
        self._note(path, slot)
        try:
            resp = await self._exchange(request)
        except httpx.HTTPError as exc:
            raise self.error_for(exc, self.read_timeout) from exc
        return UpstreamResult(_head(resp), resp.content)

    async def stream(
        self,
        path: str,
        body: Mapping[str, Any],
        send: Sink,
        *,
        slot: int | None = None,
    ) -> UpstreamHead:
        """POST ``body`` and push the head, then each raw chunk, into ``send``.

        Raises a project error if the engine fails before the head or mid-stream.
        Cancellation (the client went away) closes the upstream response at once,
        which makes llama-server stop generating. ``send`` is not closed here.
        """
        request = self._request(
            "POST", path, json=body, headers=_CLOSE, timeout=_timeout(self.read_timeout)
        )
        self._note(path, slot)
        try:
            resp = await self._exchange(request, stream=True)
        except httpx.HTTPError as exc:
            raise self.error_for(exc, self.read_timeout) from exc
        try:
            head = _head(resp)
            await send.send(head)
            try:
                async for chunk in resp.aiter_raw():
                    await send.send(chunk)
            except httpx.HTTPError as exc:
                raise self.error_for(exc, self.read_timeout) from exc
            return head
        finally:
            with trio.move_on_after(2, shield=True):
                await resp.aclose()
