"""Cancellation injected at every scheduling step of the lease, slot and reservation paths.

An :class:`trio.abc.Instrument` counts task steps (every checkpoint of every task
is one step) from the moment the operation starts, and cancels a scope at the
k-th. Each test repeats for k = 1, 2, ... until the operation completes without
being cancelled, so every point at which a Trio program can be interrupted is
tried once. After each injection: nothing is held (no GPU lease or lease waiter,
no ledger row beyond a running engine's own, no queued or running job, no busy
engine) and the dispatcher still admits the next job.

The components are the real ones (scheduler, ``ModelRuntime`` lane, GPU arbiter
in ``swap`` with evictors, engine supervisor with its ledger reservation, SQLite
ledger); only the engine processes and their HTTP are fakes
(:mod:`tests.fakes`). The clock is real: the ledger runs SQLite in threads, and
a virtual clock would expire its shielded release deadlines while a thread runs.
"""

from __future__ import annotations

import types
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx
import pytest
import trio
import trio.lowlevel
import trio.testing

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.client import EngineClient
from gezel_trio.engine.supervisor import Engine, EngineState, SupervisorTiming, open_engine
from gezel_trio.gpu.arbiter import GpuArbiter
from gezel_trio.gpu.ledger import DeviceLedger, open_ledger
from gezel_trio.host import Host
from gezel_trio.host.metrics import Metrics
from gezel_trio.host.runtime import ModelRuntime, ModelSetup
from gezel_trio.scheduler import Grant, Scheduler, SchedulerSettings, open_scheduler

from .fakes import FakeBehaviour, FakeLauncher, fake_argv

T = TypeVar("T")
MAX_STEPS = 5000  # a path that needs more steps than this is a bug of its own
RESERVE_BYTES = 1 << 20


# --------------------------------------------------------------------------- injection


class CancelAtStep(trio.abc.Instrument):
    """Cancel ``scope`` just before the ``k``-th task step after installation."""

    def __init__(self, k: int, scope: trio.CancelScope) -> None:
        self.k = k
        self.scope = scope
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1
        if self.steps == self.k:
            self.scope.cancel()


@dataclass
class Injection:
    k: int
    cancelled: bool
    steps: int


async def inject(k: int, op: Callable[[], Awaitable[object]]) -> Injection:
    """Run ``op`` and cancel it before the k-th task step (no-op if it finishes first)."""
    scope = trio.CancelScope()
    instrument = CancelAtStep(k, scope)
    trio.lowlevel.add_instrument(instrument)
    try:
        with scope:
            await op()
    finally:
        trio.lowlevel.remove_instrument(instrument)
    return Injection(k, scope.cancelled_caught, instrument.steps)


async def sweep(
    op: Callable[[], Awaitable[object]],
    check: Callable[[Injection], Awaitable[None]],
) -> list[Injection]:
    """``inject`` at k = 1, 2, ... until ``op`` runs to completion; ``check`` after each."""
    results: list[Injection] = []
    for k in range(1, MAX_STEPS):
        result = await inject(k, op)
        await check(result)
        results.append(result)
        if not result.cancelled:
            break
    else:  # pragma: no cover
        raise AssertionError(f"the operation was still cancellable after {MAX_STEPS} steps")
    assert results[-1].k >= 2 and all(r.cancelled for r in results[:-1])
    print(f"{len(results) - 1} cancellation points tried (completed at step {results[-1].k})")
    return results


# --------------------------------------------------------------------------- a small host


class SlotLauncher(FakeLauncher):
    """FakeLauncher whose engines also answer ``GET /slots`` and slot erases."""

    def __init__(self, behaviour: FakeBehaviour, parallel: int = 2) -> None:
        super().__init__(behaviour)
        self.parallel = parallel
        self.erases: list[tuple[int, int, str]] = []  # (port, slot, action)
        self.transport = httpx.MockTransport(self._handle_slots)
        self.http = httpx.AsyncClient(transport=self.transport)

    async def _handle_slots(self, request: httpx.Request) -> httpx.Response:
        # a real request crosses the network: give it checkpoints to be cancelled at
        await trio.lowlevel.checkpoint()
        await trio.lowlevel.checkpoint()
        path = request.url.path
        port = request.url.port
        proc = self.by_port.get(port) if port is not None else None
        if proc is not None and proc.returncode is None and not proc.hung and proc.ready:
            if path == "/slots" and request.method == "GET":
                rows = [{"id": i, "is_processing": False} for i in range(self.parallel)]
                return httpx.Response(200, json=rows)
            if path.startswith("/slots/") and request.method == "POST":
                assert port is not None
                action = request.url.params.get("action", "")
                self.erases.append((port, int(path.rsplit("/", 1)[1]), action))
                return httpx.Response(200, json={"n_erased": 0})
        return self._handle(request)

    def alive(self) -> list[int]:
        return [p.pid for p in self.processes if p.returncode is None]


