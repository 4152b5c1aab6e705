"""Serve the host over HTTP: hypercorn, inside ``open_host``'s nursery tree."""

from __future__ import annotations

import errno
import logging
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import trio
from hypercorn.config import Config as HypercornConfig

from ._trio import unwrapping
from .api.app import create_app
from .api.lean import LeanFront
from .config.schema import Config, split_listen
from .errors import GezelError
from .front_guard import FrontGuard, serve_front
from .gpu.probe import Probe
from .host import Host, open_host

log = logging.getLogger("gezel_trio.server")

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


STOP_RESERVE_S = 2.0
"""Of ``[server] shutdown_timeout``, the seconds kept for parking KV and stopping engines
after the last connection closed (at most half of it)."""


def hypercorn_config(config: Config) -> HypercornConfig:
    """hypercorn's settings for :func:`~gezel_trio.front_guard.serve_front`.

    Its ``graceful_timeout`` is not used (the front guard drains and closes connections
    itself, see :func:`drain_timeout`), and ``read_timeout`` stays off: it bounds every
    read, including the silent wait of a client for a long answer. A request's head is
    bounded by ``keep_alive_timeout`` (hypercorn's idle timer runs until a whole head has
    arrived), its body by Quart's ``BODY_TIMEOUT`` (``[server] body_timeout``).
    """
    hc = HypercornConfig()
    host = config.server.host
    hc.bind = [f"[{host}]:{config.server.port}" if ":" in host else f"{host}:{config.server.port}"]
    if config.server.ollama_listen:  # Ollama's port, for apps that hard-code it: same app
        hc.bind.append(config.server.ollama_listen)
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.keep_alive_timeout = config.server.keep_alive_timeout
    hc.read_timeout = None
    hc.h11_max_incomplete_size = 64 * 1024
    hc.max_app_queue_size = 64
    return hc


def drain_timeout(config: Config) -> float:
    """Seconds running requests get to finish once the shutdown began: ``[server]
    shutdown_timeout`` less :data:`STOP_RESERVE_S` (less at most half of it)."""
    total = config.server.shutdown_timeout
    return total - min(STOP_RESERVE_S, total / 2)


class ListenError(GezelError):
    """hypercorn could not bind ``[server] host``:``port``; the message says what to change."""

    code = "cannot_listen"

    def __init__(self, message: str, *, address: str, errno: int | None) -> None:
        super().__init__(message)
        self.address = address
        self.errno = errno


_BIND_ERRORS = {
    errno.EADDRINUSE: ("address already in use", "choose another [server] port or --port"),
    errno.EACCES: (
        "permission denied",
        "ports below 1024 need privileges: choose another [server] port or --port",
    ),
    errno.EADDRNOTAVAIL: (
        "no such address on this machine",
        "choose another [server] host or --host",
    ),
}


def listen_error(config: Config, exc: OSError) -> ListenError | None:
    """The bind failure ``exc`` as a :class:`ListenError`; None if it is not one."""
    host, port = config.server.host, config.server.port
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if isinstance(exc, socket.gaierror):
        reason, advice = f"unknown host ({exc.strerror})", "choose another [server] host or --host"
    elif exc.errno in _BIND_ERRORS:
        reason, advice = _BIND_ERRORS[exc.errno]
    else:
        return None
    ollama = config.server.ollama_listen
    if ollama and not _bindable(ollama):  # the second listener's address it is
        address, advice = ollama, "choose another [server] ollama_listen (is Ollama running?)"
    return ListenError(
        f"cannot listen on {address}: {reason}; {advice}", address=address, errno=exc.errno
    )


def _bindable(address: str) -> bool:
    """Whether ``"host:port"`` can be listened on now (a probe after a failed bind)."""
    split = split_listen(address)
    if split is None:
        return False
    family = socket.AF_INET6 if ":" in split[0] else socket.AF_INET
    try:
        with socket.create_server(split, family=family):
            return True
    except (OSError, OverflowError):
        return False


def exposure_warning(config: Config) -> str | None:
    if config.server.host not in LOOPBACK and not config.server.api_keys:
        return (
            f"binding {config.server.host}:{config.server.port} without API keys: anyone who can "
            "reach this address can use every model. Set [server] api_keys."
        )
    ollama = split_listen(config.server.ollama_listen or "")
    if ollama is not None and ollama[0] not in LOOPBACK and not config.server.api_keys:
        return (
            f"binding ollama_listen {config.server.ollama_listen} without API keys: anyone who "
            "can reach this address can use every model. Set [server] api_keys."
        )
    return None


@dataclass(frozen=True)
class Served:
    """What :func:`open_served` yields: the host, its URLs, its connections' guard, and
    the lean front of its hot routes."""

    host: Host
    urls: list[str]
    front: FrontGuard
    lean: LeanFront


