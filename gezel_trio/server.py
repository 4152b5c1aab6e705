"""Serve the host over HTTP: hypercorn, inside ``open_host``'s nursery tree."""

from __future__ import annotations

import errno
import logging
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from ._trio import unwrapping
from .api.app import create_app
from .config import Config
from .errors import GezelError
from .gpu.probe import Probe
from .host import Host, open_host
from .host.catalog import reload

log = logging.getLogger("gezel_trio.server")

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def hypercorn_config(config: Config) -> HypercornConfig:
    hc = HypercornConfig()
    host = config.server.host
    hc.bind = [f"[{host}]:{config.server.port}" if ":" in host else f"{host}:{config.server.port}"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.keep_alive_timeout = 75
    hc.graceful_timeout = 5
    hc.read_timeout = None
    hc.h11_max_incomplete_size = 64 * 1024
    hc.max_app_queue_size = 64
    return hc


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
    return ListenError(
        f"cannot listen on {address}: {reason}; {advice}", address=address, errno=exc.errno
    )


def exposure_warning(config: Config) -> str | None:
    if config.server.host not in LOOPBACK and not config.server.api_keys:
        return (
            f"binding {config.server.host}:{config.server.port} without API keys: anyone who can "
            "reach this address can use every model. Set [server] api_keys."
        )
    return None


@asynccontextmanager
async def open_server(
    config: Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    probe: Probe | None = None,
) -> AsyncIterator[tuple[Host, list[str]]]:
    """Open the host and serve it over HTTP for the duration of the block.

    Yields the host and the bound URLs (useful with port 0). Leaving the
    block stops hypercorn, then every engine; so does cancellation, which
    leaves as a :class:`trio.Cancelled`. Errors leave as themselves, never as
    an exception group; a port that cannot be bound is a :class:`ListenError`.
    """
    warning = exposure_warning(config)
    if warning:
        log.warning(warning)
    async with unwrapping(), open_host(config, probe=probe) as host, trio.open_nursery() as nursery:
        app = create_app(host)
        serve = partial(
            hypercorn_serve, app, hypercorn_config(config), shutdown_trigger=shutdown_trigger
        )
        try:
            async with unwrapping():  # hypercorn binds inside two nurseries of its own
                binds: list[str] = await nursery.start(serve)
        except OSError as exc:
            error = listen_error(config, exc)
            if error is None:
                raise
            raise error from exc
        host.urls = binds
        log.info("serving", extra={"fields": {"urls": binds, "models": list(host.models)}})
        try:
            yield host, binds
        finally:
            nursery.cancel_scope.cancel()


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
    """Serve until SIGINT or SIGTERM, then shut down gracefully; SIGHUP reloads the
    config file (see :func:`gezel_trio.host.catalog.reload`).

    The signal handlers stay installed for the whole shutdown: a second
    Ctrl-C while engines are stopping is logged and absorbed instead of
    killing the host halfway and orphaning llama-server processes.
    Cancellation stops every engine before this returns. Errors leave as
    themselves (see :func:`open_server`), never as an exception group.
    """
    shutdown = trio.Event()
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


async def _reload_logged(host: Host) -> None:
    """A SIGHUP's reload: its outcome, or why the file was refused, goes to the log."""
    try:
        result = await reload(host)
    except GezelError as exc:
        log.error("reload refused, the running config stays: %s", exc.message)
    else:
        log.info("reloaded", extra={"fields": result})