@dataclass
class Rig:
    """The real components over fake engine processes."""

    ledger: DeviceLedger
    arbiter: GpuArbiter
    scheduler: Scheduler
    launcher: SlotLauncher
    runtimes: dict[str, ModelRuntime]
    shim: Any = field(default=None)

    def engine(self, model: str) -> Engine:
        return self.runtimes[model].engine

    async def run_job(self, model: str, run: Callable[[Grant], Awaitable[T]], session: str) -> T:
        """``run`` inside the host's own ``async with host.slot(...)``, on this rig."""
        async with Host.slot(cast(Host, self.shim), self.runtimes[model], session=session) as grant:
            return await run(grant)


TIMING = SupervisorTiming(load_timeout=10, health_interval=60, health_timeout=1, stop_grace=1)


@asynccontextmanager
async def open_rig(
    tmp: Path, *, capacity: int = 16 * RESERVE_BYTES, blind_handoff: bool = True
) -> AsyncIterator[Rig]:
    """Two models, A and B, in ``swap``: each engine runs inside its ledger reservation
    (``blind_handoff``: the scheduler's setting)."""
    launcher = SlotLauncher(FakeBehaviour(load_time=0.0))
    arbiter = GpuArbiter(policy="swap", lease_wait_poll=1.0)
    async with AsyncExitStack() as stack:
        ledger = await stack.enter_async_context(
            open_ledger(tmp / "ledger.sqlite", capacities={"cpu": capacity})
        )
        runtimes: dict[str, ModelRuntime] = {}
        for model_id in ("A", "B"):

            def reserve(model_id: str = model_id) -> Any:
                return ledger.reservation("cpu", RESERVE_BYTES, owner=model_id, model=model_id)

            engine = await stack.enter_async_context(
                open_engine(
                    key=model_id,
                    model_id=model_id,
                    http=launcher.http,
                    argv_builder=fake_argv,
                    timing=TIMING,
                    launcher=launcher,
                    reserve=reserve,
                )
            )
            config = ModelConfig(id=model_id, path=f"/fake/{model_id}.gguf", parallel=2)
            client = EngineClient(launcher.transport, engine, read_timeout=None, model_id=model_id)
            runtimes[model_id] = ModelRuntime(
                setup=ModelSetup(config), engine=engine, client=client, arbiter=arbiter
            )
            arbiter.register_evictor(model_id, engine.stop, owner_id=model_id)
        scheduler = await stack.enter_async_context(
            open_scheduler(
                lanes=runtimes,
                settings=SchedulerSettings(
                    residency="swap", max_queue=8, slot_poll=0.05, blind_handoff=blind_handoff
                ),
            )
        )
        rig = Rig(ledger, arbiter, scheduler, launcher, runtimes)
        shim = types.SimpleNamespace(scheduler=scheduler, arbiter=arbiter, metrics=Metrics())
        shim._sharing = partial(Host._sharing, shim)  # callerless jobs: it shares nothing
        shim._leading = partial(Host._leading, shim)  # and starts from no lead
        rig.shim = shim
        yield rig
        # Stop the engines before the block cancels them: a cancelled supervisor waits
        # a second for its exit watcher (see the report), which adds up over hundreds of rigs.
        for runtime in runtimes.values():
            await runtime.engine.stop()


def _settled(rig: Rig) -> bool:
    if rig.scheduler.statistics().loading:
        return False
    for model in rig.runtimes:
        engine = rig.engine(model)
        state = engine.state.value
        if state in (EngineState.STARTING, EngineState.STOPPING):
            return False
        if state is not EngineState.READY and engine.pid is not None:
            return False  # the run has not left its reservation yet
    return True


async def settle_engines(rig: Rig) -> None:
    """Let loads that a cancelled caller left under way finish (they go on), and stopped
    runs leave their reservation (see ``test_stop_returns_after_the_release``)."""
    with trio.fail_after(5):
        stable = 0
        while stable < 3:
            stable = stable + 1 if _settled(rig) else 0
            await trio.sleep(0.002)


async def ledger_rows(ledger: DeviceLedger) -> dict[str, int]:
    snap = await ledger.snapshot()
    rows: dict[str, int] = {}
    for usage in snap.devices.values():
        for h in usage.holders:
            rows[h.owner] = rows.get(h.owner, 0) + 1
    return rows


