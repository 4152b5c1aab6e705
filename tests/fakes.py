"""Deterministic stand-ins for engine processes, for supervisor policy tests.

A :class:`FakeLauncher` hands out :class:`FakeProcess` objects and serves
their ``/health`` through an ``httpx.MockTransport``, all on Trio's clock, so
tests can run with ``autojump_clock`` and assert exact virtual times.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import httpx
import trio


@dataclass
class FakeBehaviour:
    load_time: float = 1.0
    exit_during_start: float | None = None
    exit_code: int = 1
    ignores_sigterm: bool = False
    term_exit_delay: float = 0.0
    startup_lines: tuple[str, ...] = ("loading model", "model loaded")


@dataclass
class FakeProcess:
    pid: int
    port: int
    behaviour: FakeBehaviour
    spawned_at: float
    returncode: int | None = None
    stdout: None = None
    hung: bool = False
    signals: list[tuple[float, int]] = field(default_factory=list)
    _exited: trio.Event = field(default_factory=trio.Event)

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set()

    def send_signal(self, sig: int) -> None:
        self.signals.append((trio.current_time(), sig))
        if self.returncode is not None:
            return
        if sig == signal.SIGKILL:
            self.exit(-signal.SIGKILL)
        elif sig == signal.SIGTERM and not self.behaviour.ignores_sigterm:
            if self.behaviour.term_exit_delay <= 0:
                self.exit(-signal.SIGTERM)
            else:
                trio.lowlevel.spawn_system_task(self._exit_later, self.behaviour.term_exit_delay)

    async def _exit_later(self, delay: float) -> None:
        await trio.sleep(delay)
        self.exit(-signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    @property
    def ready(self) -> bool:
        return (
            self.returncode is None
            and not self.hung
            and trio.current_time() >= self.spawned_at + self.behaviour.load_time
        )


class FakeLauncher:
    def __init__(self, behaviour: FakeBehaviour | None = None) -> None:
        self.behaviour = behaviour or FakeBehaviour()
        self.processes: list[FakeProcess] = []
        self.by_port: dict[int, FakeProcess] = {}
        self._next_pid = 1000
        self.fail_spawn: OSError | None = None
        self.http = httpx.AsyncClient(transport=httpx.MockTransport(self._handle))

    async def __call__(self, argv: Sequence[str], env: Mapping[str, str]) -> FakeProcess:
        if self.fail_spawn is not None:
            raise self.fail_spawn
        port = int(argv[list(argv).index("--port") + 1])
        self._next_pid += 1
        proc = FakeProcess(
            pid=self._next_pid, port=port, behaviour=self.behaviour, spawned_at=trio.current_time()
        )
        self.processes.append(proc)
        self.by_port[port] = proc
        if self.behaviour.exit_during_start is not None:
            trio.lowlevel.spawn_system_task(self._exit_at, proc, self.behaviour.exit_during_start)
        return proc

    async def _exit_at(self, proc: FakeProcess, delay: float) -> None:
        await trio.sleep(delay)
        proc.exit(self.behaviour.exit_code)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        port = request.url.port
        proc = self.by_port.get(port) if port is not None else None
        if proc is None or proc.returncode is not None:
            raise httpx.ConnectError("connection refused", request=request)
        if proc.hung:
            raise httpx.ReadTimeout("timed out", request=request)
        if request.url.path == "/health":
            if proc.ready:
                return httpx.Response(200, json={"status": "ok"})
            return httpx.Response(503, json={"error": {"code": 503, "message": "Loading model"}})
        return httpx.Response(404)

    @property
    def last(self) -> FakeProcess:
        return self.processes[-1]


def fake_argv(port: int) -> tuple[list[str], int]:
    return ["fake-llama-server", "--port", str(port), "--parallel", "2"], 2
