"""The Trio layer of the scheduler: one dispatcher task, jobs as tasks in its nursery.

``open_scheduler()`` owns a nursery with one dispatcher task. Every event that
can change a decision (a submit, a job settling, a model becoming resident, a
``/slots`` sample arriving, the slot poll) sets the dispatcher's wake event; the
dispatcher yields once (so a burst of submits in the same tick shares one turn),
then runs a *pass*: it asks :class:`~gezel_trio.scheduler.policy.SchedulerPolicy`
what to do from scratch and does it. The pass is the only place a job is
started, and it never awaits: engine loads (``ensure_resident``) and slot samples
(``measure_slots``) run as tasks that report back by waking the dispatcher, so a
slow engine holds up nobody else. Each sample is consumed by exactly one
admission decision, and no job of that model is admitted while it is in flight,
so every pin is drawn from the sample that admitted it.

Admitted jobs run as tasks in the scheduler's nursery, each under its own cancel
scope, inside an ``async with`` block whose exit records slot ownership and wakes
the dispatcher, whether the job finished, failed or was cancelled. A job marked
for an erase awaits the engine's acknowledgement before its ``run()`` is called.
An erase that fails or times out (``erase_timeout``) is logged and counted, and
the job runs anyway on its pinned slot, which is then recorded as dirty (erased
before anyone's next use). A timed-out erase may still reach the engine later; it
can then only cost the job's own cache, never expose another chat's KV.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, TypeVar, cast, runtime_checkable

import trio

from gezel_trio.errors import EngineFailed, GezelError, SchedulerClosed, UnknownModel
from gezel_trio.scheduler.policy import (
    JOB_KINDS,
    Admit,
    Grant,
    Job,
    JobKind,
    JobState,
    Load,
    Residency,
    RunExclusive,
    SchedulerPolicy,
    SchedulerStats,
    SlotMeasurement,
)

__all__ = ["EngineLane", "Scheduler", "SchedulerClosed", "open_scheduler"]

log = logging.getLogger("gezel_trio.scheduler")

T = TypeVar("T")


@runtime_checkable
class ParkingLane(Protocol):
    """A lane that can park a session's KV on disk and bring it back (slot save/restore)."""

    def is_parked(self, session: str | None) -> bool: ...

    async def park_slot(self, slot_id: int, session: str) -> None: ...

    async def unpark_slot(self, slot_id: int, session: str) -> bool: ...


class EngineLane(Protocol):
    """What the scheduler needs from one model's engine."""

    @property
    def model_id(self) -> str: ...

    @property
    def display_name(self) -> str: ...

    @property
    def parallel(self) -> int:
        """Admission ceiling: the profile's slots (1 after a failed calibration)."""
        ...

    @property
    def generation(self) -> int:
        """Increments on every engine (re)start; slot owners are forgotten when it changes."""
        ...

    async def ensure_resident(self) -> None:
        """Start or switch the engine lazily; raises project errors (EngineFailed, NoCapacity)."""
        ...

    async def measure_slots(self) -> SlotMeasurement | None:
        """``GET /slots``; ``None`` when unknown."""
        ...

    async def erase_slot(self, slot_id: int) -> None:
        """``POST /slots/{id}?action=erase``; returns once acknowledged, may raise."""
        ...


@dataclass(eq=False, slots=True)
class _TrioJob(Job):
    run: Callable[[Grant], Awaitable[object]] | None = None
    finished: trio.Event | None = None
    scope: trio.CancelScope | None = None
    value: object = None
    error: BaseException | None = None
    completed: bool = False


class _Occupancy:
    """The ``async with`` a job runs in: its exit settles the job (ownership,
    capacity) and wakes the dispatcher, however the job ended. The exit is
    synchronous bookkeeping, so cancellation cannot interrupt it."""

    __slots__ = ("_job", "_scheduler")

    def __init__(self, scheduler: Scheduler, job: _TrioJob) -> None:
        self._scheduler = scheduler
        self._job = job

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._scheduler._settle(self._job)