async def assert_nothing_held(rig: Rig) -> None:
    await settle_engines(rig)
    sched = rig.scheduler.statistics()
    assert sched.queued == 0 and not sched.running and not sched.active_ops, sched
    arb = rig.arbiter.statistics()
    assert arb.holders == {} and arb.waiters == (), arb
    for model in rig.runtimes:
        assert rig.engine(model).busy == 0, model
    # a reservation is held exactly while its engine process runs
    rows = await ledger_rows(rig.ledger)
    for model in rig.runtimes:
        engine = rig.engine(model)
        running = engine.state.value is EngineState.READY
        assert rows.get(model, 0) == (1 if running else 0), (model, engine, rows)
    alive = rig.launcher.alive()
    ready = [m for m in rig.runtimes if rig.engine(m).state.value is EngineState.READY]
    assert len(alive) == len(ready), (alive, ready)


async def echo(grant: Grant) -> int | None:
    await trio.lowlevel.checkpoint()
    return grant.slot_id


# --------------------------------------------------------------------------- the paths


@pytest.mark.parametrize("variant", ["swap", "erase", "blind"])
async def test_cancel_at_every_step_of_a_job(tmp_path: Path, variant: str) -> None:
    """The whole job path, cancelled by its submitter at every step.

    ``swap``: B is resident, so A's turn evicts B and starts A inside its ledger
    reservation before the job is admitted. ``erase``: A is resident and both its
    slots hold other chats' KV, so the job's slot is erased (and acknowledged)
    before it runs (``blind_handoff`` off). ``blind``: the same, with the job granted
    blind instead (no erase). All then take a lease and run.
    """
    runs = 0

    async def run(grant: Grant) -> int | None:
        nonlocal runs
        runs += 1
        for _ in range(3):
            await trio.lowlevel.checkpoint()
        return grant.slot_id

    async def one(k: int) -> tuple[bool, int]:
        async with open_rig(tmp_path, blind_handoff=variant != "erase") as rig:
            assert await rig.run_job("A", echo, "other-0") == 0
            assert await rig.run_job("A", echo, "other-1") == 1
            if variant == "swap":
                assert await rig.run_job("B", echo, "b") is not None
                assert rig.engine("A").state.value is EngineState.STOPPED  # evicted
            before = len(rig.launcher.erases)

            async def op() -> None:
                await rig.run_job("A", run, "chat")

            result = await inject(k, op)
            erased = sum(a == "erase" for _, _, a in rig.launcher.erases[before:])
            await assert_nothing_held(rig)
            # the dispatcher still admits the next job, of either model
            with trio.fail_after(5):
                assert await rig.run_job("A", echo, "next") is not None
                assert await rig.run_job("B", echo, "b") is not None
            await assert_nothing_held(rig)
            return result.cancelled, erased
        raise AssertionError("unreachable")  # pragma: no cover

    with trio.fail_after(150):
        k = 1
        while True:
            cancelled, erased = await one(k)
            if not cancelled:
                break
            k += 1
            assert k < MAX_STEPS
    print(f"{variant}: {k - 1} cancellation points tried, {runs} runs started")
    assert k > 5, "suspiciously few steps: is the instrument counting?"
    if variant == "erase":
        assert erased == 1, "the uncancelled run did not go through the erase"
    if variant == "blind":
        assert erased == 0, "the uncancelled run erased: it was not granted blind"


async def test_cancel_at_every_step_shutdown_leaves_nothing(tmp_path: Path) -> None:
    """Cancel the whole rig (a shutdown) at every step of a job that starts an engine:
    afterwards no fake process runs and the ledger file holds no row."""
    with trio.fail_after(120):
        k = 0
        while True:
            k += 1
            assert k < MAX_STEPS
            launcher_box: list[SlotLauncher] = []
            scope = trio.CancelScope()
            finished = False
            instrument: CancelAtStep | None = None
            with scope:
                async with open_rig(tmp_path) as rig:
                    launcher_box.append(rig.launcher)
                    await rig.run_job("B", echo, "b")
                    instrument = CancelAtStep(k, scope)
                    trio.lowlevel.add_instrument(instrument)
                    await rig.run_job("A", echo, "a")
                    finished = True
            if instrument is not None:
                trio.lowlevel.remove_instrument(instrument)
            (launcher,) = launcher_box
            assert launcher.alive() == [], f"k={k}: fake engines still running"
            async with open_ledger(tmp_path / "ledger.sqlite", capacities={"cpu": 1}) as view:
                assert await ledger_rows(view) == {}, f"k={k}: ledger rows left"
            if finished and not scope.cancelled_caught:
                break
        print(f"shutdown: {k - 1} cancellation points tried")
        assert k > 20


