"""Helpers shared by the fault, load, hostile-input and isolation tests."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import trio

from gezel_trio.config.schema import Config
from gezel_trio.host import Host

from ._engine_bin import ENGINE_LIMITS

T = TypeVar("T")

__all__ = [
    "HttpReply",
    "ThreadHost",
    "assert_nothing_held",
    "held_summary",
    "open_fds",
    "raw_http",
    "read_sse",
    "resume_and_kill",
    "rss_bytes",
    "slots_busy",
    "split_url",
    "wait_nothing_held",
    "wait_until",
]


# --------------------------------------------------------------------------- waiting


async def wait_until(
    predicate: Callable[[], Awaitable[bool]] | Callable[[], bool],
    *,
    within: float,
    interval: float = 0.02,
    what: str = "condition",
) -> float:
    """Poll ``predicate`` until true; returns the seconds it took. Fails after ``within`` s."""
    start = trio.current_time()
    deadline = start + within
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return trio.current_time() - start
        if trio.current_time() >= deadline:
            raise AssertionError(f"{what} not reached within {within:g}s")
        await trio.sleep(interval)


# --------------------------------------------------------------------------- leaks


def held_summary(host: Host) -> dict[str, Any]:
    """What the host holds right now: queued and running jobs, leases, busy engines."""
    assert host.scheduler is not None
    sched = host.scheduler.statistics()
    arb = host.arbiter.statistics()
    return {
        "queued": sched.queued,
        "running": dict(sched.running),
        "active_ops": list(sched.active_ops),
        "loading": list(sched.loading),
        "lease_holders": dict(arb.holders),
        "lease_waiters": len(arb.waiters),
        "busy_engines": {mid: rt.engine.busy for mid, rt in host.models.items() if rt.engine.busy},
        "pinned_slots": {m: t.pinned for m, t in sched.slots.items() if t.pinned},
    }


def _is_clear(summary: dict[str, Any]) -> bool:
    return (
        summary["queued"] == 0
        and not summary["running"]
        and not summary["active_ops"]
        and not summary["lease_holders"]
        and summary["lease_waiters"] == 0
        and not summary["busy_engines"]
        and not summary["pinned_slots"]
    )


def assert_nothing_held(host: Host) -> None:
    summary = held_summary(host)
    assert _is_clear(summary), f"something is still held: {summary}"


async def wait_nothing_held(host: Host, *, within: float = 5.0) -> None:
    """Wait until the host holds nothing (jobs settle a moment after their response ends)."""
    try:
        await wait_until(lambda: _is_clear(held_summary(host)), within=within, what="nothing held")
    except AssertionError:
        raise AssertionError(f"still held after {within:g}s: {held_summary(host)}") from None


# --------------------------------------------------------------------------- engines


async def slots_busy(base_url: str) -> list[int]:
    """Ids of the engine's slots that report ``is_processing`` (direct ``GET /slots``)."""
    async with httpx.AsyncClient(limits=ENGINE_LIMITS, timeout=2.0) as direct:
        rows = (await direct.get(base_url + "/slots")).json()
    return [int(r["id"]) for r in rows if r.get("is_processing")]


def resume_and_kill(pids: Iterable[int | None]) -> None:
    """SIGCONT then SIGKILL every pid still alive (cleanup after a SIGSTOP test)."""
    for pid in pids:
        if pid is None:
            continue
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                break


# --------------------------------------------------------------------------- process figures


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size (VmRSS) of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def open_fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# --------------------------------------------------------------------------- HTTP


async def read_sse(resp: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE response, in order, until the stream ends."""
    events: list[str] = []
    async for line in resp.aiter_lines():
        if line.startswith("data: "):
            events.append(line[6:])
    return events


def split_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


class HttpReply:
    """A parsed raw HTTP/1.1 reply (status, headers, body as far as read)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        head, _, self.body = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        self.status_line = lines[0].decode("latin-1") if lines and lines[0] else ""
        parts = self.status_line.split(" ", 2)
        self.status = int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None
        self.headers = {}
        for line in lines[1:]:
            k, _, v = line.decode("latin-1").partition(":")
            self.headers[k.strip().lower()] = v.strip()

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"<HttpReply {self.status_line!r} {self.body[:200]!r}>"


async def raw_http(url: str, data: bytes, *, read_for: float = 10.0) -> HttpReply:
    """Send raw bytes to the server of ``url`` and read until it closes, or ``read_for`` s.

    Reading stops early once a complete response with a ``Content-Length`` has
    arrived, so a keep-alive connection does not hold the test.
    """
    host, port = split_url(url)
    buf = b""
    with trio.move_on_after(read_for):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            try:
                await stream.send_all(data)
            except trio.BrokenResourceError:
                pass  # the server may close before reading everything
            while True:
                try:
                    chunk = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break
                if not chunk:
                    break
                buf += chunk
                if _complete(buf):
                    break
    return HttpReply(buf)


def _complete(buf: bytes) -> bool:
    head, sep, body = buf.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            try:
                return len(body) >= int(v.strip())
            except ValueError:
                return False
    return False


# --------------------------------------------------------------------------- a host in a thread


class ThreadHost:
    """A real host served from its own thread (its own ``trio.run``), for sync tests
    (hypothesis, schemathesis) and for module-scoped fixtures. ``call(fn)`` runs a
    synchronous function on the host's loop and returns its result."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.url = ""
        self.host: Host | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gezel-test-host", daemon=True)

    def __enter__(self) -> ThreadHost:
        self._thread.start()
        if not self._ready.wait(120):
            raise AssertionError("the host did not start within 120 s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the host thread did not stop"
        self.check()

    def check(self) -> None:
        """Raise what ended the host, if it ended on its own."""
        if self._error is not None:
            raise AssertionError(f"the host died: {self._error!r}") from self._error
        assert self._thread.is_alive() or self._stop.is_set(), "the host stopped on its own"

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # surfaced to the test thread
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        from gezel_trio.server import open_server

        async with open_server(self.config) as (host, binds):
            self.host = host
            self.url = binds[0]
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await trio.to_thread.run_sync(self._stop.wait, abandon_on_cancel=True)

    def call(self, fn: Callable[[], T]) -> T:
        self.check()
        assert self._token is not None
        return trio.from_thread.run_sync(fn, trio_token=self._token)

    def held(self) -> dict[str, Any]:
        assert self.host is not None
        host = self.host
        return self.call(lambda: held_summary(host))


async def read_http_request(stream: trio.SocketStream) -> bytes | None:
    """One HTTP/1.1 request read off ``stream`` (head and a ``Content-Length`` body),
    for the few-line servers of the tests; None once the client closed its end."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        body += await stream.receive_some(65536)
    return head + b"\r\n\r\n" + body
