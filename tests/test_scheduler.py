"""The scheduler's Trio layer against a fake engine, in virtual time.

Every test runs under ``autojump_clock``: time only moves when every task is
blocked, so the asserted start times are exact. The fake engine's ``/slots``
reflects the jobs it is running; it records every erase, arrival and handoff, and
flags a *bleed* whenever a job lands on a slot that still holds another chat's KV.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import trio
import trio.testing

from gezel_trio.errors import EngineFailed, EngineStopped, QueueFull, UnknownModel
from gezel_trio.kv.lead import Lead, LeadStart
from gezel_trio.kv.prefix import Prefix
from gezel_trio.scheduler import (
    ActiveOp,
    Grant,
    JobKind,
    Scheduler,
    SchedulerClosed,
    SchedulerSettings,
    SlotMeasurement,
    hash_session,
    open_scheduler,
)
from gezel_trio.scheduler.slots import Content

# --------------------------------------------------------------------------- fake engine


@dataclass
class Record:
    """What happened to one submitted job."""

    model: str
    session: str | None
    kind: str
    submitted: float
    label: str = ""
    grant: Grant | None = None
    start: float | None = None  # run() called
    arrive: float | None = None  # reached the engine (took a slot)
    end: float | None = None
    slot: int | None = None
    cached: bool = False  # landed on a slot holding its own session's KV
    error: BaseException | None = None
    cancelled: bool = False


@dataclass
class Slot:
    id: int
    busy: str | None = None  # label of the job on it
    kv: str | None = None  # whose KV the slot holds


class FakePool:
    """Stand-in for the engine pool: with ``swap`` only one engine is resident and a
    switch requires the outgoing engine to be idle (a violation is recorded otherwise)."""

    def __init__(self, *, swap: bool = True) -> None:
        self.swap = swap
        self.resident: set[str] = set()
        self.lanes: dict[str, FakeLane] = {}
        self.events: list[tuple[float, str, str]] = []  # (time, what, detail)
        self.violations: list[str] = []

    def note(self, what: str, detail: str) -> None:
        self.events.append((trio.current_time(), what, detail))


class FakeLane:
    """An EngineLane over a fake llama-server with ``parallel`` slots."""

    def __init__(
        self,
        pool: FakePool,
        model_id: str,
        *,
        parallel: int = 2,
        load_time: float = 0.0,
        erase_time: float = 0.0,
        arrive_delay: float = 0.0,
        measure: Literal["ids", "count", "none", "raise", "hang"] = "ids",
        display_name: str | None = None,
        restart_on_load: bool = True,
        sole_client: bool = False,
    ) -> None:
        self.pool = pool
        self.model_id = model_id
        self.display_name = display_name or model_id.upper()
        self._parallel = parallel
        self._generation = 0
        self.load_time = load_time
        self.erase_time = erase_time
        self.arrive_delay = arrive_delay
        self.measure = measure
        self.restart_on_load = restart_on_load
        self.sole_client = sole_client
        self.family: str | None = None
        self.failed = trio.Event()  # set: the engine failed (wait_failed returns)
        self.holds = 0
        self.slots = [Slot(i) for i in range(parallel)]
        self.external: set[int] = set()  # slots busy with traffic we did not schedule
        self.fail_loads = 0
        self.load_error: Exception = EngineFailed(f"{model_id} failed to start")
        self.erase_error: Exception | None = None
        self.answer_nothing = False  # its requests fail before the engine generates
        self.ensure_calls: list[float] = []
        self.loads: list[float] = []
        self.measure_calls = 0
        self.erases: list[tuple[float, int]] = []
        self.bleeds: list[str] = []
        self.deferred: list[str] = []
        self._freed = trio.Event()
        pool.lanes[model_id] = self

    @property
    def parallel(self) -> int:
        return self._parallel

    @property
    def slot_count(self) -> int:
        return len(self.slots)

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def ready(self) -> bool:
        return self.model_id in self.pool.resident

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        self.holds += 1
        try:
            yield
        finally:
            self.holds -= 1

    def lease(self) -> AbstractAsyncContextManager[object]:
        return contextlib.nullcontext()  # type: ignore[return-value]

    def busy_count(self) -> int:
        return sum(1 for s in self.slots if s.busy is not None)

    def restart(self) -> None:
        """The engine restarts: new generation, every slot empty."""
        self._generation += 1
        for slot in self.slots:
            slot.kv = None

    async def wait_failed(self) -> None:
        await self.failed.wait()

    def resident_now(self) -> bool:
        return self.ready and not self.fail_loads

    async def ensure_resident(self) -> None:
        self.ensure_calls.append(trio.current_time())
        if self.fail_loads:
            self.fail_loads -= 1
            await trio.sleep(self.load_time)
            raise self.load_error
        if self.model_id in self.pool.resident:
            await trio.lowlevel.checkpoint()
            return
        if self.pool.swap:
            for other_id in list(self.pool.resident):
                other = self.pool.lanes[other_id]
                if other.busy_count():
                    self.pool.violations.append(
                        f"{trio.current_time()}: switched to {self.model_id} while {other_id} busy"
                    )
                self.pool.resident.discard(other_id)
                self.pool.note("evict", other_id)
        await trio.sleep(self.load_time)
        if self.restart_on_load or not self.loads:
            self.restart()
        self.loads.append(trio.current_time())
        self.pool.resident.add(self.model_id)
        self.pool.note("load", self.model_id)

    async def measure_slots(self) -> SlotMeasurement | None:
        self.measure_calls += 1
        await trio.lowlevel.checkpoint()
        if self.measure == "none":
            return None
        if self.measure == "raise":
            raise OSError("connection refused")
        if self.measure == "hang":
            await trio.sleep_forever()
        idle = tuple(s.id for s in self.slots if s.busy is None and s.id not in self.external)
        if self.measure == "count":
            return SlotMeasurement(idle=len(idle))
        return SlotMeasurement(idle=len(idle), ids=idle)

    async def erase_slot(self, slot_id: int) -> None:
        await trio.sleep(self.erase_time)
        if self.erase_error is not None:
            raise self.erase_error
        self.slots[slot_id].kv = None
        self.erases.append((trio.current_time(), slot_id))
        self.pool.note("erase", f"{self.model_id}:{slot_id}")

    def _idle(self) -> Slot | None:
        for slot in self.slots:
            if slot.busy is None and slot.id not in self.external:
                return slot
        return None

    async def _take(self, grant: Grant, label: str) -> Slot:
        if grant.slot_id is not None:
            slot = self.slots[grant.slot_id]
            if slot.busy is not None or slot.id in self.external:
                self.deferred.append(label)  # the engine defers a task pinned to a busy slot
            while slot.busy is not None or slot.id in self.external:
                await self._freed.wait()
            return slot
        while (free := self._idle()) is None:
            self.deferred.append(label)
            await self._freed.wait()
        return free

    def _release(self, slot: Slot) -> None:
        slot.busy = None
        self._freed.set()
        self._freed = trio.Event()

    async def complete(self, grant: Grant, rec: Record, duration: float) -> Record:
        """The body of a completion job: reach the engine, hold a slot, finish."""
        rec.grant = grant
        rec.start = trio.current_time()
        if self.pool.swap and self.pool.resident != {self.model_id}:
            self.pool.violations.append(f"{rec.label} sent to non-resident {self.model_id}")
        try:
            if self.arrive_delay:
                await trio.sleep(self.arrive_delay)
            slot = await self._take(grant, rec.label)
            rec.arrive = trio.current_time()
            rec.slot = slot.id
            me = rec.session if rec.session is not None else f"<keyless {rec.label}>"
            # a blind (keyless) job is sent with cache_prompt off: it reads nothing there
            if slot.kv is not None and slot.kv != me and not grant.blind:
                self.bleeds.append(f"{rec.label} landed on slot {slot.id} holding {slot.kv}")
            rec.cached = slot.kv == me and rec.session is not None and not grant.blind
            slot.busy = rec.label
            slot.kv = me
            if not self.answer_nothing:
                grant.answered()  # it "generated": a blind request emptied the slot first
            self.pool.note("arrive", f"{rec.label}@{self.model_id}:{slot.id}")
            try:
                await trio.sleep(duration)
            finally:
                self._release(slot)
            return rec
        except trio.Cancelled:
            rec.cancelled = True
            raise
        finally:
            rec.end = trio.current_time()

    async def exclusive(self, grant: Grant, rec: Record, duration: float) -> Record:
        """The body of a calibrate/sweep/benchmark: must find the engine drained."""
        rec.grant = grant
        rec.start = trio.current_time()
        busy = sum(lane.busy_count() for lane in self.pool.lanes.values())
        if busy:
            self.pool.violations.append(f"{rec.label} started with {busy} busy slots")
        try:
            await trio.sleep(duration)
            return rec
        finally:
            rec.end = trio.current_time()


class Harness:
    def __init__(self, scheduler: Scheduler, nursery: trio.Nursery) -> None:
        self.scheduler = scheduler
        self.nursery = nursery
        self.records: list[Record] = []

    def submit(
        self,
        lane: FakeLane,
        *,
        at: float = 0.0,
        session: str | None = None,
        duration: float = 1.0,
        kind: JobKind = "completion",
        label: str = "",
        body: Callable[[Grant], Awaitable[object]] | None = None,
    ) -> Record:
        """Submit a job ``at`` seconds from now (virtual); returns its record."""
        rec = Record(lane.model_id, session, kind, submitted=-1.0, label=label)
        self.records.append(rec)

        async def go() -> None:
            await trio.sleep(at)
            rec.submitted = trio.current_time()
            if body is not None:
                run = body
            elif kind == "completion":

                async def run(grant: Grant) -> object:
                    return await lane.complete(grant, rec, duration)
            else:

                async def run(grant: Grant) -> object:
                    return await lane.exclusive(grant, rec, duration)

            try:
                await self.scheduler.submit(lane.model_id, run, session=session, kind=kind)
            except Exception as exc:
                rec.error = exc

        self.nursery.start_soon(go)
        return rec


def overlaps(a: Record, b: Record) -> bool:
    assert a.start is not None and a.end is not None and b.start is not None and b.end is not None
    return a.start < b.end and b.start < a.end


@asynccontextmanager
async def running(lanes: dict[str, FakeLane], **options: Any) -> AsyncIterator[Harness]:
    """A scheduler plus a nursery for the test's submitters, bounded in virtual time
    (so a test of a broken scheduler fails instead of hanging). Handoffs erase unless
    a test asks for ``blind_handoff``: most tests here check the erase path (the
    ``[scheduler] blind_handoff = false`` configuration); a background save starts as
    its job is released unless a test asks for ``save_idle_delay``."""
    options.setdefault("blind_handoff", False)
    options.setdefault("save_idle_delay", 0.0)  # a save at the release, in the same step
    with trio.fail_after(1000):
        settings = SchedulerSettings(**options)
        async with open_scheduler(lanes=lanes, settings=settings) as s, trio.open_nursery() as n:
            yield Harness(s, n)


@pytest.fixture
def pool() -> FakePool:
    return FakePool()


# --------------------------------------------------------------------------- 1. residency


async def test_swap_runs_one_model_at_a_time_and_switches_from_a_drained_engine(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=2, load_time=1.0)
    b = FakeLane(pool, "b", parallel=2, load_time=1.0)
    async with running({"a": a, "b": b}) as h:
        s = h.scheduler
        t0 = trio.current_time()
        a1 = h.submit(a, duration=4.0, label="a1")
        a2 = h.submit(a, duration=4.0, label="a2")
        b1 = h.submit(b, at=1.0, duration=2.0, label="b1")
        a3 = h.submit(a, at=2.0, duration=1.0, label="a3")
    assert [r.error for r in h.records] == [None] * 4  # never refused for "wrong model"
    # a loads (1 s) and runs a1+a2 until 5; b1 (queued at 1) switches the engine at 5
    # (loads 1 s), a3 (queued behind b1 at 2) switches back when b drains at 8.
    assert (a1.start, a2.start) == (t0 + 1.0, t0 + 1.0)
    assert b1.start == t0 + 6.0
    assert a3.start == t0 + 9.0
    assert [t - t0 for t in b.ensure_calls] == [5.0]
    assert [t - t0 for t in a.ensure_calls] == [0.0, 8.0]
    assert not any(overlaps(x, y) for x in (a1, a2, a3) for y in (b1,))
    assert pool.violations == []
    assert s.statistics().switches == 2


async def test_coexist_gives_each_model_its_own_turns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = FakePool(swap=False)
    a = FakeLane(pool, "a", parallel=2, load_time=1.0)
    b = FakeLane(pool, "b", parallel=2, load_time=1.0)
    async with running({"a": a, "b": b}, residency="coexist") as h:
        t0 = trio.current_time()
        a1 = h.submit(a, duration=4.0)
        b1 = h.submit(b, at=1.0, duration=2.0)
    assert a1.start == t0 + 1.0
    assert b1.start == t0 + 2.0  # its own load, not a's drain
    assert overlaps(a1, b1)


# --------------------------------------------------------------------------- 2. exclusivity


async def test_exclusive_op_drains_then_runs_alone(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=2)
    seen: list[ActiveOp | None] = []
    async with running({"a": a}) as h:
        s = h.scheduler
        t0 = trio.current_time()
        a1 = h.submit(a, duration=4.0, label="a1")
        a2 = h.submit(a, duration=4.0, label="a2")
        bench = h.submit(a, at=1.0, duration=3.0, kind="benchmark", label="bench")
        a3 = h.submit(a, at=2.0, duration=1.0, label="a3")

        async def probe() -> None:
            await trio.sleep(5.0)
            seen.append(s.statistics().active)

        h.nursery.start_soon(probe)
    assert bench.start == t0 + 4.0  # after a1 and a2 drained
    assert bench.grant is not None and bench.grant.slot_id is None
    assert a3.start == t0 + 7.0  # nothing admitted while the benchmark ran
    assert not any(overlaps(bench, r) for r in (a1, a2, a3))
    assert seen == [ActiveOp("a", "benchmark")]
    assert pool.violations == []


# --------------------------------------------------------------------------- 3. the open turn


async def test_open_turn_admits_a_late_same_model_job_at_once(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=2, load_time=0.5)
    async with running({"a": a}) as h:
        t0 = trio.current_time()
        a1 = h.submit(a, duration=2.0)
        a2 = h.submit(a, at=1.0, duration=2.0)  # joins the running turn
        a3 = h.submit(a, at=4.5, duration=1.0)  # joins the drained, still open turn
    assert a1.start == t0 + 0.5
    assert a2.start == t0 + 1.0  # a free slot at once, not after a1's batch
    assert a3.start == t0 + 4.5
    assert len(a.loads) == 1 and a.generation == 1  # the engine never switched
    assert {a1.slot, a2.slot} == {0, 1}


async def test_a_job_for_an_idle_resident_engine_is_granted_by_the_pass_that_sees_it(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    # An idle turn forgets that its engine was loaded. A job that finds the engine
    # still resident needs no load: it is granted by the pass that sees it, with no
    # ensure_resident call and no load task (which would cost another pass).
    a = FakeLane(pool, "a", parallel=2, load_time=0.5)
    async with running({"a": a}) as h:
        a1 = h.submit(a, duration=1.0)
        a2 = h.submit(a, at=5.0, duration=1.0)  # a1 is done, the engine idle, resident
    assert a1.error is None and a2.error is None
    assert len(a.ensure_calls) == 1 and len(a.loads) == 1
    assert a2.start == a2.submitted

    # an engine that is not resident any more is loaded again, as before
    pool.resident.clear()
    async with running({"a": a}) as h:
        h.submit(a, duration=1.0)
    assert len(a.ensure_calls) == 2 and len(a.loads) == 2


# --------------------------------------------------------------------------- 4. fairness


async def test_steady_stream_for_a_cannot_starve_b(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=2)
    b = FakeLane(pool, "b", parallel=2)
    async with running({"a": a, "b": b}) as h:
        t0 = trio.current_time()
        stream = [h.submit(a, at=2.0 * i, duration=3.0, label=f"a{i}") for i in range(7)]
        b1 = h.submit(b, at=4.5, duration=1.0, label="b1")
    assert b1.start is not None and b1.end is not None
    running_at_b = [
        r
        for r in stream
        if r.start is not None and r.end is not None and r.start <= b1.submitted < r.end
    ]
    assert len(running_at_b) == 2
    # B waits exactly as long as A's already-running jobs take ...
    assert b1.start == max(r.end for r in running_at_b if r.end is not None) == t0 + 7.0
    # ... and no A job submitted after B gets in ahead of it.
    later = [r for r in stream if r.submitted > b1.submitted]
    assert later and all(r.start is not None and r.start >= b1.end for r in later)
    assert pool.violations == []


async def test_next_turn_prefers_a_model_other_than_the_one_that_just_ran(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=2)
    c = FakeLane(pool, "c", parallel=2)
    async with running({"a": a, "c": c}) as h:
        t0 = trio.current_time()
        h.submit(a, duration=2.0, label="a1")
        bench = h.submit(a, at=0.5, duration=1.0, kind="calibrate", label="cal")
        a2 = h.submit(a, at=1.0, duration=1.0, label="a2")
        c1 = h.submit(c, at=1.5, duration=1.0, label="c1")
    assert bench.start == t0 + 2.0
    # a just had the engine (a1, then its calibration): c goes first although a2 is older
    assert c1.start == t0 + 3.0
    assert a2.start == t0 + 4.0


# --------------------------------------------------------------------------- 5. capacity


async def test_capacity_is_min_of_ceiling_and_measured_idle_never_both(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=2)
    async with running({"a": a}) as h:
        s = h.scheduler
        t0 = trio.current_time()
        j1 = h.submit(a, duration=10.0)
        j2 = h.submit(a, at=1.0, duration=20.0)  # idle=1, parallel-running=1 -> admitted
        j3 = h.submit(a, at=3.0, duration=1.0)  # both slots ours -> waits for j1
    assert j1.start == t0
    assert j2.start == t0 + 1.0  # "idle - running" would have said 0 here
    assert j3.start == t0 + 10.0
    assert s.statistics().slot_polls == 0  # our running job's settle woke the dispatcher


async def test_capacity_respects_slots_taken_by_traffic_we_did_not_send(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=3)
    a.external.add(2)
    async with running({"a": a}) as h:
        s = h.scheduler
        t0 = trio.current_time()
        jobs = [h.submit(a, duration=1.0) for _ in range(3)]
    starts = sorted(r.start - t0 for r in jobs if r.start is not None)
    assert starts == [0.0, 0.0, 1.0]
    assert a.deferred == [] and {r.slot for r in jobs} == {0, 1}
    assert s.statistics().slot_polls == 0


async def test_spawned_engine_admits_from_its_table_without_sampling(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    # The host is the only client of an engine it spawned: pins come from the slot
    # table, so even an engine whose /slots hangs serves every request pinned.
    a = FakeLane(pool, "a", parallel=2, measure="hang", sole_client=True)
    async with running({"a": a}) as h:
        t0 = trio.current_time()
        jobs = [h.submit(a, session=f"chat-{i}", duration=1.0) for i in range(3)]
    starts = sorted(r.start - t0 for r in jobs if r.start is not None)
    assert starts == [0.0, 0.0, 1.0]
    pins = [r.grant.slot_id for r in jobs if r.grant is not None]
    assert None not in pins and set(pins) == {0, 1}
    # one background reconciliation of the new engine (it hangs), none on the request
    # path: the jobs started at once
    assert a.measure_calls == 1
    assert a.bleeds == [] and a.deferred == []


async def test_external_engine_without_named_ids_admits_nothing_until_it_names_them(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=2, measure="count")
    async with running({"a": a}, slot_poll=0.25) as h:
        s = h.scheduler
        t0 = trio.current_time()
        jobs = [h.submit(a, session=f"chat-{i}", duration=1.0) for i in range(3)]

        async def names_its_slots_later() -> None:
            await trio.sleep(2.0)
            a.measure = "ids"

        h.nursery.start_soon(names_its_slots_later)
    starts = sorted(r.start - t0 for r in jobs if r.start is not None)
    assert starts == [2.0, 2.0, 3.0]  # waited: never sent unpinned
    assert all(r.grant is not None and r.grant.slot_id is not None for r in jobs)
    assert s.statistics().admissions == 3 and a.bleeds == []


async def test_failed_or_hung_measurement_of_an_external_engine_makes_jobs_wait(
    autojump_clock: trio.testing.MockClock, pool: FakePool, caplog: pytest.LogCaptureFixture
) -> None:
    a = FakeLane(pool, "a", parallel=2, measure="raise")
    b = FakeLane(pool, "b", parallel=2, measure="hang")
    async with running(
        {"a": a, "b": b}, residency="coexist", measure_timeout=2.0, slot_poll=0.25
    ) as h:
        s = h.scheduler
        t0 = trio.current_time()
        on_a = [h.submit(a, duration=1.0) for _ in range(3)]
        on_b = h.submit(b, duration=1.0)

        async def recover() -> None:
            await trio.sleep(3.0)
            a.measure = b.measure = "ids"

        h.nursery.start_soon(recover)
    assert min(r.start - t0 for r in on_a if r.start is not None) >= 3.0
    assert on_b.start is not None and on_b.start - t0 >= 3.0
    assert all(r.grant is not None and r.grant.slot_id is not None for r in (*on_a, on_b))
    assert s.statistics().slot_measure_failures >= 3
    warnings = [r for r in caplog.records if "slot measurement of a failed" in r.getMessage()]
    assert len(warnings) == 1  # said once, not on every pass


async def test_reconciliation_holds_out_a_slot_busy_with_work_the_host_did_not_send(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=2, sole_client=True)
    async with running({"a": a}, reconcile_interval=1.0) as h:
        s = h.scheduler
        first = h.submit(a, session="chat-1", duration=0.5)
        await trio.sleep(0.6)
        a.external.add(0)  # someone else is using slot 0 behind the host's back
        a.slots[0].kv = "intruder"
        await trio.sleep(1.0)  # a background reconciliation ran meanwhile
        assert s.statistics().held_out == 1
        during = h.submit(a, session="chat-1", duration=0.5)
        await trio.sleep(1.0)
        a.external.clear()
        await trio.sleep(1.5)
        after = h.submit(a, session="chat-1", duration=0.5)
    assert first.slot == 0
    assert during.grant is not None and during.grant.slot_id == 1  # slot 0 held out
    # Slot 0 came back after a reconciliation saw it idle, as unknown: it was erased.
    assert after.grant is not None and after.grant.slot_id in (0, 1)
    assert (0 in [slot for _, slot in a.erases]) or after.grant.slot_id == 1
    assert a.bleeds == [] and a.deferred == []


async def test_a_reconciliation_outlives_its_models_removal(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    """A reload removes a model while the background reconciliation of its new engine
    waits for a ``/slots`` sample: the reconciliation ends quietly, and the scheduler
    (whose nursery it runs in) keeps serving the other models. The removed model
    holds no session's KV any more (a replica's router asks)."""
    a = FakeLane(pool, "a", parallel=1, measure="hang", sole_client=True)
    c = FakeLane(pool, "c", parallel=1)
    async with running({"a": a, "c": c}, residency="coexist", measure_timeout=2.0) as h:
        s = h.scheduler
        h.submit(a, session="chat-1", duration=0.1)  # its new engine is reconciled
        await trio.sleep(0.5)
        assert a.measure_calls == 1  # the sample hangs until measure_timeout (2 s)
        assert s.holds("a", "chat-1")
        s.remove_lane("a")
        assert not s.holds("a", "chat-1")
        await trio.sleep(3.0)
        served = h.submit(c, session="chat-2", duration=1.0)
    assert served.error is None and served.end is not None


async def test_zero_capacity_with_nothing_of_ours_running_polls_slots(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=1)
    a.external.add(0)
    async with running({"a": a}, slot_poll=0.25) as h:
        s = h.scheduler
        t0 = trio.current_time()
        j1 = h.submit(a, duration=1.0)

        async def external_traffic_ends() -> None:
            await trio.sleep(1.1)
            a.external.clear()  # nothing tells the scheduler: only its poll can see it

        h.nursery.start_soon(external_traffic_ends)
    assert j1.start == t0 + 1.25  # the first poll after 1.1
    assert s.statistics().slot_polls == 5  # 0.25, 0.5, 0.75, 1.0, 1.25


# --------------------------------------------------------------------------- 6. ownership


async def test_handoff_erases_and_awaits_the_ack_before_run(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=1, erase_time=0.5)
    async with running({"a": a}) as h:
        s = h.scheduler
        t0 = trio.current_time()
        first = h.submit(a, session="chat-1", duration=1.0, label="s1")
        other = h.submit(a, at=0.5, session="chat-2", duration=1.0, label="s2")
        back = h.submit(a, at=3.0, session="chat-1", duration=1.0, label="s1b")
        again = h.submit(a, at=5.0, session="chat-1", duration=1.0, label="s1c")
    assert first.grant is not None and not first.grant.erased  # a fresh slot
    assert other.grant is not None and other.grant.erased
    assert other.start == t0 + 1.5  # s1 ended at 1, then the 0.5 s erase was awaited
    erase_at = pool.events.index((t0 + 1.5, "erase", "a:0"))
    arrive_at = pool.events.index((t0 + 1.5, "arrive", "s2@a:0"))
    assert erase_at < arrive_at  # the erase reached the engine before the completion
    assert back.grant is not None and back.grant.erased and back.start == t0 + 3.5
    assert again.grant is not None and not again.grant.erased  # same session keeps its KV
    assert again.start == t0 + 5.0 and again.cached
    assert a.bleeds == []
    stats = s.statistics()
    assert stats.erases == {
        "ok": 2,
        "failed": 0,
        "skipped_same_session": 1,
        "after_keyless": 0,
        "sent_blind": 0,
        "blind_unanswered": 0,
    }
    assert stats.slot_owners == {"a": {0: hash_session("chat-1")}}


async def test_keyless_jobs_are_blind_and_their_slot_is_erased_once_idle(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=1, erase_time=0.25)
    async with running({"a": a}, idle_erase_delay=0.5) as h:
        s = h.scheduler
        t0 = trio.current_time()
        k1 = h.submit(a, duration=1.0, label="k1")
        k2 = h.submit(a, at=1.2, duration=1.0, label="k2")  # within the idle delay
        s1 = h.submit(a, at=4.0, session="chat", duration=1.0, label="s1")
        k3 = h.submit(a, at=4.5, duration=1.0, label="k3")
        s2 = h.submit(a, at=4.6, session="chat-2", duration=1.0, label="s2")
    grants = [r.grant for r in (k1, k2, s1, k3, s2)]
    assert [g.blind if g else None for g in grants] == [True, True, False, True, False]
    # No keyless job waits for an erase: k2 takes k1's slot as it is (blind); the
    # slot is erased 0.5 s after k2 left it, so s1 finds it clean; k3 (blind)
    # displaces chat's KV without an erase, and s2 erases what k3 left.
    assert [g.prepare_calls if g else None for g in grants] == [0, 0, 0, 0, 1]
    assert k2.start == t0 + 1.2 and s1.start == t0 + 4.0
    assert [t - t0 for t, _ in a.erases] == [2.95, 6.25]
    assert a.bleeds == []
    assert s.statistics().erases["after_keyless"] == 1


async def test_new_engine_generation_forgets_owners(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=1)
    async with running({"a": a}) as h:
        s = h.scheduler
        h.submit(a, session="chat-1", duration=1.0)
        await trio.sleep(2.0)
        assert s.statistics().slot_owners == {"a": {0: hash_session("chat-1")}}
        a.restart()  # e.g. a crash and restart: slot ids survive, their KV does not
        assert s.statistics().slot_owners == {}
        fresh = h.submit(a, session="chat-2", duration=1.0)
    assert fresh.grant is not None and not fresh.grant.erased
    assert a.erases == [] and a.bleeds == []


async def test_turn_switch_keeps_the_outgoing_models_table(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    # restart_on_load=False: the engine was not restarted by the switch, and nobody
    # else touched its slots, so chat-1's KV is still there when a comes back.
    a = FakeLane(pool, "a", parallel=1, restart_on_load=False, sole_client=True)
    b = FakeLane(pool, "b", parallel=1, restart_on_load=False, sole_client=True)
    async with running({"a": a, "b": b}) as h:
        s = h.scheduler
        h.submit(a, session="chat-1", duration=1.0)
        await trio.sleep(1.5)
        h.submit(b, session="chat-1", duration=1.0)
        await trio.sleep(0.5)
        assert s.statistics().slot_owners["a"] == {0: hash_session("chat-1")}
        back = h.submit(a, at=1.0, session="chat-1", duration=1.0)
        other = h.submit(a, at=3.0, session="chat-2", duration=1.0)
    assert back.grant is not None and not back.grant.erased and back.cached
    assert other.grant is not None and other.grant.erased
    assert a.bleeds == [] and b.bleeds == []


async def test_failed_erase_fails_the_request_and_leaves_the_slot_unknown(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=1)
    async with running({"a": a}) as h:
        s = h.scheduler
        h.submit(a, session="chat-1", duration=1.0)
        await trio.sleep(2.0)
        a.erase_error = RuntimeError("erase not supported")
        handoff = h.submit(a, session="chat-2", duration=1.0)
        await trio.sleep(2.0)
        a.erase_error = None
        # The failed erase left the slot's content unknown: even chat-1 erases it now.
        again = h.submit(a, session="chat-1", duration=1.0)
    assert isinstance(handoff.error, EngineFailed) and handoff.start is None  # never sent
    assert "did not acknowledge the erase" in str(handoff.error)
    assert again.grant is not None and again.grant.erased and not again.cached
    assert s.statistics().erases == {
        "ok": 1,
        "failed": 1,
        "skipped_same_session": 0,
        "after_keyless": 0,
        "sent_blind": 0,
        "blind_unanswered": 0,
    }
    assert a.bleeds == []


async def test_a_replica_whose_restart_fails_for_an_admitted_job_hands_its_queue_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two spawned replicas of one slot. m@0's engine dies under a running job and cannot
    be restarted: the next job admitted there fails (its caller re-routes it), and the
    one queued behind it moves to m@1 instead of meeting another failed restart."""
    pool = FakePool(swap=False)
    lanes = {m: FakeLane(pool, m, parallel=1, load_time=0.5) for m in ("m@0", "m@1")}
    for lane in lanes.values():
        lane.family = "m"
    m0 = lanes["m@0"]
    async with running(lanes, residency="coexist") as h:
        first = h.submit(m0, duration=2.0)
        admitted = h.submit(m0, at=0.1, duration=1.0)
        behind = h.submit(m0, at=0.2, duration=1.0)
        await trio.sleep(1.0)
        pool.resident.discard("m@0")  # it died
        m0.fail_loads = 10  # and will not start again
    assert first.error is None
    assert isinstance(admitted.error, EngineFailed) and admitted.start is None
    assert behind.error is None and behind.grant is not None
    assert behind.grant.model_id == "m@1"
    assert len(m0.ensure_calls) == 2  # the first start, and the one failed restart
    assert h.scheduler.statistics().pool["failovers"] == 1


