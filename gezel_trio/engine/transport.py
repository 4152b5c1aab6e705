"""``EngineTransport``: the httpx transport of every engine call, with a lean path for
the requests that use a connection once.

llama-server closes the connection after every streamed answer, so each completion
(all of them are streamed from the engine) opens a TCP connection, sends one request,
reads one answer and closes. httpx's pool (httpcore) does that with machinery made for
connections that live on: a pool lookup and its locks, a connection object per
request, a trace and a timeout scope around every read and write, the request's head
and body in two writes. h11, driven directly, still checks every event against a
state machine made for both roles and keep-alive.

So a request that says ``Connection: close`` (the caller promises it will not reuse
the connection: :meth:`EngineClient.stream <.client.EngineClient.stream>` does) goes
over a connection of its own, its bytes written and read by :mod:`.wire`: one write
for the head and the body, reads until the answer ends, and the socket closed with the
response. Every other request goes to the pool, unchanged. Measured on a streamed
1-token completion against llama-server (``python -m benchmarks.transport_cost``), the
client's CPU per request is 0.87 to 1.03 times h11's over a bare trio socket (it was
1.11 to 1.18 when this transport drove h11), where httpcore's pool costs 1.5 to 1.7 times it.

What the lean path keeps of httpx's contract, so that the client's retry rule and error
map need not know which path a request took:

- errors are httpx's: ``ConnectError``/``ConnectTimeout`` before the connection is up,
  ``WriteError``/``WriteTimeout`` while sending, ``ReadError``/``ReadTimeout`` while
  reading, ``RemoteProtocolError`` for an answer that breaks HTTP or ends early;
- the request's ``timeout`` extension bounds the connect, each write and each read, as
  httpcore's does; its ``trace`` extension hears ``connection.connect_tcp.complete`` (a
  fresh connection: never retried) and ``http11.receive_response_headers.complete``;
- the response is an ``httpx.Response`` whose stream yields the body's bytes as they
  arrive (de-chunked) and whose ``aclose`` closes the socket at once.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import math
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any

import httpcore
import httpx
import trio

from .wire import AnswerError, AnswerHead, AnswerReader, request_bytes

__all__ = ["EngineTransport"]

_READ_SIZE = 64 * 1024

Trace = Callable[[str, Mapping[str, Any]], Awaitable[None]]


def _uses_connection_once(request: httpx.Request) -> bool:
    """The request says ``Connection: close`` (and is not a ``HEAD``, whose answer's
    framing headers describe a body that never comes: the pool knows that)."""
    value = request.headers.get("connection")
    return value is not None and value.lower() == "close" and request.method != "HEAD"


def _seconds(timeouts: Mapping[str, float | None], key: str) -> float:
    value = timeouts.get(key)
    return math.inf if value is None else value


class EngineTransport(httpx.AsyncBaseTransport):
    """``pool`` for every request, but one that says ``Connection: close``, which goes
    over a connection of its own (see the module docstring). Closing it closes ``pool``."""

    def __init__(self, pool: httpx.AsyncBaseTransport) -> None:
        self.pool = pool
        self.open_once = 0
        """Connections of their own open now (a stream in flight holds one)."""

    def __repr__(self) -> str:
        return f"<EngineTransport open_once={self.open_once} pool={self.pool!r}>"

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` and return the response once its head has arrived.
        Cancellation closes the connection (the lean path's) and propagates."""
        if not _uses_connection_once(request) or request.url.scheme != "http":
            return await self.pool.handle_async_request(request)
        return await self._send_once(request)

    async def aclose(self) -> None:
        await self.pool.aclose()

    async def drop_idle(self, base_url: str) -> int:
        """Close the pool's idle keep-alive connections to ``base_url``, so that an
        engine about to be told to stop exits at once: llama-server holding an idle
        keep-alive connection takes about 110 ms to exit after SIGTERM, 3 ms without.
        Returns how many were closed (0 for a pool that is not httpx's own). A
        connection in use is left alone; a request the pool hands a closed one meanwhile
        is given another (httpcore's rule). No I/O but the closes; never raises for a
        connection that fails to close."""
        connections = getattr(getattr(self.pool, "_pool", None), "connections", None)
        if not isinstance(connections, list):
            return 0
        url = httpx.URL(base_url)
        origin = httpcore.Origin(url.raw_scheme, url.raw_host, url.port or 80)
        closed = 0
        for connection in list(connections):
            if connection.is_idle() and connection.can_handle_request(origin):
                with contextlib.suppress(Exception):
                    await connection.aclose()
                closed += 1
        return closed

    async def _send_once(self, request: httpx.Request) -> httpx.Response:
        """The lean path: connect, send, read the head. Raises httpx's errors;
        cancellation or a failure closes the connection."""
        timeouts: Mapping[str, float | None] = request.extensions.get("timeout", {})
        trace: Trace | None = request.extensions.get("trace")
        url = request.url
        port = url.port or 80
        deadline = trio.current_time() + _seconds(timeouts, "connect")
        try:
            with trio.CancelScope(deadline=deadline) as scope:  # (see _OneShot._receive)
                stream = await _connect(url.host, port)
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        if scope.cancelled_caught:
            raise httpx.ConnectTimeout(f"no connection within {timeouts.get('connect')}s")
        connection = _OneShot(stream, timeouts, self)
        try:
            if trace is not None:
                await trace("connection.connect_tcp.complete", {"return_value": stream})
            body = await request.aread()
            await connection.send(request, body)
            head = await connection.receive_head()
            if trace is not None:
                await trace("http11.receive_response_headers.complete", {})
        except BaseException:
            await connection.aclose()
            raise
        return httpx.Response(
            head.status,
            headers=head.headers,
            stream=connection,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": head.reason},
        )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> None:
        await self.aclose()


