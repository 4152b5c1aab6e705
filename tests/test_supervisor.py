"""Supervisor policy on a fake process and Trio's virtual clock (exact times)."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import trio
import trio.testing

from gezel_trio.engine.logs import LogRing
from gezel_trio.engine.supervisor import Engine, EngineState, SupervisorTiming, open_engine
from gezel_trio.errors import EngineFailed, NoCapacity

from .fakes import FakeBehaviour, FakeLauncher, fake_argv

TIMING = SupervisorTiming(
    load_timeout=30.0,
    health_interval=1.0,
    health_timeout=0.5,
    health_failures=3,
    stop_grace=10.0,
    backoff_base=1.0,
    backoff_max=8.0,
    stable_after=30.0,
)


@asynccontextmanager
async def engine_with(
    launcher: FakeLauncher, timing: SupervisorTiming = TIMING, **kw: object
) -> AsyncIterator[Engine]:
    async with open_engine(
        key="m",
        model_id="m",
        http=launcher.http,
        argv_builder=fake_argv,
        timing=timing,
        launcher=launcher,
        **kw,  # type: ignore[arg-type]
    ) as engine:
        yield engine


async def test_lazy_start_reaches_ready_after_health(autojump_clock: trio.abc.Clock) -> None:
    launcher = FakeLauncher(FakeBehaviour(load_time=3.0))
    async with engine_with(launcher) as engine:
        assert engine.state.value is EngineState.STOPPED
        await trio.sleep(5)
        assert launcher.processes == []  # nothing starts before a request
        t0 = trio.current_time()
        await engine.ensure_ready()
        waited = trio.current_time() - t0
        assert engine.state.value is EngineState.READY
        # /health is polled with a growing interval capped at 100 ms
        assert 3.0 <= waited < 3.1
        assert engine.generation == 1
        assert engine.pid == launcher.last.pid
        assert engine.last_ready_seconds is not None and 3.0 <= engine.last_ready_seconds < 3.1


async def test_concurrent_callers_share_one_start(autojump_clock: trio.abc.Clock) -> None:
    launcher = FakeLauncher(FakeBehaviour(load_time=2.0))
    async with engine_with(launcher) as engine, trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(engine.ensure_ready)
    assert len(launcher.processes) == 1


async def test_load_timeout_fails_and_kills(autojump_clock: trio.abc.Clock) -> None:
    launcher = FakeLauncher(FakeBehaviour(load_time=1e9))
    async with engine_with(launcher) as engine:
        t0 = trio.current_time()
        with pytest.raises(EngineFailed, match="did not become healthy within 30s"):
            await engine.ensure_ready()
        assert trio.current_time() - t0 == pytest.approx(30.0)
        assert engine.state.value is EngineState.FAILED
        assert launcher.last.returncode == -signal.SIGKILL


async def test_exit_during_start_names_the_cause(autojump_clock: trio.abc.Clock) -> None:
    launcher = FakeLauncher(FakeBehaviour(load_time=5.0, exit_during_start=1.0, exit_code=1))
    async with engine_with(launcher) as engine:
        engine.log.append("error: failed to load model 'x.gguf'")
        with pytest.raises(
            EngineFailed, match=r"exited during start \(code 1\).*failed to load model"
        ):
            await engine.ensure_ready()
        assert engine.state.value is EngineState.FAILED
        assert "exited during start" in (engine.failure or "")


async def test_spawn_error_is_a_clear_failure(autojump_clock: trio.abc.Clock) -> None:
    launcher = FakeLauncher()
    launcher.fail_spawn = FileNotFoundError(2, "No such file or directory")
    async with engine_with(launcher) as engine:
        with pytest.raises(EngineFailed, match="could not start 'fake-llama-server'"):
            await engine.ensure_ready()
        assert engine.state.value is EngineState.FAILED


async def test_crash_changes_state_at_once_and_restarts_lazily(
    autojump_clock: trio.abc.Clock,
) -> None:
    launcher = FakeLauncher(FakeBehaviour(load_time=1.0))
    async with engine_with(launcher) as engine:
        await engine.ensure_ready()
        first = launcher.last
        t_crash = trio.current_time()
        first.exit(-signal.SIGKILL)
        await engine.state.wait_value(EngineState.FAILED)
        assert trio.current_time() == t_crash  # no polling delay: the exit is awaited
        assert engine.crashes == 1
        assert "SIGKILL" in (engine.last_crash or "")
        # no restart until someone asks
        await trio.sleep(60)
        assert len(launcher.processes) == 1
        t0 = trio.current_time()
        await engine.ensure_ready()
        assert launcher.last is not first
        assert engine.generation == 2
        assert 1.0 <= trio.current_time() - t0 < 1.1  # first crash: no backoff


async def test_repeated_crashes_back_off(autojump_clock: trio.abc.Clock) -> None:
    launcher = FakeLauncher(FakeBehaviour(load_time=1.0))
    async with engine_with(launcher) as engine:
        delays = []
        for _ in range(5):
            t0 = trio.current_time()
            await engine.ensure_ready()
            delays.append(trio.current_time() - t0 - 1.0)  # minus the load time
            launcher.last.exit(1)
            await engine.state.wait_value(EngineState.FAILED)
        # streak 1: immediate; then 1 s, 2 s, 4 s (each measured from the crash)
        assert [round(d) for d in delays] == [0, 0, 1, 2, 4]


async def test_stop_escalates_to_sigkill_after_exact_grace(autojump_clock: trio.abc.Clock) -> None:
    launcher = FakeLauncher(FakeBehaviour(load_time=1.0, ignores_sigterm=True))
    async with engine_with(launcher) as engine:
        await engine.ensure_ready()
        proc = launcher.last
        t0 = trio.current_time()
        await engine.stop()
        assert [(t - t0, s) for t, s in proc.signals] == [
            (0.0, signal.SIGTERM),
            (10.0, signal.SIGKILL),
        ]
        assert engine.state.value is EngineState.STOPPED
        assert proc.returncode == -signal.SIGKILL


async def test_graceful_stop_does_not_kill(autojump_clock: trio.abc.Clock) -> None:
    launcher = FakeLauncher(FakeBehaviour(load_time=1.0, term_exit_delay=2.0))
    async with engine_with(launcher) as engine:
        await engine.ensure_ready()
        t0 = trio.current_time()
        await engine.stop()
        assert trio.current_time() - t0 == pytest.approx(2.0)
        assert [s for _, s in launcher.last.signals] == [signal.SIGTERM]
        assert engine.crashes == 0


async def test_an_exit_during_the_saves_before_a_stop_is_a_crash(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The engine dies (SIGKILL, not the host's) while the host saves its slots before a
    planned stop: the stop still ends STOPPED, and the crash is counted and named."""
    launcher = FakeLauncher(FakeBehaviour(load_time=1.0))
    async with engine_with(launcher) as engine:
        await engine.ensure_ready()
        proc = launcher.last

        async def saves_then_dies() -> None:
            await trio.sleep(0.5)
            proc.exit(-signal.SIGKILL)
            await trio.sleep(0.5)

        engine.before_stop = saves_then_dies
        await engine.stop()
        assert engine.state.value is EngineState.STOPPED
        assert proc.signals == []  # the host never had to signal it
        assert engine.crashes == 1
        assert "SIGKILL" in (engine.last_crash or "") and "during its stop" in (
            engine.last_crash or ""
        )
        # a stop the host signalled is no crash
        engine.before_stop = None
        await engine.ensure_ready()
        await engine.stop()
        assert engine.crashes == 1 and engine.state.value is EngineState.STOPPED