async def test_cancel_at_every_step_of_a_lease_wait(tmp_path: Path) -> None:
    """``arbiter.lease`` in swap, waiting behind another class's lease that is released
    a few steps later, then evicting that class: cancelled at every step."""
    evictions: list[str] = []

    async def evict_b() -> None:
        evictions.append("B")
        for _ in range(3):
            await trio.lowlevel.checkpoint()

    arbiter = GpuArbiter(policy="swap", lease_wait_poll=0.5)
    arbiter.register_evictor("B", evict_b, owner_id="b")

    async def op() -> None:
        async with trio.open_nursery() as nursery:
            held = trio.Event()

            async def holder() -> None:
                async with arbiter.lease("B"):
                    held.set()
                    for _ in range(5):
                        await trio.lowlevel.checkpoint()

            nursery.start_soon(holder)
            await held.wait()
            async with arbiter.lease("A"):
                await trio.lowlevel.checkpoint()

    async def check(result: Injection) -> None:
        await trio.testing.wait_all_tasks_blocked()
        stats = arbiter.statistics()
        assert stats.holders == {} and stats.waiters == (), (result, stats)
        with trio.fail_after(2):
            async with arbiter.lease("A") as lease:
                assert arbiter.is_held(lease)
        assert arbiter.statistics().holders == {}

    with trio.fail_after(60):
        results = await sweep(op, check)
    assert len(results) > 10
    assert evictions, "the eviction path was never reached"
    assert arbiter.statistics().broken_leases == 0


async def test_cancel_at_every_step_of_a_reservation(tmp_path: Path) -> None:
    """``ledger.reservation``: SQLite runs in a thread, so a cancel can land while the row
    is being written; it must be deleted again before ``Cancelled`` leaves."""
    async with open_ledger(tmp_path / "r.sqlite", capacities={"cpu": 4 * RESERVE_BYTES}) as ledger:

        async def op() -> None:
            async with ledger.reservation("cpu", RESERVE_BYTES, owner="r", model="r"):
                await trio.lowlevel.checkpoint()

        async def check(result: Injection) -> None:
            assert ledger.statistics().held == 0, result
            assert await ledger_rows(ledger) == {}, result
            async with ledger.reservation("cpu", 4 * RESERVE_BYTES, owner="n", model="n"):
                pass  # the whole budget is free again

        with trio.fail_after(60):
            results = await sweep(op, check)
        stats = ledger.statistics()
        assert stats.admitted == stats.released, stats
        assert len(results) >= 3


async def test_cancel_at_every_step_of_a_queued_job(tmp_path: Path) -> None:
    """A job queued behind a running one (one slot busy per job, capacity two): the
    submitter is cancelled at every step while queued, admitted or running."""
    with trio.fail_after(120):
        async with open_rig(tmp_path) as rig:
            await rig.run_job("A", echo, "warm")
            gate = trio.Event()

            async def blocker(grant: Grant) -> None:
                await gate.wait()

            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(rig.run_job, "A", blocker, f"block-{i}")
                await trio.testing.wait_all_tasks_blocked()
                assert sum(rig.scheduler.statistics().running.values()) == 2

                async def op() -> None:
                    async with trio.open_nursery() as inner:

                        async def release_later() -> None:
                            for _ in range(10):
                                await trio.lowlevel.checkpoint()
                            gate.set()

                        inner.start_soon(release_later)
                        await rig.run_job("A", echo, "queued")

                async def check(result: Injection) -> None:
                    nonlocal gate
                    gate.set()
                    await trio.testing.wait_all_tasks_blocked()
                    await assert_nothing_held(rig)
                    with trio.fail_after(5):
                        assert await rig.run_job("A", echo, "next") is not None
                    gate = trio.Event()
                    for i in range(2):
                        nursery.start_soon(rig.run_job, "A", blocker, f"block-{i}")
                    await trio.testing.wait_all_tasks_blocked()

                results = await sweep(op, check)
                gate.set()
            assert len(results) > 10


async def test_stop_returns_after_the_release(tmp_path: Path) -> None:
    """An evicted engine's bytes are free when its ``stop()`` returns, so a swap on a budget
    that fits one engine at a time never fails for the bytes of the engine it evicted."""
    with trio.fail_after(60):
        async with open_rig(tmp_path, capacity=RESERVE_BYTES) as rig:
            for i in range(20):
                model, other = ("A", "B") if i % 2 == 0 else ("B", "A")
                assert await rig.run_job(model, echo, model) is not None, i
                assert rig.engine(other).state.value is EngineState.STOPPED
            await rig.run_job("B", echo, "b")
            await rig.engine("B").stop()
            assert await ledger_rows(rig.ledger) == {}, "stop() returned before the release"
