"""The engine supervisor: one llama-server process per model, the Trio way.

``async with open_engine(...) as engine`` owns a nursery with one task,
:meth:`Engine._serve`, the only writer of ``engine.state``:

    STOPPED -> STARTING -> READY -> STOPPING -> STOPPED
                  |          |
                  v          v
                FAILED <-----+   (failed start, crash, failed health checks)

Starts are lazy (:meth:`Engine.ensure_ready`), crashes are noticed the moment
the process exits, repeated failures back off, and stops send SIGTERM then
SIGKILL after a grace period. Each run of the process lives inside its memory
reservation (``reserve``), so the reservation is released only after the
process has exited. Leaving the ``async with`` (shutdown, Ctrl-C, cancellation)
stops the process under a shielded deadline: no child outlives the host.

External engines (a ``url``) are never spawned or killed: the supervisor only
health-checks them, and their state says whether they are reachable.

This module is the lifecycle; it composes :mod:`.process` (starting and ending the
process), :mod:`.health` (waiting for a start, checking a running engine) and
:mod:`.external` (an engine the host does not own). Their HTTP is
:mod:`.client`'s.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio
from trio_util import AsyncValue

from .._trio import unwrapping
from ..errors import EngineCrashed, EngineFailed, EngineStopped, GezelError
from .client import read_slot_shape
from .external import check_external, watch_external
from .health import healthy_within, wait_healthy
from .kinds import LLAMA_SERVER, EngineKind
from .logs import LogRing
from .pidfile import reap_orphan, remove_pidfile, write_pidfile
from .ports import free_port, port_in_use
from .process import Launcher, ProcessHandle, describe_exit_code, end_process, spawn_process
from .stats import EngineStats

__all__ = [
    "ArgvBuilder",
    "Engine",
    "EngineState",
    "EngineStats",
    "ReservationFactory",
    "SupervisorTiming",
    "default_slot_save_dir",
    "no_reservation",
    "open_engine",
]

_log = logging.getLogger("gezel_trio.engine.supervisor")


class EngineState(enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"


ArgvBuilder = Callable[[int], tuple[Sequence[str], int]]
"""Given a port, the argv to run and the parallel slots it configures."""
ReservationFactory = Callable[[], AbstractAsyncContextManager[object]]

LOG_GATHER_S = 0.02
"""Seconds the log pump waits after each read of the engine's output, so that the lines
of one request come in one read (see :meth:`LogRing.pump <.logs.LogRing.pump>`)."""


@asynccontextmanager
async def no_reservation() -> AsyncIterator[None]:
    """The reservation of an engine that needs none (external, or a test's)."""
    yield None


@dataclass(frozen=True)
class SupervisorTiming:
    load_timeout: float = 120.0
    health_interval: float = 2.0
    health_timeout: float = 5.0
    health_failures: int = 3
    stop_grace: float = 10.0
    backoff_base: float = 1.0
    backoff_max: float = 30.0
    stable_after: float = 30.0
    """An engine READY this long before it crashes resets the crash streak."""
    idle_ttl: float = 0.0
    park_grace: float = 10.0
    """How long a planned stop may spend in ``before_stop`` (saving slots) before SIGTERM."""


@dataclass
class _Attempt:
    number: int
    done: trio.Event = field(default_factory=trio.Event)
    error: GezelError | None = None

    def finish(self, error: GezelError | None = None) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


class Engine:
    """Handle to one supervised (or external) engine. Create with :func:`open_engine`."""

    def __init__(
        self,
        *,
        key: str,
        model_id: str,
        argv_builder: ArgvBuilder | None,
        url: str | None,
        env: Mapping[str, str],
        http: httpx.AsyncClient,
        timing: SupervisorTiming,
        launcher: Launcher,
        reserve: ReservationFactory,
        log_lines: int,
        pid_file: Path | None = None,
        kind: EngineKind = LLAMA_SERVER,
    ) -> None:
        if (argv_builder is None) == (url is None):
            raise ValueError("an engine is either spawned (argv_builder) or external (url)")
        self.key = key
        self.model_id = model_id
        self.kind = kind
        """The engine program: its health route, whether it has slots to read."""
        self.external = url is not None
        self._argv_builder = argv_builder
        self._env = env
        self._http = http
        self.timing = timing
        self._launcher = launcher
        self._reserve = reserve
        self._pid_file = pid_file
        self.log = LogRing(log_lines)
        self.state: AsyncValue[EngineState] = AsyncValue(EngineState.STOPPED)
        self.failure: str | None = None
        self.port: int | None = None
        self.pid: int | None = None
        self.parallel: int | None = None
        self.n_ctx: int | None = None
        """The context of each slot of the running engine, from its ``/slots`` (or
        ``/props``) read when it turned READY; None while no process runs or it did
        not say. ``parallel`` is corrected from the same reading."""
        self.base_url: str | None = url.rstrip("/") if url else None
        self._process_url = self.base_url or ""
        self.generation = 0
        """Increments every time a new engine process becomes READY (slot ids reset)."""
        self.starts = 0
        self.crashes = 0
        self.crash_streak = 0
        self.last_crash: str | None = None
        self.last_crash_at: float | None = None
        self.ready_at: float | None = None
        self.last_ready_seconds: float | None = None
        """Seconds from spawn to /health 200 on the last start (llama-server's own load time)."""
        self.argv: tuple[str, ...] = ()
        self.last_stop_seconds: float | None = None
        """Seconds from SIGTERM to exit on the last graceful stop."""
        self._busy = 0
        self._in_use: AsyncValue[int] = AsyncValue(0)
        self._last_used = trio.current_time()
        self._attempt_no = 0
        self._current: _Attempt | None = None
        self._next = _Attempt(1)
        self._start_requested = trio.Event()
        self._stop_requested = trio.Event()
        self._signalled = False
        """True once the host has sent the running process its stop signal: an exit
        before that, even during a planned stop, is the engine's own (a crash)."""
        self._stop_reason = "stopped"
        """Why the host ends the process it is stopping (logged when it has exited)."""
        self.closing_reason: str | None = None
        """Why the ``open_engine`` block is being left, for the log (the host sets it when
        it removes the model); None: the host is shutting down."""
        self._wake_monitor = trio.Event()
        self._holding: AsyncValue[bool] = AsyncValue(False)
        """True from the reservation's entry until it has exited."""
        self.before_stop: Callable[[], Awaitable[None]] | None = None
        """Run before a planned stop of a READY process (a stop(), the idle TTL, the host
        shutting down) sends SIGTERM, for at most ``timing.park_grace`` seconds: the
        host saves the slots it owns. Never before a kill (a crash, failed health)."""
        self.last_before_stop_seconds: float | None = None
        self.explain_exit: Callable[[], Awaitable[str | None]] | None = None
        """Asked after the process died on its own: a reason to add to the failure (the
        host names a lost RPC worker). At most 5 s; the failure is recorded first."""

    def __repr__(self) -> str:
        where = self.base_url or "-"
        return f"<Engine {self.key} {self.state.value.value} pid={self.pid} {where}>"

    # ------------------------------------------------------------------ public API

    async def ensure_ready(self) -> None:
        """Start the engine if it is not READY and wait until it is.

        Raises :class:`EngineFailed` (with the engine's last log lines) when the
        start fails, or :class:`NoCapacity` when its memory cannot be reserved.
        Cancelling the caller only stops the waiting: a start already under way
        goes on, and the next caller finds the engine ready.
        """
        while self.state.value is not EngineState.READY:
            if self._current is not None and not self._current.done.is_set():
                attempt = self._current
            else:
                attempt = self._next
                self._start_requested.set()
            await attempt.done.wait()
            if attempt.error is not None:
                raise attempt.error

    async def stop(self) -> None:
        """Stop the engine (SIGTERM, then SIGKILL after the grace) and wait until it is down.

        Idempotent: stopping a stopped or failed engine returns at once. A start
        under way, or asked for and not begun, ends: its waiters get EngineFailed
        ("was stopped"). An external engine is never stopped; this only marks it
        STOPPED. Cancelling the caller abandons the wait; the stop itself goes on.
        """
        if self._start_requested.is_set():
            # A start asked for but not picked up by the owner task yet: withdraw it,
            # so that nothing starts behind the caller's back (an evictor's, typically).
            self._start_requested = trio.Event()
            pending, self._next = self._next, _Attempt(self._next.number)
            pending.finish(EngineStopped(f"engine for model {self.model_id!r} was stopped"))
        attempt = self._current
        if attempt is not None and (
            not attempt.done.is_set()
            or self.state.value not in (EngineState.STOPPED, EngineState.FAILED)
        ):
            self._stop_requested.set()
            self._wake_monitor.set()
            # The attempt first (a start under way ends "stopped"), then the process.
            await attempt.done.wait()
            await self.state.wait_value(lambda s: s in (EngineState.STOPPED, EngineState.FAILED))
        # Return only once the process's reservation is released too: an evictor
        # calls stop() so that another engine can have those bytes.
        await self._holding.wait_value(False)

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Mark the engine busy for the idle-TTL clock while the block runs."""
        self._busy += 1
        self._in_use.value = self._busy
        try:
            yield
        finally:
            self._busy -= 1
            self._in_use.value = self._busy
            self._last_used = trio.current_time()

    @property
    def busy(self) -> int:
        return self._busy

    async def wait_idle(self) -> None:
        """Return once no ``in_use`` block holds the engine (at once if none does).
        Cancellation abandons the wait."""
        await self._in_use.wait_value(0)

    def idle_for(self) -> float:
        return 0.0 if self._busy else trio.current_time() - self._last_used

    def crash_error(self, detail: str) -> EngineCrashed:
        """The error a request in flight gets when the engine dies under it."""
        reason = self.last_crash or detail
        tail = self.log.summary(4)
        msg = f"engine for model {self.model_id!r} failed during the request: {reason}"
        if tail:
            msg += f" (last log lines: {tail})"
        return EngineCrashed(msg)

    def statistics(self) -> EngineStats:
        return EngineStats(
            key=self.key,
            model=self.model_id,
            external=self.external,
            state=self.state.value.value,
            failure=self.failure,
            pid=self.pid,
            port=self.port,
            url=self.base_url,
            parallel=self.parallel,
            n_ctx=self.n_ctx,
            generation=self.generation,
            starts=self.starts,
            crashes=self.crashes,
            crash_streak=self.crash_streak,
            last_crash=self.last_crash,
            busy=self._busy,
            idle_seconds=round(self.idle_for(), 3),
            load_seconds=self.last_ready_seconds,
            stop_seconds=self.last_stop_seconds,
            argv=self.argv,
            log_tail=tuple(self.log.tail(20)),
        )

    # ------------------------------------------------------------------ the owner task

    async def _serve(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        if self._pid_file is not None and self._pid_file.exists():
            await trio.to_thread.run_sync(reap_orphan, self._pid_file)
        task_status.started()
        while True:
            await self._start_requested.wait()
            if not self._start_requested.is_set():
                continue  # withdrawn by stop() before this task ran
            self._start_requested = trio.Event()
            self._stop_requested = trio.Event()
            attempt = self._next
            self._attempt_no += 1
            self._next = _Attempt(self._attempt_no + 1)
            self._current = attempt
            try:
                if self.external:
                    await self._run_external(attempt)
                else:
                    await self._run_managed(attempt)
            finally:
                if not attempt.done.is_set():
                    attempt.finish(
                        EngineFailed(f"engine for model {self.model_id!r} was shut down")
                    )

    def _set(self, state: EngineState, failure: str | None = None) -> None:
        self.failure = failure
        self.state.value = state

    def _event(self, level: int, event: str, message: str, **fields: object) -> None:
        """One lifecycle line in the host's log (``event``: a stable name for machines;
        the engine's own output stays in its log ring)."""
        _log.log(
            level,
            "engine %s %s",
            self.key,
            message,
            extra={"fields": {"event": event, "model": self.model_id, **fields}},
        )

    async def _backoff(self) -> None:
        # The first failure restarts at once; repeated ones wait 1 s, 2 s, 4 s ... up to the cap.
        if self.crash_streak <= 1 or self.last_crash_at is None:
            return
        delay = min(
            self.timing.backoff_max, self.timing.backoff_base * 2 ** (self.crash_streak - 2)
        )
        self._set(
            EngineState.STARTING,
            f"restart backoff {delay:.1f}s after {self.crash_streak} failure(s)",
        )
        self._event(logging.INFO, "engine_backoff", f"restarts in {delay:.1f}s", delay_s=delay)
        with trio.move_on_at(self.last_crash_at + delay):
            await self._stop_requested.wait()

    def _record_failure(self, reason: str) -> None:
        now = trio.current_time()
        if self.ready_at is not None and now - self.ready_at >= self.timing.stable_after:
            self.crash_streak = 0
        self.crash_streak += 1
        self._count_crash(reason)
        self._set(EngineState.FAILED, reason)
        self._event(logging.WARNING, "engine_failed", f"failed: {reason}", reason=reason)

    def _count_crash(self, reason: str) -> None:
        self.crashes += 1
        self.last_crash = reason
        self.last_crash_at = trio.current_time()

    async def _run_managed(self, attempt: _Attempt) -> None:
        assert self._argv_builder is not None
        await self._backoff()
        if self._stop_requested.is_set():
            self._set(EngineState.STOPPED)
            attempt.finish(EngineStopped(f"engine for model {self.model_id!r} was stopped"))
            return
        self._set(EngineState.STARTING)
        self._holding.value = True
        try:
            async with self._reserve():
                await self._run_process(attempt)
        except GezelError as exc:
            # A failed reservation (NoCapacity) or plan: the engine never started.
            if self.state.value is not EngineState.FAILED:
                self.log.append(f"[gezel] {exc.message}")
                self._record_failure(exc.message)
            attempt.finish(exc)
        finally:
            self.pid = None
            # The reservation block has exited: the bytes are free for whoever evicted us.
            self._holding.value = False

    async def _run_process(self, attempt: _Attempt) -> None:
        assert self._argv_builder is not None
        port = free_port()
        try:
            argv, parallel = self._argv_builder(port)
        except GezelError as exc:
            self._set(EngineState.FAILED, exc.message)
            self._event(
                logging.WARNING, "engine_failed", f"failed: {exc.message}", reason=exc.message
            )
            attempt.finish(exc)
            return
        self.argv = tuple(argv)
        self.log.append(f"[gezel] starting: {' '.join(argv)}")
        spawn_at = trio.current_time()
        try:
            proc = await self._launcher(argv, self._env)
        except OSError as exc:
            reason = f"could not start {argv[0]!r}: {exc}"
            self.log.append(f"[gezel] {reason}")
            self._record_failure(reason)
            attempt.finish(
                EngineFailed(f"engine for model {self.model_id!r} failed to start: {reason}")
            )
            return
        self.starts += 1
        self.pid = proc.pid
        self._event(
            logging.INFO,
            "engine_starting",
            f"starting (pid {proc.pid}, port {port})",
            pid=proc.pid,
            port=port,
            argv=list(argv),
        )
        if self._pid_file is not None:
            write_pidfile(self._pid_file, proc.pid)
        self.port = port
        self.parallel = parallel
        # Published only once READY, together with the new generation: nothing can
        # reach a process the host's slot tables do not know yet (a free port can
        # even be the last process's).
        self.base_url = None
        self._process_url = f"http://127.0.0.1:{port}"
        self._signalled = False
        self._stop_reason = "stopped"
        exited = trio.Event()
        log_done = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                if proc.stdout is not None:
                    nursery.start_soon(self._pump_log, proc.stdout, log_done)
                else:
                    log_done.set()
                nursery.start_soon(self._watch_exit, proc, exited)
                try:
                    await self._wait_healthy(proc, exited, log_done)
                except EngineFailed as exc:
                    self._record_failure(exc.message)
                    attempt.finish(exc)
                    self._stop_reason = "killed: its start failed"
                    await self._terminate(proc, exited, graceful=False)
                    nursery.cancel_scope.cancel()
                    return
                if self._stop_requested.is_set():
                    self._stop_reason = "stopped: asked to stop while it started"
                    self._set(EngineState.STOPPING)
                    await self._terminate(proc, exited, graceful=True)
                    self._set(EngineState.STOPPED)
                    attempt.finish(EngineStopped(f"engine for model {self.model_id!r} was stopped"))
                    nursery.cancel_scope.cancel()
                    return
                await self._read_shape(self._process_url)
                self.generation += 1
                self.base_url = self._process_url
                self.ready_at = trio.current_time()
                self.last_ready_seconds = self.ready_at - spawn_at
                self._last_used = self.ready_at
                self.log.append(f"[gezel] ready in {self.last_ready_seconds:.3f}s")
                self._set(EngineState.READY)
                self._event(
                    logging.INFO,
                    "engine_ready",
                    f"ready in {self.last_ready_seconds:.2f}s (pid {proc.pid}, port {port}, "
                    f"{self._shape_text()})",
                    pid=proc.pid,
                    port=port,
                    load_s=round(self.last_ready_seconds, 3),
                )
                attempt.finish()
                await self._monitor(proc, exited)
                nursery.cancel_scope.cancel()
        finally:
            if proc.returncode is None and self.state.value is EngineState.READY:
                # The host is shutting down (cancelled): a planned stop like any other.
                self._stop_reason = f"stopped: {self.closing_reason or 'the host is shutting down'}"
                with trio.move_on_after(self.timing.park_grace + 1, shield=True):
                    self._set(EngineState.STOPPING)
                    await self._run_before_stop(exited)
            self.base_url = None  # nothing more may be sent to this process
            self.n_ctx = None
            if proc.returncode is None:
                # Cancelled (host shutdown) or an unexpected error: never leave the child behind.
                with trio.move_on_after(self.timing.stop_grace + 5, shield=True):
                    self._set(EngineState.STOPPING)
                    await self._terminate(proc, exited, graceful=True)
                if proc.returncode is None:  # pragma: no cover - the deadline passed
                    with contextlib.suppress(OSError):
                        proc.kill()
                self._set(EngineState.STOPPED)

    async def _watch_exit(self, proc: ProcessHandle, exited: trio.Event) -> None:
        code = await proc.wait()
        exited.set()
        if self._pid_file is not None:
            remove_pidfile(self._pid_file)
        self.log.append(f"[gezel] process {proc.pid} exited with code {code}")
        if self._signalled:
            return  # _terminate logs it (this task may be cancelled by now)
        reason = f"engine process exited unexpectedly (code {describe_exit_code(code)})"
        if self.state.value is EngineState.READY:
            self._record_failure(reason)
            self._wake_monitor.set()
            await self._explain_failure()
        elif self.state.value is EngineState.STOPPING:
            # It died while the host saved its slots before a planned stop: the stop goes
            # on and ends STOPPED, but the exit was the engine's own.
            reason = f"{reason} during its stop"
            self._count_crash(reason)
            self._event(logging.WARNING, "engine_failed", f"failed: {reason}", reason=reason)

    async def _explain_failure(self) -> None:
        """Add what ``explain_exit`` finds (a lost RPC worker) to the recorded failure."""
        hook = self.explain_exit
        if hook is None:
            return
        with trio.move_on_after(5):
            why = await hook()
            if why:
                self.log.append(f"[gezel] {why}")
                self.last_crash = f"{why}: {self.last_crash}"
                if self.state.value is EngineState.FAILED:
                    self.failure = self.last_crash

    async def _pump_log(self, stream: trio.abc.ReceiveStream, done: trio.Event) -> None:
        try:
            await self.log.pump(stream, gather_s=LOG_GATHER_S)
        finally:
            done.set()

    async def _wait_healthy(
        self, proc: ProcessHandle, exited: trio.Event, log_done: trio.Event
    ) -> None:
        """Wait (:func:`.health.wait_healthy`) until ``/health`` answers 200 or a stop is
        requested. Raises :class:`EngineFailed` when the process exits first (with its
        last log lines) or time runs out. Cancellation abandons the wait."""
        outcome = await wait_healthy(
            self._http,
            self._process_url,
            exited=exited,
            stopping=lambda: self._stop_requested.is_set(),
            within=self.timing.load_timeout,
            check_timeout=self.timing.health_timeout,
            path=self.kind.health_path,
        )
        if outcome == "exited":
            # Its last words (why it exited) may still be in the pipe: the pipe closes
            # with the process, so this returns at once unless the machine is starved
            # (2 s was too short under a load of 7 on 2 cores).
            with trio.move_on_after(10):
                await log_done.wait()
            if self.port is not None and port_in_use(self.port):
                # the free-port race, lost: say so, whatever the engine managed to log
                # (llama-server logs from a thread, and may exit before it wrote a line)
                self.log.append(
                    f"[gezel] port {self.port} is taken by another process "
                    "(address already in use): the engine could not bind it"
                )
            code = proc.returncode
            raise EngineFailed(
                f"engine for model {self.model_id!r} exited during start "
                f"(code {describe_exit_code(code)}): {self.log.summary()}"
            )
        if outcome == "timeout":
            await self.log.caught_up()
            raise EngineFailed(
                f"engine for model {self.model_id!r} did not become healthy within "
                f"{self.timing.load_timeout:g}s: {self.log.summary()}"
            )

    async def _monitor(self, proc: ProcessHandle, exited: trio.Event) -> None:
        """While READY: watch for exit, failed health checks, a stop request and idle TTL."""
        assert self.base_url is not None
        base_url = self.base_url
        failures = 0
        interval = self.timing.health_interval
        if self.timing.idle_ttl > 0:
            interval = min(interval, self.timing.idle_ttl)
        next_check = trio.current_time() + self.timing.health_interval
        while True:
            self._wake_monitor = trio.Event()
            if exited.is_set():
                return  # _watch_exit recorded the crash
            if self._stop_requested.is_set():
                self._stop_reason = "stopped on request (unload, eviction, reload or release)"
                await self._stop_gracefully(proc, exited)
                return
            ttl = self.timing.idle_ttl
            if ttl > 0 and self._busy == 0 and trio.current_time() - self._last_used >= ttl:
                self.log.append(f"[gezel] idle for {ttl:g}s: releasing")
                self._stop_reason = f"stopped: idle for {ttl:g}s (idle_ttl)"
                await self._stop_gracefully(proc, exited)
                return
            now = trio.current_time()
            if now >= next_check:
                next_check = now + self.timing.health_interval
                healthy = await healthy_within(
                    self._http,
                    base_url,
                    within=self.timing.health_timeout,
                    path=self.kind.health_path,
                )
                if exited.is_set():
                    return
                failures = 0 if healthy else failures + 1
                if failures >= self.timing.health_failures:
                    reason = (
                        f"engine stopped answering {self.kind.health_path} "
                        f"({failures} checks failed): killed"
                    )
                    self.log.append(f"[gezel] {reason}")
                    self._stop_reason = reason
                    self._record_failure(reason)
                    await self._terminate(proc, exited, graceful=False)
                    return
            wake_at = min(next_check, now + interval) if ttl > 0 else next_check
            with trio.move_on_at(wake_at):
                await self._wake_monitor.wait()

    async def _stop_gracefully(self, proc: ProcessHandle, exited: trio.Event) -> None:
        self._set(EngineState.STOPPING)
        await self._run_before_stop(exited)
        t0 = trio.current_time()
        await self._terminate(proc, exited, graceful=True)
        self.last_stop_seconds = trio.current_time() - t0
        self.crash_streak = 0
        self._set(EngineState.STOPPED)

    async def _run_before_stop(self, exited: trio.Event) -> None:
        """``before_stop`` with its deadline; its failure is logged, never raised (the
        stop goes on). The process is still reachable at ``base_url`` meanwhile."""
        hook = self.before_stop
        if hook is None or exited.is_set() or self.base_url is None:
            return
        t0 = trio.current_time()
        with trio.move_on_after(self.timing.park_grace) as scope:
            try:
                await hook()
            except Exception as exc:
                self.log.append(f"[gezel] before the stop: {exc!r}")
                _log.warning("engine %s: before the stop: %r", self.key, exc)
        if scope.cancelled_caught:
            self.log.append(f"[gezel] before the stop: cut after {self.timing.park_grace:g}s")
        self.last_before_stop_seconds = trio.current_time() - t0

    async def _terminate(self, proc: ProcessHandle, exited: trio.Event, *, graceful: bool) -> None:
        """SIGTERM, SIGKILL after the grace (at once when not graceful); wait for the exit,
        and log it with its reason. Cancellation abandons the wait (callers shield it)."""
        self._signalled = True
        if proc.returncode is None:
            t0 = trio.current_time()
            await end_process(
                proc, graceful=graceful, grace=self.timing.stop_grace, note=self.log.append
            )
            code = proc.returncode
            self._event(
                logging.INFO,
                "engine_exited",
                f"exited (pid {proc.pid}, code {describe_exit_code(code)}, after "
                f"{trio.current_time() - t0:.2f}s): {self._stop_reason}",
                pid=proc.pid,
                code=code,
                reason=self._stop_reason,
            )
        if not exited.is_set() and proc.returncode is None:
            with trio.move_on_after(1):
                await exited.wait()

    async def _run_external(self, attempt: _Attempt) -> None:
        """An engine we do not own (:mod:`.external`): READY while ``/health`` answers
        200, FAILED otherwise."""
        assert self.base_url is not None
        base_url = self.base_url
        self._set(EngineState.STARTING)
        reason = await check_external(
            self._http, base_url, answer_within=self.timing.health_timeout
        )
        if reason is not None:
            self._record_failure(reason)
            attempt.finish(EngineFailed(reason))
            return
        await self._read_shape(base_url)
        self.generation += 1
        self.ready_at = trio.current_time()
        self._set(EngineState.READY)
        self._event(
            logging.INFO, "engine_ready", f"ready (external, at {base_url}, {self._shape_text()})"
        )
        attempt.finish()
        reason = await watch_external(
            self._http,
            base_url,
            interval=self.timing.health_interval,
            answer_within=self.timing.health_timeout,
            failures=self.timing.health_failures,
            nap=self._nap,
            stop_requested=lambda: self._stop_requested.is_set(),
        )
        self.n_ctx = None
        if reason is None:
            self._set(EngineState.STOPPED)
        else:
            self._record_failure(reason)

    async def _read_shape(self, base_url: str) -> None:
        """Learn the slots and each one's context from the engine that just answered
        ``/health`` (:func:`.client.read_slot_shape`): what the host reports and
        limits by is what the engine runs. Unknown (None) when it does not say.
        Cancellation abandons the reading. An engine kind without slots: nothing to read."""
        if not self.kind.slot_shape:
            return
        shape = await read_slot_shape(
            self._http, base_url, answer_within=max(1.0, self.timing.health_timeout)
        )
        self.n_ctx = shape.n_ctx if shape is not None else None
        if shape is not None and shape.slots != self.parallel:
            if self.parallel is not None:
                self.log.append(f"[gezel] the engine runs {shape.slots} slots, not {self.parallel}")
            self.parallel = shape.slots

    def _shape_text(self) -> str:
        slots = f"{self.parallel} slot{'s' if self.parallel != 1 else ''}"
        return f"{slots} of {self.n_ctx} tokens" if self.n_ctx else slots

    async def _nap(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if a stop request or an exit wakes the monitor."""
        self._wake_monitor = trio.Event()
        with trio.move_on_after(seconds):
            await self._wake_monitor.wait()


@asynccontextmanager
async def open_engine(
    *,
    key: str,
    model_id: str,
    http: httpx.AsyncClient,
    argv_builder: ArgvBuilder | None = None,
    url: str | None = None,
    env: Mapping[str, str] | None = None,
    timing: SupervisorTiming | None = None,
    launcher: Launcher = spawn_process,
    reserve: ReservationFactory = no_reservation,
    log_lines: int = 400,
    pid_file: Path | None = None,
    kind: EngineKind = LLAMA_SERVER,
) -> AsyncIterator[Engine]:
    """Supervise one engine for the duration of the block.

    On exit (normal, error or cancellation) the process is stopped under a
    shielded deadline and the reservation released after it has exited.
    Errors leave as themselves, never as an exception group; cancellation
    leaves as a :class:`trio.Cancelled`.
    """
    engine = Engine(
        key=key,
        model_id=model_id,
        argv_builder=argv_builder,
        url=url,
        env=dict(os.environ) if env is None else env,
        http=http,
        timing=timing or SupervisorTiming(),
        launcher=launcher,
        reserve=reserve,
        log_lines=log_lines,
        pid_file=pid_file,
        kind=kind,
    )
    async with unwrapping(), trio.open_nursery() as nursery:
        await nursery.start(engine._serve)
        try:
            yield engine
        finally:
            nursery.cancel_scope.cancel()


def default_slot_save_dir(state_dir: Path, key: str) -> Path:
    d = state_dir / "slots" / key
    d.mkdir(parents=True, exist_ok=True)
    return d
