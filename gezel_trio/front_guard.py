"""Serve the app over HTTP with a deadline on every socket write and a shutdown that ends.

Why this module exists: hypercorn's trio worker (checked on 0.18.0, the newest release)
writes every response chunk with ``send_all`` inside a cancel shield that has no deadline
(``hypercorn.trio.tcp_server.TCPServer.protocol_send``). A client that keeps its connection
open and stops reading (a stuck browser tab, a slow-read attack) holds that write forever:
its connection task never ends, and neither does hypercorn's server nursery, so a shutdown
waits for it indefinitely (``graceful_timeout`` cancels the nursery, which a shield
ignores). hypercorn has no setting for it: a ``write_timeout`` was proposed upstream
(pgjones/hypercorn#262) and closed unmerged, and an ASGI middleware cannot reach below the
shield.

So :func:`serve_front` serves the app the way ``hypercorn.trio.serve`` does (same
protocol classes, lifespan and keep-alive handling), with four changes:

1. Every connection is a :class:`_GuardedTCPServer`, whose writes go out in pieces of
   16 KiB, each under ``trio.move_on_after(write_timeout, shield=True)``: a piece the
   client does not take within ``write_timeout`` resets the connection (RST: the kernel
   drops what the client never read) and the connection's task ends.
2. Its shutdown is bounded: stop accepting (the listening sockets close), close idle
   keep-alive connections, let busy ones finish until the drain deadline, then reset every
   connection still open, stuck or not. Closing a socket wakes a write blocked on it at
   once, so nothing waits for a write deadline at shutdown.
3. A connection the server closes while its client may still be sending (a 413 or 408
   answered before the request body was read, a 400) closes the way Apache's "lingering
   close" does: its write side first (a FIN after the answer), then what the client still
   sends is read and dropped until it closes its end, for :data:`LINGER_S` at most.
   hypercorn closes the socket at once, and a socket closed with unread bytes sends a
   reset, which could reach the client before it had read the answer: it saw "connection
   reset" instead of the 413 that told it what to fix.
4. The keep-alive idle timer is a deadline on the connection's read loop
   (:class:`_IdleDeadline`), not hypercorn's task started at the end of every request
   (behind a lock, with ``nursery.start``) and cancelled at the start of the next: the
   same cut after ``keep_alive_timeout``, for no task per request.

It depends on hypercorn's internal classes (``TCPServer``, ``Lifespan``, ``WorkerContext``);
it is written against hypercorn 0.18.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
import socket
import struct
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.statsd import StatsdLogger
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ConnectionState, Framework
from hypercorn.utils import repr_socket_addr, wrap_app

log = logging.getLogger("gezel_trio.front")

WRITE_PIECE = 16 * 1024
"""Bytes written under one deadline: a client must take this much within ``write_timeout``."""

LIFESPAN_SHUTDOWN_S = 5.0
"""Seconds the app's lifespan shutdown may take once every connection is closed."""

LINGER_S = 2.0
"""Seconds a connection the server closed goes on reading (and dropping) what its client
still sends, so that the close does not reset the answer away (see the module)."""

_BOOKKEEPING_S = 1.0
"""Seconds a connection's idle-timer update or close may take (they wait on no client)."""

_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, drops unsent data