@functools.lru_cache(maxsize=64)
def _address_family(host: str) -> socket.AddressFamily | None:
    """The family of ``host`` when it is an IP address, None when it is a name (an
    engine's host is one of a few, asked for on every connection)."""
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return None


async def _connect(host: str, port: int) -> trio.SocketStream:
    """A TCP connection to ``host``: an address is connected to directly (what
    :func:`trio.open_tcp_stream` does for a name, racing its addresses, costs a task);
    cancellation closes the socket."""
    family = _address_family(host)
    if family is None:
        return await trio.open_tcp_stream(host, port)
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


class _OneShot(httpx.AsyncByteStream):
    """One request and its answer on a connection of their own; the answer's body is
    this stream, and closing it closes the connection."""

    def __init__(
        self,
        stream: trio.SocketStream,
        timeouts: Mapping[str, float | None],
        transport: EngineTransport,
    ) -> None:
        self._stream = stream
        self._transport: EngineTransport | None = transport
        transport.open_once += 1
        self._answer = AnswerReader()
        self._read_s = _seconds(timeouts, "read")
        self._write_s = _seconds(timeouts, "write")
        self._read_timeout = timeouts.get("read")

    async def send(self, request: httpx.Request, body: bytes) -> None:
        try:
            message = request_bytes(request.method, request.url.raw_path, request.headers.raw, body)
        except ValueError as exc:
            raise httpx.LocalProtocolError(str(exc)) from exc
        try:
            with trio.CancelScope(deadline=trio.current_time() + self._write_s) as scope:
                await self._stream.send_all(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise httpx.WriteError(str(exc)) from exc
        if scope.cancelled_caught:
            raise httpx.WriteTimeout("the engine took nothing of the request in time")

    async def _receive(self) -> bytes:
        """The next bytes the engine sends (``b""`` at its end of the connection)."""
        try:
            # a bare scope: fail_after's wrappers cost more than the read
            with trio.CancelScope(deadline=trio.current_time() + self._read_s) as scope:
                data = await self._stream.receive_some(_READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise httpx.ReadError(str(exc)) from exc
        if scope.cancelled_caught:
            raise httpx.ReadTimeout(f"the engine sent nothing for {self._read_timeout}s")
        return data

    async def receive_head(self) -> AnswerHead:
        answer = self._answer
        while True:
            try:
                head = answer.head()
            except AnswerError as exc:
                raise httpx.RemoteProtocolError(str(exc)) from exc
            if head is not None:
                return head
            data = await self._receive()
            if not data:
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            answer.feed(data)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        answer = self._answer
        while True:
            try:
                data = answer.body()
            except AnswerError as exc:
                raise httpx.RemoteProtocolError(str(exc)) from exc
            if data:
                yield data
            if answer.done:
                return
            more = await self._receive()
            if not more:
                if answer.ends_with_connection:
                    return
                raise httpx.RemoteProtocolError("the engine closed the connection mid-answer")
            answer.feed(more)

    async def aclose(self) -> None:
        """Close the connection at once; again is a no-op. It never waits, so
        cancellation cannot cut it (it does not checkpoint: closing a socket is
        synchronous, and the caller's next await is one)."""
        if self._transport is not None:
            self._transport.open_once -= 1
            self._transport = None
        self._stream.socket.close()