class Scheduler:
    """Handle yielded by :func:`open_scheduler`. See :meth:`submit`."""

    def __init__(
        self,
        *,
        lanes: Mapping[str, EngineLane],
        residency: Residency = "swap",
        max_queue: int = 256,
        slot_poll: float = 0.25,
        affinity: bool = True,
        affinity_max_wait: float = 1.0,
        pinning: bool = True,
        erase_on_handoff: bool = True,
        measure_timeout: float = 2.0,
        erase_timeout: float = 5.0,
        cleanup_timeout: float = 5.0,
        kv_parking: bool = True,
        park_timeout: float = 30.0,
    ) -> None:
        if slot_poll <= 0:
            raise ValueError(f"slot_poll must be > 0, not {slot_poll}")
        self._lanes: dict[str, EngineLane] = {}
        self._policy = SchedulerPolicy(
            residency=residency,
            max_queue=max_queue,
            affinity=affinity,
            affinity_max_wait=affinity_max_wait,
            pinning=pinning,
            erase_on_handoff=erase_on_handoff,
        )
        for model_id, lane in lanes.items():
            self._check_lane(model_id, lane)
            self._lanes[model_id] = lane
            self._policy.add_lane(lane)
        self.slot_poll = slot_poll
        self.measure_timeout = measure_timeout
        self.erase_timeout = erase_timeout
        self.kv_parking = kv_parking
        self.park_timeout = park_timeout
        self.cleanup_timeout = cleanup_timeout
        self._wake_event = trio.Event()
        self._poll_at: float | None = None
        self._nursery: trio.Nursery | None = None
        self._closed = False
        self._measure_failing: set[str] = set()
        self._measuring: set[str] = set()  # models with a /slots sample in flight
        self._measured: dict[str, SlotMeasurement | None] = {}  # samples for the next pass

    def __repr__(self) -> str:
        stats = self._policy.snapshot()
        return (
            f"<Scheduler {stats.residency} queued={stats.queued} running={stats.running} "
            f"turns={stats.turns} active={stats.active}"
            f"{' closed' if self._closed else ''}>"
        )

    @staticmethod
    def _check_lane(model_id: str, lane: EngineLane) -> None:
        if lane.model_id != model_id:
            raise ValueError(f"lane for {model_id!r} reports model_id {lane.model_id!r}")

    # ------------------------------------------------------------------ public API

    @property
    def residency(self) -> Residency:
        return self._policy.residency

    @property
    def policy(self) -> SchedulerPolicy:
        """The policy object (read-only use: tests, diagnostics)."""
        return self._policy

    async def submit(
        self,
        model_id: str,
        run: Callable[[Grant], Awaitable[T]],
        *,
        session: str | None = None,
        kind: JobKind = "completion",
    ) -> T:
        """Queue ``run`` for ``model_id`` and return its result once it has run.

        ``run(grant)`` is called when the job is admitted: ``grant.slot_id`` is the
        slot to pin (``id_slot``), already erased if it last held another session's
        KV. ``session`` is the chat's ``prompt_cache_key`` (``None``: keyless).
        ``kind`` other than ``"completion"`` is exclusive: it runs alone on a
        drained engine with ``grant.slot_id`` ``None``.

        Raises UnknownModel, QueueFull (with ``retry_after``), the engine's error
        when the model cannot be made resident, SchedulerClosed on shutdown, or
        whatever ``run`` raised, unchanged.

        On cancellation while queued the job leaves the queue; while running, the
        job's scope is cancelled and this waits (shielded, bounded by
        ``cleanup_timeout``) for it to unwind before re-raising.
        """
        if kind not in JOB_KINDS:
            raise ValueError(f"unknown job kind {kind!r}")
        if self._closed or self._nursery is None:
            raise SchedulerClosed("the scheduler is not running")
        job = _TrioJob(model_id=model_id, kind=kind, session=session)
        job.run = cast(Callable[[Grant], Awaitable[object]], run)
        job.finished = finished = trio.Event()
        self._policy.enqueue(job, now=trio.current_time())
        self._wake()
        try:
            await finished.wait()
        finally:
            if not finished.is_set():
                await self._abandon(job)
        error = job.error
        if error is not None:
            try:
                raise error
            finally:
                del error
                job.error = None
        if not job.completed:
            raise SchedulerClosed(f"the scheduler shut down before the {kind} could finish")
        return cast(T, job.value)

    def set_residency(self, residency: Residency) -> None:
        """Switch between ``swap`` and ``coexist`` live (see SchedulerPolicy.set_residency)."""
        self._policy.set_residency(residency)
        self._wake()

    def forget_slots(self, model_id: str) -> None:
        """Forget ``model_id``'s slot owners, e.g. on an engine restart the lane has
        not yet counted: until a new generation is seen each slot is erased on first use."""
        self._policy.forget_slots(model_id)

    def add_lane(self, lane: EngineLane) -> None:
        """Serve a new model. Raises ValueError if the id is taken."""
        self._check_lane(lane.model_id, lane)
        self._policy.add_lane(lane)
        self._lanes[lane.model_id] = lane
        self._wake()

    def remove_lane(self, model_id: str) -> None:
        """Stop serving ``model_id``: its queued jobs fail with UnknownModel; running
        ones finish (they keep their lane)."""
        failed = self._policy.remove_lane(model_id)
        self._lanes.pop(model_id, None)
        for job in failed:
            self._fail(cast(_TrioJob, job), UnknownModel(f"model {model_id!r} was removed"))
        self._wake()

    def statistics(self) -> SchedulerStats:
        return self._policy.snapshot()

    # ------------------------------------------------------------------ dispatcher

    def _wake(self) -> None:
        self._wake_event.set()

    async def _serve_dispatcher(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The dispatcher loop: wait for a wake (or the slot poll), yield once, run a
        pass. Runs until cancelled."""
        task_status.started()
        while True:
            deadline = self._poll_at
            if deadline is None:
                await self._wake_event.wait()
            else:
                with trio.move_on_at(deadline):
                    await self._wake_event.wait()
                if not self._wake_event.is_set():
                    self._policy.note_poll()
            # Yield once so that every submit of this tick is queued before we decide.
            await trio.lowlevel.checkpoint()
            self._wake_event = trio.Event()
            self._poll_at = None
            self._pass()

    def _pass(self) -> None:
        """Re-derive every decision from scratch and act on it: the only place a job
        starts. Never awaits I/O: engine loads and ``/slots`` samples run as tasks
        that wake the dispatcher when they finish, so one slow engine cannot hold
        up another's admissions. A sample is consumed by the first pass after it
        arrives (admitting against it), or dropped if that pass has no use for it."""
        policy = self._policy
        nursery = self._nursery
        assert nursery is not None
        started = time.perf_counter()
        fresh = self._measured
        self._measured = {}
        now = trio.current_time()
        for action in policy.plan():
            if isinstance(action, Admit):
                model_id = action.model_id
                if model_id not in fresh:
                    if model_id not in self._measuring:
                        self._measuring.add(model_id)
                        nursery.start_soon(self._measure_task, model_id)
                    continue
                admission = policy.admit(model_id, fresh[model_id], now=now)
                lane = self._lanes.get(model_id)
                for admitted in admission.jobs:
                    assert lane is not None
                    self._spawn(cast(_TrioJob, admitted), lane)
                if admission.poll:
                    at = now + self.slot_poll
                    if self._poll_at is None or at < self._poll_at:
                        self._poll_at = at
            elif isinstance(action, Load):
                nursery.start_soon(self._load, action.model_id)
            elif isinstance(action, RunExclusive):
                job = cast(_TrioJob, action.job)
                lane = self._lanes.get(job.model_id)
                if lane is None:  # pragma: no cover - a removed lane plans nothing
                    policy.settle(job, now=now)
                    self._fail(job, UnknownModel(f"model {job.model_id!r} was removed"))
                    continue
                self._spawn(job, lane)
        policy.note_pass(time.perf_counter() - started)

    async def _measure_task(self, model_id: str) -> None:
        try:
            self._measured[model_id] = await self._measure(model_id)
        finally:
            self._measuring.discard(model_id)
            self._wake()

    async def _measure(self, model_id: str) -> SlotMeasurement | None:
        """Sample ``model_id``'s slots; ``None`` (trust the profile) when the sample
        fails or takes longer than ``measure_timeout``."""
        lane = self._lanes.get(model_id)
        if lane is None:
            return None
        measured: SlotMeasurement | None = None
        failure: str | None = None
        with trio.move_on_after(self.measure_timeout):
            try:
                measured = await lane.measure_slots()
            except Exception as exc:
                failure = repr(exc)
            else:
                self._policy.note_measurement(ok=measured is not None)
                if model_id in self._measure_failing:
                    self._measure_failing.discard(model_id)
                    log.info("slot measurement of %s works again", model_id)
                return measured
        if failure is None:
            failure = f"timed out after {self.measure_timeout}s"
        self._policy.note_measurement(ok=False)
        if model_id not in self._measure_failing:  # say it once, not on every pass
            self._measure_failing.add(model_id)
            log.warning(
                "slot measurement of %s failed (%s): trusting its profile", model_id, failure
            )
        return None

    async def _load(self, model_id: str) -> None:
        """Make ``model_id`` resident; on failure fail the jobs of its turn."""
        lane = self._lanes.get(model_id)
        done = False
        try:
            if lane is None:
                raise EngineFailed(f"model {model_id!r} has no lane")
            await lane.ensure_resident()
            done = True
            self._policy.load_done(model_id)
        except Exception as exc:
            done = True
            error: BaseException = exc
            if not isinstance(exc, GezelError):
                error = EngineFailed(f"engine for {model_id!r} could not be made resident: {exc!r}")
                error.__cause__ = exc
            log.warning("engine for %s could not be made resident: %r", model_id, exc)
            for job in self._policy.load_failed(model_id):
                self._fail(cast(_TrioJob, job), _copy_error(error))
        finally:
            if not done:
                self._policy.load_aborted(model_id)
            self._wake()

    def _spawn(self, job: _TrioJob, lane: EngineLane) -> None:
        job.scope = trio.CancelScope()
        assert self._nursery is not None
        self._nursery.start_soon(self._run_job, job, lane)

    async def _run_job(self, job: _TrioJob, lane: EngineLane) -> None:
        assert job.scope is not None and job.finished is not None and job.run is not None
        try:
            with job.scope:
                async with _Occupancy(self, job):
                    erased = await self._prepare_slot(job, lane)
                    grant = Grant(
                        model_id=job.model_id,
                        slot_id=None if job.exclusive else job.slot_id,
                        erased=erased,
                        queue_wait_s=trio.current_time() - job.submitted_at,
                    )
                    await trio.lowlevel.checkpoint_if_cancelled()  # never start a cancelled job
                    job.ran = True
                    try:
                        job.value = await job.run(grant)
                        job.completed = True
                    except (trio.Cancelled, KeyboardInterrupt, SystemExit):
                        raise
                    except BaseException as exc:  # a job's failure must not stop the scheduler
                        if isinstance(exc, BaseExceptionGroup):
                            _, rest = exc.split(trio.Cancelled)
                            if rest is None:
                                raise  # only cancellation: the cancel scopes deal with it
                            exc = rest
                        job.error = exc
        finally:
            job.finished.set()

    async def _prepare_slot(self, job: _TrioJob, lane: EngineLane) -> bool:
        """Make the pinned slot safe (and warm) for the job before ``run()``.

        With KV parking (a lane that can ``park_slot``/``unpark_slot``): the
        outgoing session's KV is saved before the handoff, and an incoming
        session with parked KV gets it restored, which also replaces the
        previous owner's KV. Otherwise the slot is erased when the handoff
        rule says so. Returns True when the slot was erased or restored
        (acknowledged). Cancellation propagates.
        """
        slot = job.slot_id
        if slot is None or job.exclusive:
            return False
        parking = self.kv_parking and isinstance(lane, ParkingLane)
        if parking and job.erase and job.handoff_from is not None:
            # Another chat's KV is about to be replaced: keep it for that chat's next turn.
            assert isinstance(lane, ParkingLane)
            with trio.move_on_after(self.park_timeout):
                try:
                    await lane.park_slot(slot, job.handoff_from)
                except Exception as exc:
                    log.warning("parking %s slot %d failed: %r", job.model_id, slot, exc)
        owned = job.erase is False and job.handoff_from == job.session and job.session is not None
        if parking and job.session is not None and not owned:
            assert isinstance(lane, ParkingLane)
            if lane.is_parked(job.session):
                restored = False
                with trio.move_on_after(self.park_timeout):
                    try:
                        restored = await lane.unpark_slot(slot, job.session)
                    except Exception as exc:
                        log.warning("restoring %s slot %d failed: %r", job.model_id, slot, exc)
                if restored:
                    if job.erase:
                        job.erase_ok = True
                        self._policy.note_erase(ok=True)
                    return True
        return await self._erase(job, lane) if job.erase else False

    async def _erase(self, job: _TrioJob, lane: EngineLane) -> bool:
        """Erase the job's slot and await the acknowledgement. A failure or timeout is
        logged and counted; the job runs anyway. Cancellation propagates."""
        slot = job.slot_id
        assert slot is not None
        with trio.move_on_after(self.erase_timeout):
            try:
                await lane.erase_slot(slot)
            except Exception as exc:
                log.warning("erase of %s slot %d failed: %r", job.model_id, slot, exc)
                job.erase_ok = False
                self._policy.note_erase(ok=False)
                return False
            job.erase_ok = True
            self._policy.note_erase(ok=True)
            return True
        log.warning(
            "erase of %s slot %d timed out after %ss", job.model_id, slot, self.erase_timeout
        )
        job.erase_ok = False
        self._policy.note_erase(ok=False)
        return False

    def _settle(self, job: _TrioJob) -> None:
        self._policy.settle(job, now=trio.current_time())
        self._wake()

    def _fail(self, job: _TrioJob, error: BaseException) -> None:
        job.error = error
        if job.finished is not None:
            job.finished.set()

    async def _abandon(self, job: _TrioJob) -> None:
        """The submitter is going away (cancelled): withdraw or cancel its job."""
        if job.state is JobState.QUEUED:
            self._policy.cancel(job)
            self._wake()
            return
        if job.state is JobState.RUNNING and job.scope is not None and job.finished is not None:
            job.scope.cancel()
            with trio.move_on_after(self.cleanup_timeout, shield=True):
                await job.finished.wait()

    def _close(self) -> None:
        self._closed = True
        for job in self._policy.fail_all():
            self._fail(cast(_TrioJob, job), SchedulerClosed("the scheduler shut down"))


def _copy_error(error: BaseException) -> BaseException:
    """A per-job copy of a shared error, so concurrent re-raises do not share a traceback."""
    try:
        clone = copy.copy(error)
    except Exception:
        return error
    if type(clone) is not type(error) or str(clone) != str(error):
        return error
    clone.__cause__ = error.__cause__
    clone.__traceback__ = None
    return clone


def _unwrap(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception a caller should see instead of ``group``."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    for leaf in leaves:
        if not isinstance(leaf, trio.Cancelled):
            return leaf
    return leaves[0] if leaves else group


@asynccontextmanager
async def open_scheduler(
    *,
    lanes: Mapping[str, EngineLane],
    residency: Residency = "swap",
    max_queue: int = 256,
    slot_poll: float = 0.25,
    affinity: bool = True,
    affinity_max_wait: float = 1.0,
    pinning: bool = True,
    erase_on_handoff: bool = True,
    measure_timeout: float = 2.0,
    erase_timeout: float = 5.0,
    kv_parking: bool = True,
    cleanup_timeout: float = 5.0,
) -> AsyncIterator[Scheduler]:
    """Run a scheduler over ``lanes`` (model id -> lane) for the duration of the block.

    ``residency``: ``swap`` (one model resident at a time, one turn for all) or
    ``coexist`` (each model its own lane and turns). ``max_queue`` bounds the
    queued jobs (QueueFull beyond). ``slot_poll`` is the ``/slots`` poll interval
    used only when capacity is zero and none of our jobs is running.
    ``measure_timeout`` and ``erase_timeout`` bound one ``/slots`` sample and one
    erase; ``cleanup_timeout`` bounds the shielded wait for a cancelled job.

    On exit, queued jobs fail with SchedulerClosed and running jobs are cancelled.
    Exceptions leave as themselves, never as an exception group.
    """
    scheduler = Scheduler(
        lanes=lanes,
        residency=residency,
        max_queue=max_queue,
        slot_poll=slot_poll,
        affinity=affinity,
        affinity_max_wait=affinity_max_wait,
        pinning=pinning,
        erase_on_handoff=erase_on_handoff,
        measure_timeout=measure_timeout,
        erase_timeout=erase_timeout,
        kv_parking=kv_parking,
        cleanup_timeout=cleanup_timeout,
    )
    try:
        async with trio.open_nursery() as nursery:
            scheduler._nursery = nursery
            await nursery.start(scheduler._serve_dispatcher)
            try:
                yield scheduler
            finally:
                scheduler._close()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise _unwrap(group) from None