@dataclass(frozen=True)
class FrontStatistics:
    """A snapshot of the front end's connections."""

    open: int
    """Client connections open now."""
    busy: int
    """Of those, connections within a request (its head arrived, its response not done)."""
    writing: int
    """Connections with a write waiting for the client to take bytes."""
    oldest_write_s: float
    """How long the oldest of those writes has waited (0: none waits)."""
    accepted: int
    """Connections accepted since the start."""
    write_timeouts: int
    """Connections reset because their client took nothing for ``write_timeout``."""
    reset_at_shutdown: int
    """Connections still open at the end of the shutdown's drain, reset."""
    stopping: bool
    """The shutdown has begun: no connection is accepted any more."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class FrontGuard:
    """The registry of a front end's client connections, its write deadline and its
    shutdown: :func:`serve_front` registers every connection here; :meth:`stop` begins the
    shutdown; :meth:`close_all` resets whatever is still open.

    ``write_timeout``: seconds a client may take nothing of a response before its
    connection is reset. ``drain_timeout``: seconds running requests get to finish once
    :meth:`stop` was called, before every connection still open is reset.
    """

    def __init__(self, *, write_timeout: float, drain_timeout: float) -> None:
        if not write_timeout > 0:
            raise ValueError("write_timeout must be positive")
        if not drain_timeout >= 0:
            raise ValueError("drain_timeout must be >= 0")
        self.write_timeout = write_timeout
        self.drain_timeout = drain_timeout
        self._connections: set[_GuardedTCPServer] = set()
        self._emptied = trio.Event()
        self._emptied.set()
        self._stopping = trio.Event()
        self._drain_deadline = math.inf
        self._accepted = 0
        self._write_timeouts = 0
        self._reset_at_shutdown = 0

    def __repr__(self) -> str:
        s = self.statistics()
        state = "stopping" if s.stopping else "serving"
        return (
            f"<FrontGuard {state} open={s.open} busy={s.busy} writing={s.writing} "
            f"write_timeout={self.write_timeout:g}s drain_timeout={self.drain_timeout:g}s>"
        )

    def statistics(self) -> FrontStatistics:
        now = trio.current_time()
        started = [c.write_started for c in self._connections if c.write_started is not None]
        return FrontStatistics(
            open=len(self._connections),
            busy=sum(c.busy for c in self._connections),
            writing=len(started),
            oldest_write_s=now - min(started) if started else 0.0,
            accepted=self._accepted,
            write_timeouts=self._write_timeouts,
            reset_at_shutdown=self._reset_at_shutdown,
            stopping=self._stopping.is_set(),
        )

    @property
    def drain_deadline(self) -> float:
        """When running requests stop being waited for (trio time); inf before :meth:`stop`."""
        return self._drain_deadline

    def stop(self, *, drain_timeout: float | None = None) -> None:
        """Begin the shutdown: stop accepting, and give running requests ``drain_timeout``
        seconds (the guard's own by default) to finish. Idempotent; a second call can only
        bring the deadline closer."""
        drain = self.drain_timeout if drain_timeout is None else max(0.0, drain_timeout)
        self._drain_deadline = min(self._drain_deadline, trio.current_time() + drain)
        self._stopping.set()

    async def wait_stopping(self) -> None:
        """Return once :meth:`stop` was called."""
        await self._stopping.wait()

    async def wait_closed(self) -> None:
        """Return once no client connection is open."""
        while self._connections:
            await self._emptied.wait()

    def close_idle(self) -> None:
        """Close every connection with no request in flight (as its idle deadline does)."""
        for conn in self._connections:
            if not conn.busy:
                conn.reading.deadline = -math.inf

    def close_all(self) -> int:
        """Reset every client connection still open; returns how many. A task waiting on
        one of their sockets (a write the client does not read) wakes at once with
        ``ClosedResourceError``, so its connection ends without waiting for a deadline."""
        n = 0
        for conn in list(self._connections):
            n += conn.reset()
        if n:
            self._reset_at_shutdown += n
            log.warning("reset %d client connections still open at shutdown", n)
        return n

    def _add(self, conn: _GuardedTCPServer) -> None:
        if not self._connections:
            self._emptied = trio.Event()
        self._connections.add(conn)
        self._accepted += 1

    def _discard(self, conn: _GuardedTCPServer) -> None:
        self._connections.discard(conn)
        if not self._connections:
            self._emptied.set()


class _IdleDeadline:
    """hypercorn's idle timer (a connection's ``idle_task``), as the deadline of the
    connection's read loop: ``restart`` (a response went out, or the connection opened)
    sets it ``keep_alive_timeout`` ahead, or in the past once the server is stopping;
    ``stop`` (a request began) lifts it. The read loop, cut by it, closes the connection
    as hypercorn's timer task would (:meth:`_GuardedTCPServer._read_data`)."""

    __slots__ = ("_connection",)

    def __init__(self, connection: _GuardedTCPServer) -> None:
        self._connection = connection

    async def restart(self, task_group: object, action: object) -> None:
        self._connection.idle_from_now()

    async def stop(self) -> None:
        self._connection.reading.deadline = math.inf