async def test_stop_is_idempotent(autojump_clock: trio.abc.Clock) -> None:
    launcher = FakeLauncher()
    async with engine_with(launcher) as engine:
        t0 = trio.current_time()
        await engine.stop()  # never started
        await engine.stop()
        assert trio.current_time() == t0
        assert engine.state.value is EngineState.STOPPED
        await engine.ensure_ready()
        await engine.stop()
        t1 = trio.current_time()
        await engine.stop()  # already stopped
        assert trio.current_time() == t1
        assert len(launcher.last.signals) == 1


async def test_stop_during_start_returns_and_fails_the_start(
    autojump_clock: trio.abc.Clock,
) -> None:
    # An eviction that lands while the engine is still loading: stop() must come back
    # once the process is down, and the waiting start must fail (it was stopped).
    launcher = FakeLauncher(FakeBehaviour(load_time=5.0, term_exit_delay=1.0))
    errors: list[BaseException] = []

    async def start() -> None:
        try:
            await engine.ensure_ready()
        except EngineFailed as exc:
            errors.append(exc)

    async with engine_with(launcher) as engine, trio.open_nursery() as nursery:
        nursery.start_soon(start)
        await trio.sleep(2)
        assert engine.state.value is EngineState.STARTING
        t0 = trio.current_time()
        with trio.fail_after(30):
            await engine.stop()
        assert engine.state.value is EngineState.STOPPED
        assert launcher.last.returncode is not None
        # the load is abandoned at once: SIGTERM, and the process takes 1 s to exit
        assert trio.current_time() - t0 == pytest.approx(1.0, abs=0.2)
    assert [str(e) for e in errors] == ["engine for model 'm' was stopped"]