async def test_a_slot_call_to_an_external_engine_that_fails_meanwhile_is_abandoned(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    """A hung external engine answers no erase; its health checks fail first. The
    handoff stops waiting then (not after the erase timeout): EngineFailed, nothing
    sent, the slot left unknown."""
    a = FakeLane(pool, "a", parallel=1, erase_time=60.0, sole_client=False)
    async with running({"a": a}, erase_timeout=30.0) as h:
        h.submit(a, session="chat-1", duration=1.0)
        await trio.sleep(2.0)
        handoff = h.submit(a, session="chat-2", duration=1.0)
        await trio.sleep(1.0)  # its erase is under way and gets no answer
        assert handoff.error is None
        a.failed.set()
        await trio.sleep(0.01)  # at once, not when the 30 s erase timeout expires
        assert isinstance(handoff.error, EngineFailed) and handoff.start is None
        assert "failed while slot 0 was prepared" in str(handoff.error)
        assert h.scheduler.policy.table("a").content(0) is Content.UNKNOWN
    assert a.bleeds == []


async def test_forget_slots_without_restart_erases_on_first_use(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=1)
    async with running({"a": a}) as h:
        s = h.scheduler
        h.submit(a, session="chat-1", duration=1.0)
        await trio.sleep(2.0)
        s.forget_slots("a")
        assert s.statistics().slot_owners == {}
        same = h.submit(a, session="chat-1", duration=1.0)
    assert same.grant is not None and same.grant.erased
    assert a.bleeds == []


# --------------------------------------------------------------------------- 7. affinity


async def test_jobs_whose_session_holds_a_slot_go_first_keyless_fifo(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=1)
    async with running({"a": a}, affinity_max_wait=10.0) as h:
        t0 = trio.current_time()
        h.submit(a, session="chat-1", duration=2.0, label="s1")
        k = h.submit(a, at=1.0, duration=1.0, label="k")
        s2 = h.submit(a, at=1.1, session="chat-2", duration=1.0, label="s2")
        s1b = h.submit(a, at=1.2, session="chat-1", duration=1.0, label="s1b")
    assert s1b.start == t0 + 2.0  # affine: chat-1 holds slot 0
    assert s1b.grant is not None and s1b.grant.slot_id == 0 and not s1b.grant.erased
    assert (k.start, s2.start) == (t0 + 3.0, t0 + 4.0)  # then FIFO
    assert a.bleeds == []


async def test_affinity_cannot_starve_a_chat_that_holds_no_slot(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    """Closed-loop agents: chat-1 holds the only slot and comes straight back after
    every answer. chat-2, queued at t=0.5, must not wait behind it forever: once it
    has waited affinity_max_wait (1 s), it goes first at the next free slot."""
    a = FakeLane(pool, "a", parallel=1)
    async with running({"a": a}, affinity_max_wait=1.0) as h:
        t0 = trio.current_time()
        h.submit(a, session="chat-1", duration=0.4, label="c1-0")
        other = h.submit(a, at=0.5, session="chat-2", duration=0.4, label="c2")
        for i in range(1, 8):  # chat-1 is always queued again before its slot frees
            h.submit(a, at=0.4 * i - 0.05, session="chat-1", duration=0.4, label=f"c1-{i}")
    # slot frees at 0.4, 0.8, 1.2, 1.6: chat-2 has waited >= 1 s by the one at 1.6
    assert other.start == t0 + 1.6
    assert other.grant is not None and other.grant.erased  # chat-1's KV was erased first
    assert a.bleeds == []


async def test_affine_job_is_pinned_to_its_own_idle_slot(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=3)
    async with running({"a": a}) as h:
        first = h.submit(a, session="chat-0", duration=1.0)
        second = h.submit(a, at=0.5, session="chat-1", duration=1.0)
        # slots 0 and 2 are idle too (2 is even fresh), but chat-1's KV is in slot 1
        back1 = h.submit(a, at=2.0, session="chat-1", duration=1.0)
        back0 = h.submit(a, at=2.5, session="chat-0", duration=1.0)
    assert (first.slot, second.slot) == (0, 1)
    assert back1.grant is not None and back1.grant.slot_id == 1 and back1.cached
    assert back0.grant is not None and back0.grant.slot_id == 0 and back0.cached
    assert a.erases == [] and a.bleeds == []


async def test_same_tick_submits_are_seen_together_by_one_pass(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # a1 is queued by the test task; a2 and b1 come from tasks spawned just before
    # (a2 first), which run one Trio batch later: the batch the dispatcher wakes in.
    # A pass that decided in that batch could claim a turn for a1 alone, then see b1
    # queued before a2, and a2 would wait for b's turn. The dispatcher yields once
    # before deciding, so a1 and a2 share one turn. Trio orders a batch at random,
    # hence several rounds.
    async def one_round() -> tuple[Record, Record, Record]:
        pool = FakePool()
        a = FakeLane(pool, "a", parallel=2)
        b = FakeLane(pool, "b", parallel=2)
        async with running({"a": a, "b": b}) as h:
            now = trio.current_time()
            a1, a2, b1 = (Record(m, None, "completion", submitted=now) for m in "aab")

            async def submit(lane: FakeLane, rec: Record) -> None:
                await h.scheduler.submit(lane.model_id, lambda g: lane.complete(g, rec, 1.0))

            h.nursery.start_soon(submit, a, a2)
            h.nursery.start_soon(submit, b, b1)
            await submit(a, a1)
        return a1, a2, b1

    for _ in range(12):
        a1, a2, b1 = await one_round()
        assert a1.start is not None and a2.start is not None and b1.start is not None
        assert a1.start == a2.start < b1.start


# --------------------------------------------------------------------------- 8. pinning


async def test_pins_are_distinct_and_skip_slots_of_jobs_not_yet_at_the_engine(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=4, arrive_delay=0.5)
    async with running({"a": a}) as h:
        s = h.scheduler
        burst = [h.submit(a, duration=2.0) for _ in range(2)]
        late = h.submit(a, at=0.1, duration=2.0)  # burst not at the engine yet
    pins = [r.grant.slot_id for r in (*burst, late) if r.grant is not None]
    assert len(pins) == 3 and len(set(pins)) == 3 and None not in pins
    assert a.deferred == []  # nobody was pinned to a slot another job took
    assert s.statistics().admissions == 3


# --------------------------------------------------------------------------- cancellation


async def test_cancelled_queued_job_leaves_the_queue(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=1)
    ran: list[str] = []
    async with running({"a": a}) as h:
        s = h.scheduler
        t0 = trio.current_time()
        h.submit(a, duration=5.0)
        await trio.sleep(1.0)

        async def never(grant: Grant) -> None:
            ran.append("never")

        with trio.move_on_after(1.0) as scope:  # the client disconnects while queued
            await s.submit("a", never)
        assert scope.cancelled_caught
        assert s.statistics().queued == 0 and s.statistics().waiting == {}
        j3 = h.submit(a, duration=1.0)
    assert ran == []
    assert j3.start == t0 + 5.0


async def test_cancelled_running_job_records_ownership_and_frees_its_slot(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=1)
    async with running({"a": a}) as h:
        s = h.scheduler
        t0 = trio.current_time()
        rec = Record("a", "chat-1", "completion", submitted=t0)

        async def body(grant: Grant) -> Record:
            return await a.complete(grant, rec, 10.0)

        nxt = h.submit(a, at=1.0, session="chat-2", duration=1.0)
        with trio.move_on_after(2.0) as scope:  # the client disconnects at 2
            await s.submit("a", body, session="chat-1")
        assert scope.cancelled_caught
        assert rec.cancelled and rec.end == t0 + 2.0
    assert nxt.start == t0 + 2.0  # admitted the moment the slot was released
    assert nxt.grant is not None and nxt.grant.erased  # chat-1 owned it when cancelled
    assert a.bleeds == []


class ParkingFakeLane(FakeLane):
    """A FakeLane with slot save and restore. The engine carries an action out at
    once and acknowledges it ``park_time`` later: a caller cancelled in between has
    changed the slot without hearing so, as with a real engine."""

    def __init__(self, pool: FakePool, model_id: str, *, park_time: float, **kw: Any) -> None:
        super().__init__(pool, model_id, **kw)
        self.park_time = park_time
        self.parked: dict[str, str | None] = {}
        self.parking_enabled = True
        self.misses = 0

    def is_parked(self, session: str | None, prefix: Prefix | None = None) -> bool:
        return session is not None and session in self.parked

    def parked_blocks(self, session: str | None, prefix: Prefix | None = None) -> Prefix | None:
        return () if self.is_parked(session) else None

    def is_current(self, session: str, blocks: Prefix) -> bool:
        return session in self.parked

    def lent_copy(self, caller: str, session: str, prefix: Prefix) -> tuple[str, Prefix] | None:
        return None  # its jobs have no caller to share within

    def note_miss(self) -> None:
        self.misses += 1

    async def park_slot(
        self,
        slot_id: int,
        session: str,
        blocks: Prefix = (),
        *,
        within: float = math.inf,
        share_caller: str | None = None,
    ) -> int:
        self.parked[session] = self.slots[slot_id].kv
        await trio.sleep(self.park_time)
        return 100  # tokens saved

    async def unpark_slot(
        self,
        slot_id: int,
        session: str,
        prefix: Prefix | None = None,
        *,
        within: float = math.inf,
        lent_to: str | None = None,
    ) -> int:
        if session not in self.parked or lent_to is not None:
            return 0
        self.slots[slot_id].kv = self.parked[session]
        await trio.sleep(self.park_time)
        return 100  # tokens restored


async def test_a_restore_cancelled_in_flight_leaves_the_slot_unknown(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = ParkingFakeLane(pool, "a", parallel=1, park_time=1.0)
    async with running({"a": a}, save_idle_slots=False) as h:  # the save at handoff
        s = h.scheduler
        h.submit(a, session="chat-2", duration=1.0)
        h.submit(a, at=1.5, session="chat-1", duration=1.0)  # parks chat-2's KV
        await trio.sleep(5.0)
        assert a.slots[0].kv == "chat-1" and "chat-2" in a.parked
        rec = Record("a", "chat-2", "completion", submitted=trio.current_time())

        async def body(grant: Grant) -> Record:
            return await a.complete(grant, rec, 1.0)

        # chat-2 comes back: chat-1 is parked (1 s), then chat-2's KV is restored, and
        # the client walks away while the restore's acknowledgement is in flight.
        with trio.move_on_after(1.5) as scope:
            await s.submit("a", body, session="chat-2")
        assert scope.cancelled_caught and rec.start is None
        assert a.slots[0].kv == "chat-2"  # the engine did carry the restore out
        back = h.submit(a, session="chat-1", duration=1.0, label="back")
    # The slot was unknown, not chat-1's: chat-1 got its own KV back before running.
    assert back.grant is not None and back.grant.erased and back.cached
    assert a.bleeds == []


async def test_a_failed_park_does_not_fail_the_handoff(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = ParkingFakeLane(pool, "a", parallel=1, park_time=0.1)
    async with running({"a": a}, save_idle_slots=False) as h:  # the save at handoff
        h.submit(a, session="chat-1", duration=1.0)
        await trio.sleep(2.0)

        async def broken(slot_id: int, session: str, blocks: Prefix = ()) -> None:
            raise OSError("disk full")

        a.park_slot = broken  # type: ignore[method-assign]
        keyless = h.submit(a, duration=1.0)  # displaces chat-1: its park fails
        keyed = h.submit(a, at=2.0, session="chat-2", duration=1.0)
    assert keyless.error is None and keyless.end is not None
    assert keyed.error is None and keyed.end is not None
    assert len(a.erases) == 1  # what the keyless job left was erased once idle
    assert h.scheduler.statistics().parking["failed"] >= 1
    assert a.bleeds == []


async def test_a_job_sent_to_a_restarted_engine_records_what_it_left(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=1, erase_time=1.0)
    async with running({"a": a}) as h:
        s = h.scheduler
        h.submit(a, session="chat-1", duration=1.0)
        handoff = h.submit(a, at=1.5, session="chat-2", duration=1.0)  # erases 1.5 .. 2.5
        await trio.sleep(2.0)
        assert a.holds == 1  # admitted: the engine is held while the slot is prepared
        a.restart()  # a crash and restart under the admitted job, before it is sent
        await trio.sleep(2.0)
        assert handoff.end is not None and a.slots[0].kv == "chat-2"
        assert s.statistics().slot_owners == {"a": {0: hash_session("chat-2")}}
        third = h.submit(a, session="chat-3", duration=1.0)
    assert third.grant is not None and third.grant.erased  # chat-2's KV was erased first
    assert a.bleeds == [] and a.holds == 0


async def test_job_error_propagates_unchanged_and_dispatching_continues(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=1)

    class Boom(Exception):
        pass

    async def fails(grant: Grant) -> None:
        await trio.sleep(1.0)
        raise Boom("upstream said no")

    async with running({"a": a}) as h:
        t0 = trio.current_time()
        bad = h.submit(a, body=fails)
        good = h.submit(a, at=0.5, duration=1.0)
    assert type(bad.error) is Boom and str(bad.error) == "upstream said no"
    assert good.error is None and good.start == t0 + 1.0


async def test_engine_failure_fails_that_turns_jobs_and_the_next_request_retries(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=2)
    b = FakeLane(pool, "b", parallel=2, load_time=1.0)
    b.fail_loads = 1
    async with running({"a": a, "b": b}) as h:
        s = h.scheduler
        t0 = trio.current_time()
        b1 = h.submit(b, duration=1.0)
        b2 = h.submit(b, duration=1.0)
        a1 = h.submit(a, at=0.5, duration=1.0)
        b3 = h.submit(b, at=3.0, duration=1.0)
    assert isinstance(b1.error, EngineFailed) and isinstance(b2.error, EngineFailed)
    assert "b failed to start" in str(b1.error)
    assert a1.error is None and a1.start == t0 + 1.0  # not wedged behind b's failure
    assert b3.error is None and b3.start == t0 + 4.0  # retried: a fresh load
    assert [t - t0 for t in b.ensure_calls] == [0.0, 3.0]
    assert s.statistics().waiting == {}


async def test_a_start_stopped_by_an_eviction_starts_again_while_its_turn_lasts(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    # In swap mode a stale load of another model can evict this one mid-start; the
    # engine says "stopped", which is not a failure of the model: start it again.
    a = FakeLane(pool, "a", parallel=2, load_time=1.0)
    a.fail_loads = 2
    a.load_error = EngineStopped("engine for model 'a' was stopped")
    async with running({"a": a}) as h:
        t0 = trio.current_time()
        job = h.submit(a, duration=1.0)
    assert job.error is None and job.start == t0 + 3.0
    assert [t - t0 for t in a.ensure_calls] == [0.0, 1.0, 2.0]


async def test_a_start_stopped_every_time_fails_its_turn(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=2, load_time=1.0)
    a.fail_loads = 3
    a.load_error = EngineStopped("engine for model 'a' was stopped")
    async with running({"a": a}) as h:
        job = h.submit(a, duration=1.0)
    assert isinstance(job.error, EngineStopped)
    assert len(a.ensure_calls) == 3  # bounded: no endless restart loop


async def test_non_project_engine_error_becomes_engine_failed(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a")
    a.fail_loads = 1
    a.load_error = FileNotFoundError("llama-server")
    async with running({"a": a}) as h:
        job = h.submit(a)
    assert isinstance(job.error, EngineFailed)
    assert isinstance(job.error.__cause__, FileNotFoundError)


async def test_full_queue_raises_queue_full_with_retry_after(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=1)
    async with running({"a": a}, max_queue=2) as h:
        s = h.scheduler
        h.submit(a, duration=5.0)
        queued = [h.submit(a, at=0.5, duration=1.0) for _ in range(2)]
        await trio.sleep(1.0)
        assert s.statistics().queued == 2

        async def body(grant: Grant) -> None:
            raise AssertionError("must not run")

        with pytest.raises(QueueFull) as info:
            await s.submit("a", body)
        assert info.value.status == 503 and info.value.retry_after >= 1
    assert all(r.error is None for r in queued)


async def test_unknown_model_is_refused(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a")

    async def body(grant: Grant) -> None:
        raise AssertionError("must not run")

    async with open_scheduler(lanes={"a": a}) as s:
        with pytest.raises(UnknownModel):
            await s.submit("nope", body)


# --------------------------------------------------------------------------- trio shape


async def test_a_burst_in_one_tick_shares_one_turn(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=4, load_time=1.0)
    b = FakeLane(pool, "b", parallel=4, load_time=1.0)
    async with running({"a": a, "b": b}) as h:
        s = h.scheduler
        jobs_a = [h.submit(a, duration=1.0) for _ in range(3)]
        jobs_b = [h.submit(b, duration=1.0) for _ in range(3)]
    for jobs in (jobs_a, jobs_b):
        assert len({r.start for r in jobs}) == 1  # one turn per model
    assert len(a.ensure_calls) == 1 and len(b.ensure_calls) == 1
    assert s.statistics().switches == 1
    assert pool.violations == []


async def test_set_residency_live_lets_a_waiting_model_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = FakePool(swap=False)
    a = FakeLane(pool, "a", parallel=2)
    b = FakeLane(pool, "b", parallel=2)
    async with running({"a": a, "b": b}) as h:
        s = h.scheduler
        t0 = trio.current_time()
        a1 = h.submit(a, duration=5.0)
        b1 = h.submit(b, at=1.0, duration=1.0)
        await trio.sleep(2.0)
        assert b1.start is None and s.statistics().waiting_model_ids == {"b": 1}
        s.set_residency("coexist")
    assert b1.start == t0 + 2.0
    assert overlaps(a1, b1)


async def test_add_and_remove_lanes_live(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=1)
    c = FakeLane(pool, "c", parallel=1)
    async with running({"a": a}) as h:
        s = h.scheduler
        h.submit(a, duration=5.0)
        queued = h.submit(a, at=1.0, duration=1.0)
        await trio.sleep(0.5)
        s.add_lane(c)
        served = h.submit(c, at=0.5, duration=1.0)
        await trio.sleep(1.0)
        s.remove_lane("a")
    assert isinstance(queued.error, UnknownModel)
    assert served.error is None and served.end is not None


@pytest.mark.parametrize("removed_at", [0.5, 1.5], ids=["before-the-save", "during-the-save"])
async def test_a_lane_removed_around_an_idle_save_leaves_the_scheduler_serving(
    autojump_clock: trio.testing.MockClock, pool: FakePool, removed_at: float
) -> None:
    """A reload removes a model whose idle slot is about to be saved (during
    ``save_idle_delay``) or is being saved: the save ends quietly, and the scheduler
    (whose nursery the save runs in) keeps serving the other models."""
    a = ParkingFakeLane(pool, "a", parallel=1, park_time=1.0)
    c = FakeLane(pool, "c", parallel=1)
    async with running({"a": a, "c": c}, save_idle_delay=1.0) as h:
        s = h.scheduler
        h.submit(a, session="chat-1", duration=0.1)  # ends at 0.1; its save starts at 1.1
        await trio.sleep(removed_at)
        saving = s.policy.table("a").saving(0) is not None
        s.remove_lane("a")
        await trio.sleep(3.0)  # past the save's delay and its park_time
        served = h.submit(c, session="chat-2", duration=1.0)
    assert saving is (removed_at > 1.1)
    assert ("chat-1" in a.parked) is saving  # the save ran only when it had begun
    assert served.error is None and served.end is not None


@pytest.mark.parametrize("during", ["save", "erase"])
async def test_a_session_erase_outlives_its_models_removal(
    autojump_clock: trio.testing.MockClock, pool: FakePool, during: str
) -> None:
    """A reload removes a model while a session's erase waits for a background save of
    its slot, or while the engine erases that slot: the erase ends without an error,
    and the scheduler keeps serving the other models."""
    a = ParkingFakeLane(pool, "a", parallel=1, park_time=1.0, erase_time=1.0)
    c = FakeLane(pool, "c", parallel=1)
    async with running({"a": a, "c": c}) as h:
        s = h.scheduler
        h.submit(a, session="chat-1", duration=1.0)  # ends at 1; its save runs 1 .. 2
        await trio.sleep(1.5 if during == "save" else 2.5)
        assert (s.policy.table("a").saving(0) is not None) is (during == "save")
        result: list[tuple[int, int]] = []

        async def erase() -> None:
            result.append(await s.erase_session("chat-1"))

        h.nursery.start_soon(erase)
        await trio.sleep(0.2)
        s.remove_lane("a")
        await trio.sleep(2.0)
        served = h.submit(c, session="chat-2", duration=1.0)
    # The erase was not sent once its model was gone; one in flight counts as done.
    assert result == [(0, 0)] if during == "save" else result == [(1, 0)]
    assert served.error is None and served.end is not None


async def test_a_planned_stops_parking_outlives_its_models_removal(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    """A reload removes a model while the parking before its engine's stop saves a
    slot: the parking ends with that save counted and saves nothing more."""
    a = ParkingFakeLane(pool, "a", parallel=2, park_time=1.0)
    async with running({"a": a}, save_idle_slots=False) as h:
        s = h.scheduler
        h.submit(a, session="chat-1", duration=1.0)
        h.submit(a, session="chat-2", duration=1.0)
        await trio.sleep(1.5)
        result: list[int] = []

        async def park() -> None:
            result.append(await s.park_owned("a"))

        h.nursery.start_soon(park)
        await trio.sleep(0.5)
        assert len(a.parked) == 1  # the first save is in flight
        s.remove_lane("a")
        await trio.sleep(3.0)
    assert result == [1] and len(a.parked) == 1


async def test_a_job_waiting_for_a_background_save_runs_after_its_models_removal(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    """A job placed on a slot whose background save is in flight waits for the save;
    a reload removes its model meanwhile: the job is running, so it still runs."""
    a = ParkingFakeLane(pool, "a", parallel=1, park_time=1.0)
    async with running({"a": a}) as h:
        s = h.scheduler
        h.submit(a, session="chat-1", duration=1.0)  # ends at 1; its save runs 1 .. 2
        again = h.submit(a, at=1.2, session="chat-1", duration=1.0)
        await trio.sleep(1.5)
        assert s.policy.table("a").saving(0) is not None
        s.remove_lane("a")
        await trio.sleep(3.0)
    assert again.error is None and again.end is not None and again.cached


async def test_shutdown_fails_queued_and_running_submitters_with_scheduler_closed(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=1)
    async with trio.open_nursery() as outer, open_scheduler(lanes={"a": a}) as s:
        h = Harness(s, outer)
        busy = h.submit(a, duration=100.0)
        queued = h.submit(a, at=0.5, duration=1.0)
        await trio.sleep(1.0)
    assert isinstance(busy.error, SchedulerClosed)
    assert isinstance(queued.error, SchedulerClosed)
    assert busy.cancelled


async def test_exceptions_leave_open_scheduler_unwrapped(pool: FakePool) -> None:
    a = FakeLane(pool, "a")
    with pytest.raises(KeyError):
        async with open_scheduler(lanes={"a": a}):
            raise KeyError("boom")


# --------------------------------------------------------------------------- statistics


async def test_statistics_report_queue_turns_owners_hashed(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = FakeLane(pool, "a", parallel=1, display_name="Alpha 7B")
    b = FakeLane(pool, "b", parallel=1, display_name="Beta 1B")
    async with running({"a": a, "b": b}) as h:
        s = h.scheduler
        h.submit(a, session="secret-chat-key", duration=1.0)
        await trio.sleep(2.0)
        stats = s.statistics()
        assert stats.slot_owners == {"a": {0: hash_session("secret-chat-key")}}
        dumped = json.dumps(stats.as_dict())
        assert "secret-chat-key" not in dumped and "secret-chat-key" not in repr(s)
        assert hash_session("secret-chat-key") in dumped
        h.submit(a, duration=4.0)
        h.submit(a, at=0.5, duration=1.0)
        h.submit(b, at=0.5, duration=1.0)
        await trio.sleep(1.0)
        stats = s.statistics()
        assert stats.queued == 2
        assert stats.waiting == {"Alpha 7B": 1, "Beta 1B": 1}
        assert stats.waiting_model_ids == {"a": 1, "b": 1}
        assert stats.running == {"a": 1}
        assert stats.last_turn == "a" and stats.turns == {"*": "a"}
        assert stats.admissions == 2 and stats.erases["ok"] == 0  # the keyless job is blind
        assert json.loads(json.dumps(stats.as_dict()))["running"] == {"a": 1}


# --------------------------------------------------------------------------- benchmark


def test_dispatcher_cost_benchmark_runs_and_its_invariants_hold(tmp_path: Path) -> None:
    from benchmarks.dispatcher_cost import main

    out = tmp_path / "dispatcher_cost.json"
    result = main(["--jobs", "400", "--models", "8", "--parallel", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    for run in result["scheduler"]:  # every job admitted once, no slot double-booked
        assert run["admissions"] == run["jobs"] == 400
        assert run["dispatcher_us_per_admission"] > 0
    assert result["memory"]["scheduler_bytes_per_queued_job"] > 0


# --------------------------------------------------------------------------- background saves


async def test_an_idle_slot_is_saved_in_the_background_and_its_handoff_skips_the_save(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = ParkingFakeLane(pool, "a", parallel=1, park_time=0.5, erase_time=0.25)
    async with running({"a": a}) as h:
        s = h.scheduler
        t0 = trio.current_time()
        h.submit(a, session="chat-1", duration=1.0)  # ends at 1; saved 1 .. 1.5
        await trio.sleep(2.0)
        assert s.statistics().parking["saved_idle"] == 1 and "chat-1" in a.parked
        assert a.holds == 0  # the save held the engine only while it ran
        nxt = h.submit(a, session="chat-2", duration=1.0)
    parking = s.statistics().parking
    assert nxt.start == t0 + 2.25  # only the erase before it
    assert nxt.grant is not None and nxt.grant.prepare_calls == 1
    assert parking["saved"] == 0 and parking["save_skipped_current"] == 1
    assert (parking["handoffs"], parking["handoff_calls"]) == (1, 2)
    assert a.bleeds == []


async def test_a_slot_whose_engine_failed_its_job_is_not_saved_in_the_background(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    """A job that ended because its engine timed out (or died) leaves its slot unsaved:
    a save would only wait on that engine. One that ended well is saved, as before."""
    from gezel_trio.errors import EngineTimeout

    a = ParkingFakeLane(pool, "a", parallel=1, park_time=0.5)
    async with running({"a": a}) as h:
        s = h.scheduler

        async def times_out(grant: Grant) -> None:
            await trio.sleep(1.0)
            raise EngineTimeout("the engine sent nothing for 1s")

        with pytest.raises(EngineTimeout):
            await s.submit("a", times_out, session="chat-1")
        await trio.sleep(2.0)
        assert s.statistics().parking["saved_idle"] == 0 and "chat-1" not in a.parked
        assert a.holds == 0
        h.submit(a, session="chat-1", duration=1.0)
        await trio.sleep(3.0)
    assert s.statistics().parking["saved_idle"] == 1 and "chat-1" in a.parked


async def test_a_lone_owner_with_a_clean_slot_to_spare_is_saved_only_once_idle_a_while(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    """Nobody else uses the model and a slot is free for a newcomer: saving every turn
    would only make the owner's next turn wait. Its slot is saved once it has stayed idle
    ``save_lone_delay`` (a new session of its caller then finds the copy current); once
    another owner shows up, at once."""
    a = ParkingFakeLane(pool, "a", parallel=2, park_time=0.5)
    async with running({"a": a}, save_lone_delay=2.0) as h:
        s = h.scheduler
        t0 = trio.current_time()
        h.submit(a, session="chat-1", duration=1.0)  # ends at 1
        again = h.submit(a, at=1.5, session="chat-1", duration=1.0)  # ends at 2.5
        await trio.sleep(4.0)  # idle 1.5 s: not yet
        assert s.statistics().parking["saved_idle"] == 0 and "chat-1" not in a.parked
        await trio.sleep(1.5)  # saved 4.5 .. 5
        assert s.statistics().parking["saved_idle"] == 1 and "chat-1" in a.parked
        assert s.policy.table("a").slots[0].parked_current
        other = h.submit(a, session="chat-2", duration=1.0)  # the clean slot: ends at 6.5
        await trio.sleep(1.1)  # no slot is left fresh: chat-2's is saved at once
        assert s.policy.table("a").saving(other_slot := 1) is not None
        await trio.sleep(1.0)
    assert again.start == t0 + 1.5  # it waited for no save
    assert other.grant is not None and other.grant.slot_id == other_slot
    assert s.statistics().parking["saved_idle"] == 2 and "chat-2" in a.parked
    assert a.holds == 0


async def test_a_lone_owner_used_again_within_save_lone_delay_is_not_saved(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    """An agent's turns come back sooner than ``save_lone_delay``: none of its slot's
    versions is saved while it works, and ``inf`` saves a lone slot never."""
    a = ParkingFakeLane(pool, "a", parallel=2, park_time=0.5)
    async with running({"a": a}, save_lone_delay=1.0) as h:
        for k in range(4):
            h.submit(a, at=1.5 * k, session="chat-1", duration=1.0)  # idle 0.5 s between
        await trio.sleep(5.5)  # the last ended at 5.5
        assert h.scheduler.statistics().parking["saved_idle"] == 0
        await trio.sleep(2.0)
        assert h.scheduler.statistics().parking["saved_idle"] == 1  # the last one's
    b = ParkingFakeLane(pool, "b", parallel=2, park_time=0.5)
    async with running({"b": b}, save_lone_delay=math.inf) as h:
        h.submit(b, session="chat-1", duration=1.0)
        await trio.sleep(100.0)
        assert h.scheduler.statistics().parking["saved_idle"] == 0 and "chat-1" not in b.parked


async def test_without_background_saves_a_handoff_makes_three_calls(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = ParkingFakeLane(pool, "a", parallel=1, park_time=0.5)
    async with running({"a": a}, save_idle_slots=False) as h:
        s = h.scheduler
        h.submit(a, session="chat-1", duration=1.0)
        h.submit(a, at=2.0, session="chat-2", duration=1.0)  # parks chat-1, erases
        h.submit(a, at=4.0, session="chat-1", duration=1.0)  # parks chat-2, restores
    parking = s.statistics().parking
    assert parking["saved_idle"] == 0 and parking["saved"] == 2
    assert (parking["handoffs"], parking["handoff_calls"]) == (2, 6)


async def test_a_request_for_a_slot_being_saved_waits_for_the_save(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    """Its owner's next turn goes to its own slot and waits for the save to end (no
    second save); another owner's request that needs the slot waits too, and its
    handoff then skips the save."""
    a = ParkingFakeLane(pool, "a", parallel=1, park_time=1.0)
    async with running({"a": a}) as h:
        s = h.scheduler
        t0 = trio.current_time()
        h.submit(a, session="chat-1", duration=1.0)  # ends at 1; saved 1 .. 2
        same = h.submit(a, at=1.5, session="chat-1", duration=1.0)  # ends at 3; saved 3 .. 4
        other = h.submit(a, at=3.5, session="chat-2", duration=1.0)
    assert same.start == t0 + 2.0 and same.grant is not None
    assert same.grant.prepare_calls == 0 and not same.grant.erased
    assert other.start == t0 + 4.0 and other.grant is not None
    assert other.grant.prepare_calls == 1  # the erase; the save was the background one
    parking = s.statistics().parking
    assert parking["saved"] == 0 and parking["saved_idle"] == 2
    assert parking["save_skipped_current"] == 1
    assert a.bleeds == []


async def test_a_background_save_cut_by_shutdown_leaves_the_copy_stale(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = ParkingFakeLane(pool, "a", parallel=1, park_time=1.0)
    async with running({"a": a}) as h:
        s = h.scheduler
        h.submit(a, session="chat-1", duration=1.0)  # ends at 1; its save 1 .. 2 is cut
        await trio.sleep(1.5)
        assert s.policy.table("a").saving(0) is not None
    entry = s.policy.table("a").slots[0]
    assert entry.saving is None and not entry.parked_current
    assert entry.content is Content.OWNED and entry.session == "chat-1"
    assert s.statistics().parking["saved_idle"] == 0
    # the planned stop's park still works once the scheduler has closed
    assert await s.park_owned("a") == 1
    assert s.policy.table("a").slots[0].parked_current


async def test_park_owned_waits_for_a_background_save_in_flight(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    a = ParkingFakeLane(pool, "a", parallel=1, park_time=1.0)
    async with running({"a": a}) as h:
        s = h.scheduler
        h.submit(a, session="chat-1", duration=1.0)  # ends at 1; saved 1 .. 2
        await trio.sleep(1.5)
        t0 = trio.current_time()
        assert await s.park_owned("a") == 0  # the background save made it current
        assert trio.current_time() == t0 + 0.5
        assert s.statistics().parking["saved_idle"] == 1


async def test_a_blind_handoff_sends_no_erase_and_owns_the_slot_once_answered(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    """With ``blind_handoff`` (the default) a slot that another owner's job must not
    read is handed over without an erase: the job is granted blind (sent with
    ``cache_prompt`` off) with no call before it, and owns the slot once the engine
    answered it. A blind job the engine never answered leaves the slot unknown: the
    next job, even of the owner it was sent for, is sent blind again."""
    a = FakeLane(pool, "a", parallel=1, erase_time=0.5)
    async with running({"a": a}, blind_handoff=True) as h:
        s = h.scheduler
        t0 = trio.current_time()
        first = h.submit(a, session="chat-1", duration=1.0, label="s1")
        other = h.submit(a, at=0.5, session="chat-2", duration=1.0, label="s2")
        again = h.submit(a, at=3.0, session="chat-2", duration=1.0, label="s2b")
        await trio.sleep(5.0)
        a.answer_nothing = True  # chat-1's request fails before the engine generates
        lost = h.submit(a, session="chat-1", duration=1.0, label="s1b")
        await trio.sleep(2.0)
        a.answer_nothing = False
        retry = h.submit(a, session="chat-1", duration=1.0, label="s1c")
    assert first.grant is not None and not first.grant.blind  # a fresh slot
    assert other.grant is not None and other.grant.blind and not other.grant.erased
    assert other.grant.prepare_calls == 0 and other.start == t0 + 1.0  # no erase awaited
    assert again.grant is not None and not again.grant.blind and again.cached  # its own now
    assert lost.grant is not None and lost.grant.blind
    assert retry.grant is not None and retry.grant.blind and not retry.cached
    assert a.erases == [] and a.bleeds == []
    erases = s.statistics().erases
    assert erases["sent_blind"] == 3 and erases["blind_unanswered"] == 1
    assert erases["ok"] == 0
    assert s.statistics().slot_owners == {"a": {0: hash_session("chat-1")}}


class LeadFakeLane(ParkingFakeLane):
    """A ParkingFakeLane that starts slots from leads: a restore of the lead's snapshot
    (once one was saved) or a prefill and a save, either replacing the slot's whole
    content, acknowledged ``park_time`` later."""

    def __init__(self, pool: FakePool, model_id: str, **kw: Any) -> None:
        super().__init__(pool, model_id, **kw)
        self.leads_enabled = True
        self.fail_leads = False
        self.snapshots: set[str] = set()
        self.leads: list[tuple[int, str, bool]] = []  # slot, owner, restored

    async def start_lead(self, slot_id: int, lead: Lead, *, within: float = math.inf) -> LeadStart:
        self.slots[slot_id].kv = None  # the engine replaces what the slot held
        await trio.sleep(self.park_time)
        if self.fail_leads:
            return LeadStart(0, 1)
        restored = lead.owner in self.snapshots
        self.snapshots.add(lead.owner)
        self.leads.append((slot_id, lead.owner, restored))
        return LeadStart(300, 1 if restored else 2, restored=restored, saved=not restored)


async def test_a_job_with_a_lead_starts_a_slot_from_it_instead_of_an_erase(
    autojump_clock: trio.testing.MockClock, pool: FakePool
) -> None:
    """One slot. A job carrying its caller's lead starts a fresh slot from it (a
    prefill and a save); the next owner's job parks the first owner's KV, then has the
    lead restored (that owner's KV saved first, here while the slot was idle): no
    erase either time, and no job reads another owner's KV. A job on
    its owner's own slot needs no lead; a lead that fails sends the job blind."""
    a = LeadFakeLane(pool, "a", parallel=1, park_time=0.1)
    lead = Lead("/v1/chat/completions", {}, (2, 4), key="k").for_caller("c" * 64)
    async with running({"a": a}) as h:
        s = h.scheduler

        async def job(session: str) -> Record:
            rec = Record("a", session, "completion", submitted=trio.current_time(), label=session)
            async with s.slot("a", session=session, lead=lead) as grant:
                await a.complete(grant, rec, 1.0)
            await trio.sleep(1.0)
            return rec

        first, second, third = await job("ann-1"), await job("ann-2"), await job("ann-2")
        a.fail_leads = True
        fourth = await job("ann-3")
        stats = s.statistics().parking
    assert first.grant is not None and first.grant.lead_tokens == 300
    assert not first.grant.blind and first.grant.prepare_calls == 2  # prefill and save
    assert second.grant is not None and second.grant.lead_tokens == 300
    # ann-1's KV was saved while the slot sat idle: the restore is the one call
    assert second.grant.prepare_calls == 1 and "ann-1" in a.parked
    assert a.leads == [(0, lead.owner, False), (0, lead.owner, True)]
    assert third.grant is not None and third.grant.lead_tokens == 0 and third.cached
    assert fourth.grant is not None and fourth.grant.blind and fourth.grant.lead_tokens == 0
    assert a.erases == [] and a.bleeds == []
    assert (stats["leads_saved"], stats["leads_restored"], stats["leads_failed"]) == (1, 1, 1)