class _GuardedTCPServer(TCPServer):
    """hypercorn's connection handler, with a deadline on every write (see the module)."""

    def __init__(
        self,
        app: AppWrapper,
        config: HypercornConfig,
        context: WorkerContext,
        state: ConnectionState,
        stream: trio.SocketStream,
        *,
        guard: FrontGuard,
    ) -> None:
        super().__init__(app, config, context, state, stream)  # type: ignore[arg-type]
        self._socket_stream = stream
        self._guard = guard
        self.busy = False
        self.write_started: float | None = None
        self._peer = ""
        self._held = b""
        self._on_leave: set[Callable[[], object]] = set()
        self._reading_done = False
        self.reading = trio.CancelScope()
        """hypercorn's read loop: its deadline is the idle timer's; cancelled to linger."""
        self._lingering = False
        self.idle_task = _IdleDeadline(self)  # type: ignore[assignment]

    async def run(self) -> None:
        """Serve the connection until the client or the server closes it. Cancellation
        ends it (hypercorn's own handling); so does :meth:`reset`."""
        with contextlib.suppress(OSError):
            self._peer = repr_socket_addr(
                self._socket_stream.socket.family, self._socket_stream.socket.getpeername()
            )
        self._guard._add(self)
        _connection.set(self)  # the app's tasks, spawned from this one, see it
        try:
            await super().run()
        finally:
            self._guard._discard(self)

    def call_on_leave(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call ``callback`` once the client closes the connection (or the connection is
        reset); at once if it has. Returns the function that takes the call back."""
        if self._reading_done:
            callback()
            return _nothing
        self._on_leave.add(callback)
        return partial(self._on_leave.discard, callback)

    @contextlib.contextmanager
    def cancelled_on_leave(self) -> Iterator[trio.CancelScope]:
        """A cancel scope that is cancelled when the client closes the connection (or
        the connection is reset) while the block runs."""
        with trio.CancelScope() as scope:
            forget = self.call_on_leave(scope.cancel)
            try:
                yield scope
            finally:
                forget()

    async def _read_data(self) -> None:
        """Read the client's bytes until it closes its end (or the socket closes), then
        call what :meth:`call_on_leave` was given, and stop the idle timer:
        hypercorn leaves it running, so the connection's task and socket outlived a
        client that had gone, for up to ``keep_alive_timeout`` (a client opening and
        closing connections piled them up). A connection idle past its deadline
        (:class:`_IdleDeadline`) is closed here, one the server closed first is drained
        here (:meth:`_linger`). Cancellation: as hypercorn's (the read stops)."""
        with self.reading:
            await super()._read_data()
        if self._lingering:
            await self._linger()
        elif self.reading.cancelled_caught:  # idle for keep_alive_timeout, or stopping
            with trio.move_on_after(_BOOKKEEPING_S, shield=True):
                await self._initiate_server_close()
        self._reading_done = True
        for callback in list(self._on_leave):
            callback()
        self._on_leave.clear()
        self.reading.deadline = math.inf

    def idle_from_now(self) -> None:
        """The connection is idle (no request in flight): close it ``keep_alive_timeout``
        from now, or at once when the server is stopping."""
        if self.context.terminated.is_set():
            self.reading.deadline = -math.inf
        else:
            self.reading.deadline = trio.current_time() + self.config.keep_alive_timeout

    def _start_lingering(self) -> bool:
        """Close the write side (the answer is followed by a FIN) and have the read task
        drain the socket instead of handing its bytes to hypercorn; False when there is
        nothing to linger for (the client closed its end, or the socket is gone)."""
        sock = self._socket_stream.socket
        if self._reading_done or self._lingering or sock.fileno() == -1:
            return False
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return False
        self._lingering = True
        self.reading.cancel()
        return True

    async def _linger(self) -> None:
        """Read and drop what the client still sends until it closes its end, for
        :data:`LINGER_S` at most; the connection's task then closes the socket (or the
        guard resets it sooner, at shutdown). Cancellation: stops reading."""
        with trio.move_on_after(LINGER_S):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                while await self._socket_stream.receive_some(MAX_RECV):
                    pass

    async def protocol_send(self, event: Event) -> None:
        """Carry out what the HTTP protocol asks of the connection: bytes to write (see
        :meth:`_send_with_deadline`), an idle-timer update, a close. None of it is cut by
        cancellation, and none of it outlasts its deadline.

        A response head that announces a body of known length is held until that body
        comes (hypercorn hands it over next, in the same send of the app), so that a
        whole answer is one write instead of two or three: on this path a socket write
        costs more than most of the Python around it."""
        if not isinstance(event, RawData):
            if isinstance(event, Updated):  # the idle timer (_IdleDeadline): no wait
                self.busy = not event.idle
                if event.idle:
                    self.idle_from_now()
                else:
                    self.reading.deadline = math.inf
                return
            if isinstance(event, Closed):
                self.busy = False
                if self._start_lingering():
                    with trio.move_on_after(_BOOKKEEPING_S, shield=True):
                        await self.protocol.handle(event)  # what hypercorn does after closing
                    return
            # hypercorn runs the connection's close in whichever task ended the exchange:
            # usually the app's, which quart-trio has just cancelled (the stream's end
            # reached it as a disconnect). Cut at its first checkpoint, a close after a
            # request whose body was not read to its end (a 408, a 413) leaves the socket
            # open, its reader waiting forever. So it runs shielded, with a deadline: it
            # neither sends nor waits on a client.
            with trio.move_on_after(_BOOKKEEPING_S, shield=True):
                await super().protocol_send(event)
            if isinstance(event, Closed):
                self.reset()  # no-op once closed above
            return
        data = event.data
        if self._held:  # the body (or, for a HEAD request, the end) of a held head
            data, self._held = self._held + data, b""
        elif _body_follows(data):
            self._held = data  # goes out with its body, in one write
            return
        if not data:  # the end of a body of known length: nothing to write
            return
        async with self.send_lock:
            try:
                await self._send_with_deadline(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())

    async def _send_with_deadline(self, data: bytes) -> None:
        """Write ``data``, each :data:`WRITE_PIECE` bytes within ``write_timeout``.

        Shielded from cancellation, as hypercorn's own write is (a write cut halfway would
        leave half a chunk on the wire), but never past the deadline. A piece that does
        not go out in time resets the connection and raises ``ClosedResourceError``; so
        does a socket closed meanwhile (:meth:`FrontGuard.close_all`), at once."""
        view = memoryview(data)
        for start in range(0, max(len(view), 1), WRITE_PIECE):
            self.write_started = trio.current_time()
            try:
                with trio.move_on_after(self._guard.write_timeout, shield=True) as scope:
                    await self._socket_stream.send_all(view[start : start + WRITE_PIECE])
            finally:
                self.write_started = None
            if scope.cancelled_caught:
                self._guard._write_timeouts += 1
                log.info(
                    "a client took nothing for %gs: its connection is reset",
                    self._guard.write_timeout,
                    extra={"fields": {"client": self._peer, "busy": self.busy}},
                )
                self.reset()
                raise trio.ClosedResourceError("the client stopped reading")

    def reset(self) -> int:
        """Close the connection now with a TCP reset; 1 if it was open, else 0. Synchronous:
        a task waiting on the socket wakes with ``ClosedResourceError``."""
        sock = self._socket_stream.socket
        if sock.fileno() == -1:
            return 0
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        sock.close()
        return 1


_connection: contextvars.ContextVar[_GuardedTCPServer | None] = contextvars.ContextVar(
    "gezel_front_connection", default=None
)


def cancelled_when_client_leaves() -> contextlib.AbstractContextManager[trio.CancelScope] | None:
    """For the request being served in this task: a cancel scope (a context manager)
    that is cancelled when its client closes the connection, or None when the request
    did not come through :func:`serve_front` (its server must tell the app of a
    disconnect the ASGI way). It costs no task: the connection's own read loop sees
    the close."""
    connection = _connection.get()
    return None if connection is None else connection.cancelled_on_leave()


def call_when_client_leaves(callback: Callable[[], object]) -> Callable[[], None] | None:
    """For the request being served in this task: call ``callback`` once its client
    closes the connection (at once if it has), until the returned function takes the
    call back; None when the request did not come through :func:`serve_front`. Costs
    no task: the connection's own read loop sees the close."""
    connection = _connection.get()
    return None if connection is None else connection.call_on_leave(callback)


def _nothing() -> None:
    pass


def _body_follows(data: bytes) -> bool:
    """Whether ``data`` is a response head (and only that) announcing a body of known,
    non-zero length, which its response writes next."""
    if not data.startswith(b"HTTP/1.1 ") or not data.endswith(b"\r\n\r\n"):
        return False
    at = data.find(b"\r\ncontent-length: ")
    if at < 0:
        return False
    value = data[at + 18 : data.find(b"\r\n", at + 18)]
    return value.isdigit() and int(value) > 0


async def _stop_when(trigger: Callable[[], Awaitable[object]], guard: FrontGuard) -> None:
    await trigger()
    guard.stop()


async def serve_front(
    app: Framework,
    config: HypercornConfig,
    guard: FrontGuard,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` on ``config.bind`` (plain HTTP; hypercorn's TLS and QUIC
    sockets are not served) until ``guard.stop()`` is called or ``shutdown_trigger``
    returns; reports the bound URLs through ``task_status``.

    Then, in order: stop accepting; close idle keep-alive connections (and every
    connection once its response is done); wait for running requests until the guard's
    drain deadline; reset every connection still open; run the app's lifespan shutdown
    (at most :data:`LIFESPAN_SHUTDOWN_S`). A bind failure raises ``OSError`` before
    anything started. Cancellation resets every connection at once, skips the lifespan
    shutdown and returns as ``trio.Cancelled``, without waiting on any client.
    """
    config.set_statsd_logger_class(StatsdLogger)
    sockets = config.create_sockets()
    for s in (*sockets.secure_sockets, *sockets.quic_sockets):
        s.close()
    listeners: list[trio.SocketListener] = []
    try:
        binds = []
        for s in sockets.insecure_sockets:
            s.listen(config.backlog)
            listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(s)))
            binds.append(f"http://{repr_socket_addr(s.family, s.getsockname())}")
        wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
        state: dict[str, Any] = {}
        lifespan = Lifespan(wrapped, config, state)
        context = WorkerContext(None)

        async def handle(stream: trio.SocketStream) -> None:
            state_copy = ConnectionState(state.copy())
            await _GuardedTCPServer(wrapped, config, context, state_copy, stream, guard=guard).run()

        async with trio.open_nursery() as lifespan_nursery:
            try:
                await lifespan_nursery.start(lifespan.handle_lifespan)
                await lifespan.wait_for_startup()
                async with trio.open_nursery() as connections:
                    try:
                        async with trio.open_nursery() as accepting:
                            accepting.start_soon(
                                partial(
                                    trio.serve_listeners,
                                    handle,
                                    listeners,
                                    handler_nursery=connections,
                                )
                            )
                            if shutdown_trigger is not None:
                                accepting.start_soon(_stop_when, shutdown_trigger, guard)
                            task_status.started(binds)
                            await guard.wait_stopping()
                            accepting.cancel_scope.cancel()  # the listening sockets close
                        await context.terminated.set()  # no keep-alive after a response
                        guard.close_idle()
                        with trio.move_on_at(guard.drain_deadline):
                            await guard.wait_closed()
                    finally:
                        guard.close_all()
                        connections.cancel_scope.cancel()
                with trio.move_on_after(LIFESPAN_SHUTDOWN_S):
                    await lifespan.wait_for_shutdown()
            finally:
                lifespan_nursery.cancel_scope.cancel()
    finally:
        for s in sockets.insecure_sockets:  # closed with their listeners, unless one failed
            s.close()