async def test_stop_during_restart_backoff_returns_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    launcher = FakeLauncher(FakeBehaviour(load_time=1.0))
    async with engine_with(launcher) as engine, trio.open_nursery() as nursery:
        for _ in range(3):  # a crash streak: the next start waits out a backoff
            await engine.ensure_ready()
            launcher.last.exit(-signal.SIGKILL)
            await engine.state.wait_value(EngineState.FAILED)
        starts = len(launcher.processes)
        nursery.start_soon(_swallow_start, engine)
        await trio.sleep(0.1)
        assert "restart backoff" in (engine.failure or "")
        t0 = trio.current_time()
        with trio.fail_after(30):
            await engine.stop()
        assert trio.current_time() == t0
        assert engine.state.value is EngineState.STOPPED
        assert len(launcher.processes) == starts  # the backoff ended without a start


async def test_stop_withdraws_a_start_not_yet_picked_up(autojump_clock: trio.abc.Clock) -> None:
    # A start was asked for (its caller gave up waiting at once) and stop() came before,
    # or just after, the owner task picked it up: once stop() returns nothing runs, and
    # nothing starts later behind the evictor's back.
    launcher = FakeLauncher(FakeBehaviour(load_time=1.0))
    async with engine_with(launcher) as engine:
        with trio.CancelScope() as scope:
            scope.cancel()
            await engine.ensure_ready()  # asks for the start, then stops waiting
        with trio.fail_after(30):
            await engine.stop()
        assert all(p.returncode is not None for p in launcher.processes)
        await trio.sleep(5)
        assert all(p.returncode is not None for p in launcher.processes)
        assert engine.state.value is EngineState.STOPPED
        before = len(launcher.processes)
        await engine.ensure_ready()  # a later start is not affected
        assert len(launcher.processes) == before + 1
        assert engine.state.value is EngineState.READY


async def _swallow_start(engine: Engine) -> None:
    with pytest.raises(EngineFailed, match="was stopped"):
        await engine.ensure_ready()


async def test_failed_health_checks_kill_a_hung_engine(autojump_clock: trio.abc.Clock) -> None:
    launcher = FakeLauncher(FakeBehaviour(load_time=1.0))
    async with engine_with(launcher) as engine:
        await engine.ensure_ready()
        t0 = trio.current_time()
        launcher.last.hung = True
        await engine.state.wait_value(EngineState.FAILED)
        # three failed checks, one per health interval
        assert 2.0 <= trio.current_time() - t0 <= 3.0
        assert "stopped answering /health" in (engine.failure or "")
        assert [s for _, s in launcher.last.signals] == [signal.SIGKILL]
        await engine.ensure_ready()
        assert engine.state.value is EngineState.READY
        assert len(launcher.processes) == 2