@asynccontextmanager
async def open_served(
    config: Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    probe: Probe | None = None,
) -> AsyncIterator[Served]:
    """Open the host and serve it over HTTP for the duration of the block.

    Leaving the block (or ``shutdown_trigger`` returning) shuts down in order: stop
    accepting; let running requests finish for :func:`drain_timeout`; reset every
    client connection still open, stuck or not; then the host parks its sessions' KV and
    stops every engine in what is left of ``[server] shutdown_timeout``
    (:meth:`Host.bound_stop`: an engine that has not exited on SIGTERM in time is
    killed). Leaving it with an exception skips the wait for running requests.
    Cancellation resets every connection at once, stops every engine and leaves as a
    :class:`trio.Cancelled`. Errors leave as themselves, never as an exception group; a
    port that cannot be bound is a :class:`ListenError`.
    """
    warning = exposure_warning(config)
    if warning:
        log.warning(warning)
    async with unwrapping(), open_host(config, probe=probe) as host:
        began: list[float] = []  # when the shutdown began (the block was left)
        try:
            async with _serving(config, host, shutdown_trigger, began) as served:
                yield served
        finally:
            # the front has closed: the engines' parking and stop get what is left
            if began:
                left = config.server.shutdown_timeout - (trio.current_time() - began[0])
                host.bound_stop(max(0.0, left))


@asynccontextmanager
async def _serving(
    config: Config,
    host: Host,
    shutdown_trigger: Callable[[], Awaitable[None]] | None,
    began: list[float],
) -> AsyncIterator[Served]:
    """The front of :func:`open_served` (its docstring says how it shuts down); appends
    to ``began`` the time the shutdown began."""
    async with trio.open_nursery() as nursery:

        async def trigger() -> None:
            if shutdown_trigger is not None:
                await shutdown_trigger()
            began.append(trio.current_time())

        app = LeanFront(create_app(host), host)
        front = FrontGuard(
            write_timeout=config.server.stream_stall_timeout,
            drain_timeout=drain_timeout(config),
        )
        serve = partial(
            serve_front,
            app,
            hypercorn_config(config),
            front,
            shutdown_trigger=trigger if shutdown_trigger is not None else None,
        )
        try:
            binds: list[str] = await nursery.start(serve)
        except OSError as exc:
            error = listen_error(config, exc)
            if error is None:
                raise
            raise error from exc
        host.urls = binds
        log.info("serving", extra={"fields": {"urls": binds, "models": list(host.models)}})
        try:
            yield Served(host=host, urls=binds, front=front, lean=app)
        except BaseException:
            began.append(trio.current_time())
            front.stop(drain_timeout=0)
            raise
        else:
            began.append(trio.current_time())
            front.stop()  # the nursery waits for the front to drain and close


@asynccontextmanager
async def open_server(
    config: Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    probe: Probe | None = None,
) -> AsyncIterator[tuple[Host, list[str]]]:
    """:func:`open_served`, yielding the host and the bound URLs (useful with port 0)."""
    async with open_served(config, shutdown_trigger=shutdown_trigger, probe=probe) as served:
        yield served.host, served.urls


async def serve_host(
    config: Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until ``shutdown_trigger`` returns or the task is cancelled.

    Cancellation stops every engine before this returns. Errors leave as
    themselves (see :func:`open_server`), never as an exception group.
    """
    done = trio.Event()

    async def trigger() -> None:
        if shutdown_trigger is None:
            await trio.sleep_forever()
        else:
            await shutdown_trigger()
        done.set()

    async with open_server(config, shutdown_trigger=trigger) as (_, binds):
        task_status.started(binds)
        await done.wait()


async def serve_until_signalled(config: Config) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully (see :func:`open_served`;
    within ``[server] shutdown_timeout`` unless parking or an engine's stop takes longer,
    which is logged); SIGHUP reloads the config file (see
    :meth:`Host.reload <gezel_trio.host.host.Host.reload>`).

    The signal handlers stay installed for the whole shutdown: a second
    Ctrl-C while engines are stopping is logged and absorbed instead of
    killing the host halfway and orphaning llama-server processes.
    Cancellation stops every engine before this returns. Errors leave as
    themselves (see :func:`open_server`), never as an exception group.
    """
    shutdown = trio.Event()
    signalled_at: list[float] = []
    hosts: list[Host] = []
    # What the receiver restores when it closes: a Ctrl-C between the end of the
    # shutdown and the process's exit is ignored, not a KeyboardInterrupt at exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:

        async def watch() -> None:
            async for signum in signals:
                name = signal.Signals(signum).name
                if signum == signal.SIGHUP:
                    if hosts and not shutdown.is_set():
                        nursery.start_soon(_reload_logged, hosts[0])
                elif not shutdown.is_set():
                    log.info("shutting down", extra={"fields": {"signal": name}})
                    signalled_at.append(trio.current_time())
                    shutdown.set()
                else:
                    log.warning(
                        "already shutting down: waiting for the engines to stop",
                        extra={"fields": {"signal": name}},
                    )

        async with unwrapping(), trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with open_server(config, shutdown_trigger=shutdown.wait) as (host, _):
                hosts.append(host)
                await shutdown.wait()
            nursery.cancel_scope.cancel()
    if signalled_at:
        _log_shutdown(trio.current_time() - signalled_at[0], config.server.shutdown_timeout)


def _log_shutdown(took: float, budget: float) -> None:
    fields = {"took_s": round(took, 3), "shutdown_timeout": budget}
    if took > budget:
        log.warning(
            "the shutdown took %.1fs, more than [server] shutdown_timeout: parking KV or "
            "stopping an engine took long (see park_on_stop_timeout, stop_grace)",
            took,
            extra={"fields": fields},
        )
    else:
        log.info("stopped", extra={"fields": fields})


async def _reload_logged(host: Host) -> None:
    """A SIGHUP's reload: its outcome, or why the file was refused, goes to the log."""
    try:
        result = await host.reload()
    except GezelError as exc:
        log.error("reload refused, the running config stays: %s", exc.message)
    else:
        log.info("reloaded", extra={"fields": result})