async def test_idle_ttl_releases_the_engine(autojump_clock: trio.abc.Clock) -> None:
    launcher = FakeLauncher(FakeBehaviour(load_time=1.0))
    timing = SupervisorTiming(**{**TIMING.__dict__, "idle_ttl": 30.0})
    async with engine_with(launcher, timing) as engine:
        await engine.ensure_ready()
        with engine.in_use():
            await trio.sleep(100)  # busy: never idle
        assert engine.state.value is EngineState.READY
        t_idle = trio.current_time()
        await engine.state.wait_value(EngineState.STOPPED)
        assert 30.0 <= trio.current_time() - t_idle <= 31.0
        assert engine.crashes == 0


async def test_leaving_the_block_stops_the_process(autojump_clock: trio.abc.Clock) -> None:
    launcher = FakeLauncher(FakeBehaviour(load_time=1.0))
    async with engine_with(launcher) as engine:
        await engine.ensure_ready()
    assert launcher.last.returncode == -signal.SIGTERM


async def test_cancelled_host_stops_a_starting_engine(autojump_clock: trio.abc.Clock) -> None:
    launcher = FakeLauncher(FakeBehaviour(load_time=100.0))
    with trio.move_on_after(5):
        async with engine_with(launcher) as engine:
            await engine.ensure_ready()
    assert launcher.last.returncode is not None


async def test_reservation_wraps_the_process(autojump_clock: trio.abc.Clock) -> None:
    events: list[str] = []
    launcher = FakeLauncher(FakeBehaviour(load_time=1.0))

    @asynccontextmanager
    async def reserve() -> AsyncIterator[None]:
        events.append("reserve")
        try:
            yield
        finally:
            events.append(f"release (process exited: {launcher.last.returncode is not None})")

    async with engine_with(launcher, reserve=reserve) as engine:
        await engine.ensure_ready()
        await engine.stop()
    assert events == ["reserve", "release (process exited: True)"]


async def test_no_capacity_fails_the_start(autojump_clock: trio.abc.Clock) -> None:
    launcher = FakeLauncher()

    @asynccontextmanager
    async def reserve() -> AsyncIterator[None]:
        raise NoCapacity("needs 4 GiB, 1 GiB free")
        yield  # pragma: no cover

    async with engine_with(launcher, reserve=reserve) as engine:
        with pytest.raises(NoCapacity, match="needs 4 GiB"):
            await engine.ensure_ready()
        assert launcher.processes == []
        assert engine.state.value is EngineState.FAILED


async def test_external_engine_reflects_reachability(autojump_clock: trio.abc.Clock) -> None:
    up = {"ok": True}

    def handler(request: httpx.Request) -> httpx.Response:
        if not up["ok"]:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"status": "ok"})

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    async with open_engine(
        key="ext", model_id="ext", http=http, url="http://192.0.2.1:9/", timing=TIMING
    ) as engine:
        await engine.ensure_ready()
        assert engine.state.value is EngineState.READY
        assert engine.base_url == "http://192.0.2.1:9"
        up["ok"] = False
        await engine.state.wait_value(EngineState.FAILED)
        assert "stopped answering" in (engine.failure or "")
        with pytest.raises(EngineFailed, match="unreachable"):
            await engine.ensure_ready()
        up["ok"] = True
        await engine.ensure_ready()
        await engine.stop()
        assert engine.state.value is EngineState.STOPPED


async def test_a_reader_hurries_the_log_pump_out_of_its_gather() -> None:
    """The pump holds what it read for ``gather_s`` (a minute here), so that the lines
    llama-server writes one by one cost one wakeup; a reader that needs the latest lines
    (``/api/models/<id>/logs``) gets what was read and what the pipe holds, at once."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    ring = LogRing()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: ring.pump(trio.lowlevel.FdStream(read_end), gather_s=60.0))
            os.write(write_end, b"one\n")
            await trio.testing.wait_all_tasks_blocked()
            os.write(write_end, b"two\nthree\n")
            await trio.testing.wait_all_tasks_blocked()
            assert ring.tail() == []  # gathering: nothing appended yet
            await ring.caught_up()
            assert ring.tail() == ["one", "two", "three"]
            await ring.caught_up()  # not gathering now: at once
            os.write(write_end, b"four")
            os.close(write_end)
            await trio.testing.wait_all_tasks_blocked()
            await ring.caught_up()  # then the end: the pump returns
    assert ring.tail() == ["one", "two", "three", "four"]
