"""The Trio layer of the scheduler: one dispatcher task, and slots held by their callers.

A request takes a slot the way a task takes a ``trio.CapacityLimiter``::

    async with scheduler.slot("model", session="chat-1") as grant:
        ...  # send the request upstream with id_slot=grant.slot_id

``open_scheduler()`` owns a nursery with the dispatcher task. Every event that
can change a decision (a request, a slot released, a model becoming resident,
a ``/slots`` sample arriving, the poll) sets the dispatcher's wake event; the
dispatcher yields once (so a burst of requests in the same tick shares one
turn), then runs a *pass*: it asks
:class:`~gezel_trio.scheduler.policy.SchedulerPolicy` what to do from scratch and
does it. The pass is the only place a slot is granted, and it never awaits:
engine loads and ``/slots`` samples run as tasks that report back by waking the
dispatcher. A granted job holds its engine from that moment (the lane's
``hold()``, so no idle or pressure release can stop it) until its block exits.

The caller's ``async with`` then takes the GPU lease and *prepares* the slot
(:mod:`.preparation`); slot work off the critical path is :mod:`.maintenance`'s,
``/slots`` samples and reconciliation :mod:`.reconcile`'s. Exit records what the
slot now holds and wakes the dispatcher on every path.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType
from typing import TypeVar

import trio

from gezel_trio._trio import unwrapping
from gezel_trio.errors import (
    EngineCrashed,
    EngineFailed,
    EngineStopped,
    EngineTimeout,
    GezelError,
    SchedulerClosed,
    UnknownModel,
)
from gezel_trio.kv.lead import Lead
from gezel_trio.kv.prefix import Prefix
from gezel_trio.scheduler.admission import Action, Admit, Load, RunExclusive
from gezel_trio.scheduler.jobs import (
    JOB_KINDS,
    Grant,
    JobKind,
    JobState,
    Residency,
    SlotMeasurement,
)
from gezel_trio.scheduler.lanes import EngineLane
from gezel_trio.scheduler.maintenance import SlotMaintenance
from gezel_trio.scheduler.policy import SchedulerPolicy
from gezel_trio.scheduler.preparation import SlotPreparer
from gezel_trio.scheduler.queues import Job
from gezel_trio.scheduler.reconcile import Reconciler
from gezel_trio.scheduler.settings import SchedulerSettings
from gezel_trio.scheduler.slots import SlotTable
from gezel_trio.scheduler.stats import SchedulerStats
from gezel_trio.scheduler.trio_job import _TrioJob

__all__ = [
    "Scheduler",
    "SchedulerClosed",
    "SlotRequest",
    "open_scheduler",
]

log = logging.getLogger("gezel_trio.scheduler")

_ENGINE_FAILURES = (EngineTimeout, EngineCrashed)
"""What a job's block raises when its engine timed out or died (a slot left then is not
saved in the background: the save would only wait on that engine)."""

T = TypeVar("T")


class SlotRequest:
    """``async with scheduler.slot(...) as grant``: see :meth:`Scheduler.slot`."""

    __slots__ = ("_job", "_scheduler", "_stack")

    def __init__(self, scheduler: Scheduler, job: _TrioJob) -> None:
        self._scheduler = scheduler
        self._job = job
        self._stack = AsyncExitStack()

    def __repr__(self) -> str:
        job = self._job
        return f"<SlotRequest {job.model_id} {job.kind} {job.state.value} slot={job.slot_id}>"

    async def __aenter__(self) -> Grant:
        scheduler, job = self._scheduler, self._job
        scheduler._enqueue(job)
        try:
            await job.granted.wait()
        except BaseException:
            scheduler._withdraw(job)
            raise
        if job.error is not None:
            error, job.error = job.error, None
            raise error
        try:
            if scheduler._closed:
                raise SchedulerClosed("the scheduler shut down before the job could start")
            lane = scheduler._lanes.get(job.model_id)
            if lane is None:
                raise UnknownModel(f"model {job.model_id!r} was removed")
            await self._stack.__aenter__()
            job.scope = self._stack.enter_context(trio.CancelScope())
            await self._stack.enter_async_context(lane.lease())
            return await scheduler._preparer.prepare(job, lane)
        except BaseException as exc:
            await self._stack.__aexit__(type(exc), exc, exc.__traceback__)
            scheduler._release(job)
            if job.scope is not None and job.scope.cancelled_caught:  # only a shutdown
                raise SchedulerClosed("the scheduler shut down before the job started") from None
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        scheduler, job = self._scheduler, self._job
        try:
            await self._stack.__aexit__(exc_type, exc, tb)
        finally:
            scheduler._release(job, engine_failed=isinstance(exc, _ENGINE_FAILURES))
        assert job.scope is not None
        if job.scope.cancelled_caught:  # only a shutdown cancels this scope
            raise SchedulerClosed(f"the scheduler shut down before the {job.kind} could finish")


class Scheduler:
    """Handle yielded by :func:`open_scheduler`. See :meth:`slot`."""

    def __init__(
        self, *, lanes: Mapping[str, EngineLane], settings: SchedulerSettings | None = None
    ) -> None:
        self.settings = settings = settings or SchedulerSettings()
        self._lanes: dict[str, EngineLane] = {}
        self._policy = SchedulerPolicy(
            residency=settings.residency,
            max_queue=settings.max_queue,
            affinity=settings.affinity,
            affinity_max_wait=settings.affinity_max_wait,
            short_first_passes=settings.short_first_passes,
            erase_on_handoff=settings.erase_on_handoff,
        )
        for model_id, lane in lanes.items():
            self._check_lane(model_id, lane)
            self._lanes[model_id] = lane
            self._policy.add_lane(lane)
        self._wake_event = trio.Event()
        self._poll_at: float | None = None
        self._nursery: trio.Nursery | None = None
        self._closed = False
        self._running: set[_TrioJob] = set()
        self._maintenance = SlotMaintenance(
            policy=self._policy, lanes=self._lanes, settings=settings, wake=self._wake
        )
        self._preparer = SlotPreparer(
            policy=self._policy, settings=settings, maintenance=self._maintenance, wake=self._wake
        )
        self._reconciler = Reconciler(
            policy=self._policy,
            lanes=self._lanes,
            settings=settings,
            wake=self._wake,
            poll_later=self._poll_later,
        )

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
        """The policy object (read-only use: tests, diagnostics). The host asks
        :meth:`is_down`, :meth:`holds` and :meth:`table` instead."""
        return self._policy

    def is_down(self, model_id: str) -> bool:
        """Whether ``model_id`` is down: its last load failed or its ``/slots`` could
        not be sampled (until it answers again)."""
        return self._policy.is_down(model_id)

    def holds(self, model_id: str, session: str) -> bool:
        """Whether a slot of ``model_id`` holds ``session``'s KV (False once the model is
        removed: a request routed to it before then learns so when it queues)."""
        table = self._policy.served_table(model_id)
        return table is not None and table.holds(session)

    def table(self, model_id: str) -> SlotTable:
        """``model_id``'s slot table, synced to its engine generation (read-only use).
        Raises KeyError for a model the scheduler does not serve."""
        return self._policy.table(model_id)

    def slot(
        self,
        model_id: str,
        *,
        session: str | None = None,
        keyless: bool = False,
        prefix: Prefix = (),
        caller: str | None = None,
        parked: bool = False,
        reuse: int = 0,
        lead: Lead | None = None,
        kind: JobKind = "completion",
        any_slot: bool = False,
        needs_slot: bool = True,
        pool: bool = False,
    ) -> SlotRequest:
        """Wait for a slot of ``model_id`` and hold it for the ``async with`` block.

        ``session`` is the request's owner: a caller's named session, or with
        ``keyless`` the caller's keyless owner
        (:meth:`~gezel_trio.kv.sessions.SessionKeys.keyless`), whose KV is erased and
        never parked when its slot changes owner. ``None`` is a blind keyless job
        (``grant.blind``: sent with ``cache_prompt`` off). ``prefix``: the
        request's blocks (:func:`~gezel_trio.kv.prefix.prefix_blocks`), so
        that it goes to its owner's slot it continues; ``()`` when unknown (its
        owner's most recently used free slot). ``caller``: the owner's caller, when
        the job may start from a prefix another owner of that caller left in a slot
        (the engine cuts the slot back to what the two share; None: never, and never
        across callers); ``parked``: the owner has a parked copy for the request,
        so no such slot is sought for it (see
        :func:`~gezel_trio.scheduler.admission.choose_slot`); ``reuse``: how many
        blocks of ``prefix`` that parked copy holds (SHORT WORK FIRST counts them as
        no work). ``lead``: the caller's
        lead (:meth:`~gezel_trio.kv.lead.Lead.for_caller`) that a slot holding nothing
        of the owner's is started from instead of erased (a model that cannot cut a
        slot back; see :mod:`gezel_trio.kv.lead`).

        The block is entered once the model is resident, the job's turn has come,
        its slot is pinned and prepared: ``grant.slot_id`` holds nothing but
        ``session``'s KV or nothing at all (anything for a blind job), and the GPU
        lease is held. ``kind`` other than ``"completion"`` is exclusive: it runs
        alone on a drained engine with ``grant.slot_id`` ``None``. ``any_slot``: the
        engine picks the slot (embeddings), so the job waits for and holds every
        slot. ``needs_slot`` False: the call occupies capacity but sends nothing
        to a slot (tokenize, props on an engine that must be made resident).
        ``pool``: the job may run on any replica of ``model_id``'s family (its
        session holds no KV anywhere); ``grant.model_id`` names the one it got. A
        replica that goes down moves its queued jobs to a live sibling either way.

        Raises (on entry) UnknownModel, QueueFull (with ``retry_after``), the
        engine's error when the model cannot be made resident, EngineFailed when
        the slot cannot be made safe, SchedulerClosed on shutdown. Exceptions of
        the block pass through unchanged.

        Cancellation while queued withdraws the job; during preparation it leaves
        the slot unknown (erased before its next use); in the block it exits the
        block as usual. Exit records what the slot now holds, releases the pin,
        the lease and the engine hold, and wakes the dispatcher, on every path. A
        shutdown cancels the block, which then raises SchedulerClosed.
        """
        if kind not in JOB_KINDS:
            raise ValueError(f"unknown job kind {kind!r}")
        job = _TrioJob(
            model_id=model_id,
            kind=kind,
            session=session,
            keyless=keyless and session is not None,
            prefix=tuple(prefix),
            caller=caller if session is not None else None,
            parked=parked,
            reuse=reuse if session is not None else 0,
            lead=lead if session is not None else None,
            any_slot=any_slot,
            needs_slot=needs_slot and not any_slot and kind == "completion",
            pool=pool and kind == "completion" and not any_slot,
        )
        return SlotRequest(self, job)

    async def submit(
        self,
        model_id: str,
        run: Callable[[Grant], Awaitable[T]],
        *,
        session: str | None = None,
        kind: JobKind = "completion",
    ) -> T:
        """``run(grant)`` inside :meth:`slot`; returns its result (tests, one-shot ops)."""
        async with self.slot(model_id, session=session, kind=kind) as grant:
            return await run(grant)

    def set_residency(self, residency: Residency) -> None:
        """Switch between ``swap`` and ``coexist`` live (see SchedulerPolicy.set_residency)."""
        self._policy.set_residency(residency)
        self._wake()

    def forget_slots(self, model_id: str) -> None:
        """Make every slot of ``model_id`` unknown: each is erased before its next use."""
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
            self._fail(job, UnknownModel(f"model {model_id!r} was removed"))
        self._wake()

    def statistics(self) -> SchedulerStats:
        return self._policy.snapshot()

    def member_reachable(self, model_id: str) -> None:
        """A replica that was down answers again: its jobs may be admitted there."""
        self._policy.member_reachable(model_id)
        self._wake()

    # ------------------------------------------------------------------ job lifecycle

    def _enqueue(self, job: _TrioJob) -> None:
        """Queue ``job``. A job that finds nobody else waiting, for a model whose turn
        is open, is decided at once, by a pass run here: a lone job joining a running
        turn is what the dispatcher would decide too, and this saves the two task
        switches of a handoff to it. Any other job is left to the dispatcher, which
        decides for all of a tick's arrivals together (a turn started for the first
        of them would leave out the others)."""
        if self._closed or self._nursery is None:
            raise SchedulerClosed("the scheduler is not running")
        policy = self._policy
        alone = policy.queued == 0 and policy.is_turn(job.model_id)
        policy.enqueue(job, now=trio.current_time())
        if alone:
            self._pass()
        if not alone or job.state is JobState.QUEUED or self._poll_at is not None:
            self._wake()  # (a pass that granted the job left the dispatcher nothing to do)

    def _withdraw(self, job: _TrioJob) -> None:
        """The caller was cancelled while waiting for its grant."""
        if job.state is JobState.QUEUED:
            self._policy.cancel(job)
            self._wake()
        elif job.state is JobState.RUNNING:  # granted in the same tick
            self._release(job)

    def _grant(self, job: _TrioJob, lane: EngineLane) -> None:
        """Called by the pass for each admitted job: hold the engine, wake the caller."""
        job.hold = lane.hold()
        job.hold.__enter__()
        self._running.add(job)
        job.granted.set()

    def _release(self, job: _TrioJob, *, engine_failed: bool = False) -> None:
        """The caller's block is over (or never started): settle the job. Synchronous,
        so cancellation cannot interrupt it. A blind job's slot is erased later, once
        it has stayed idle; an owner's is saved then (``save_idle_slots``), unless the
        block ended because the engine failed it (``engine_failed``: it timed out or
        died), when a save would only wait on that engine. A save that starts at once
        takes its engine hold before the job's is dropped: the engine never looks idle
        between the two."""
        if job.state is not JobState.RUNNING:
            return
        self._running.discard(job)
        policy = self._policy
        policy.settle(job, now=trio.current_time())
        try:
            slot = job.slot_id
            lane = self._lanes.get(job.model_id)
            if (
                job.ran
                and slot is not None
                and lane is not None
                and self._nursery is not None
                and not self._closed
            ):
                table = policy.table_of(job)
                if slot < len(table):
                    released = table.slots[slot].released
                    maintenance = self._maintenance
                    if job.session is None:
                        self._nursery.start_soon(maintenance.erase_when_idle, job, lane, released)
                    elif (
                        self.settings.save_idle_slots
                        and not engine_failed
                        and maintenance.parking(lane)
                    ):
                        maintenance.save_soon(self._nursery, job.model_id, lane, slot, released)
        finally:
            self._drop_hold(job)
        self._wake()

    @staticmethod
    def _drop_hold(job: _TrioJob) -> None:
        hold, job.hold = job.hold, None
        if hold is not None:
            hold.__exit__(None, None, None)

    def _fail(self, job: Job, error: BaseException) -> None:
        assert isinstance(job, _TrioJob)
        job.error = error
        job.granted.set()

    # ------------------------------------------------------------------ parking maintenance

    async def park_owned(self, model_id: str) -> int:
        """Save every slot of ``model_id`` that holds a session's KV not parked yet (see
        :meth:`SlotMaintenance.park_owned`): how many were saved."""
        return await self._maintenance.park_owned(model_id)

    def sessions_in_slots(self) -> list[tuple[str, int, str]]:
        """(model id, slot, session) for every slot whose table says it holds a
        session's KV."""
        return self._maintenance.sessions_in_slots()

    async def erase_session(self, session: str) -> tuple[int, int]:
        """Erase every idle slot that holds ``session``'s KV (see
        :meth:`SlotMaintenance.erase_session`): (erased, busy)."""
        return await self._maintenance.erase_session(session)

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
            # Yield once so that every request of this tick is queued before we decide.
            await trio.lowlevel.checkpoint()
            self._wake_event = trio.Event()
            self._poll_at = None
            self._pass()

    def _plan(self) -> list[Action]:
        """The policy's plan, with every load of an engine that is resident already
        (:meth:`~.lanes.EngineLane.resident_now`: a model idle since its last request)
        settled on the spot and planned again: its jobs are admitted in this pass,
        where a load task would have cost a task and another pass before the grant.
        What a plan marked (other loads, exclusive jobs) is kept; admissions come
        from the last plan."""
        planned: list[Action] = []
        for _ in range(len(self._lanes) + 1):
            actions = self._policy.plan()
            settled = [
                a
                for a in actions
                if isinstance(a, Load)
                and (lane := self._lanes.get(a.model_id)) is not None
                and lane.resident_now()
            ]
            if not settled:
                break
            for load in settled:
                self._policy.load_done(load.model_id)
            planned += [
                a
                for a in actions
                if not isinstance(a, Admit) and not any(a is load for load in settled)
            ]
        else:  # pragma: no cover - each round settles another model's load
            actions = self._policy.plan()
        return [*planned, *actions]

    def _poll_later(self, at: float) -> None:
        if self._poll_at is None or at < self._poll_at:
            self._poll_at = at

    def _pass(self) -> None:
        """Re-derive every decision from scratch and act on it: the only place a slot
        is granted. Never awaits I/O. A sample of an external engine is consumed by
        the first pass after it arrives (admitting against it), or dropped."""
        policy = self._policy
        nursery = self._nursery
        assert nursery is not None
        started = time.perf_counter()
        fresh = self._reconciler.take_samples()
        now = trio.current_time()
        for action in self._plan():
            if isinstance(action, Admit):
                model_id = action.model_id
                lane = self._lanes[model_id]
                measured: SlotMeasurement | None = None
                if not lane.sole_client:
                    if model_id not in fresh:
                        self._reconciler.start_measure(model_id)
                        continue
                    measured = fresh[model_id]
                else:  # a new engine process: reconcile its table once, in the background
                    self._reconciler.reconcile_new_engine(model_id, lane.generation, now)
                admission = policy.admit(model_id, measured, now=now)
                for admitted in admission.jobs:
                    assert isinstance(admitted, _TrioJob)
                    self._grant(admitted, lane)
                if admission.poll:
                    if lane.sole_client:
                        self._reconciler.reconcile_soon(model_id, now)
                    else:
                        self._poll_later(now + self.settings.slot_poll)
            elif isinstance(action, Load):
                nursery.start_soon(self._load, action.model_id)
            elif isinstance(action, RunExclusive):
                job = action.job
                assert isinstance(job, _TrioJob)
                exclusive_lane = self._lanes.get(job.model_id)
                if exclusive_lane is None:  # pragma: no cover - a removed lane plans nothing
                    policy.settle(job, now=now)
                    self._fail(job, UnknownModel(f"model {job.model_id!r} was removed"))
                    continue
                self._grant(job, exclusive_lane)
        policy.note_pass(time.perf_counter() - started)

    # ------------------------------------------------------------------ loads, shutdown

    async def _load(self, model_id: str) -> None:
        """Make ``model_id`` resident; on failure fail the jobs of its turn."""
        lane = self._lanes.get(model_id)
        done = False
        try:
            if lane is None:
                raise EngineFailed(f"model {model_id!r} has no lane")
            for attempt in range(_LOAD_ATTEMPTS):
                try:
                    await lane.ensure_resident()
                    break
                except EngineStopped:
                    # Stopped while starting: in swap mode, by the load of a turn that
                    # has ended since. While this is still the model's turn, start again.
                    if attempt + 1 == _LOAD_ATTEMPTS or not self._policy.is_turn(model_id):
                        raise
                    log.info("engine for %s was stopped while starting: starting again", model_id)
            done = True
            self._policy.load_done(model_id)
        except Exception as exc:
            done = True
            error: BaseException = exc
            if not isinstance(exc, GezelError):
                error = EngineFailed(f"engine for {model_id!r} could not be made resident: {exc!r}")
                error.__cause__ = exc
            if isinstance(exc, EngineStopped) and not self._policy.is_turn(model_id):
                log.info("load of %s abandoned: its turn ended while it started", model_id)
            else:
                log.warning("engine for %s could not be made resident: %r", model_id, exc)
            for job in self._policy.load_failed(model_id):
                self._fail(job, _copy_error(error))
        finally:
            if not done:
                self._policy.load_aborted(model_id)
            self._wake()

    def _close(self) -> None:
        self._closed = True
        for job in self._policy.fail_all():
            self._fail(job, SchedulerClosed("the scheduler shut down"))
        for job in list(self._running):
            if job.scope is not None:
                job.scope.cancel()


#: Starts of one load before its jobs fail, when each is stopped by another's eviction.
_LOAD_ATTEMPTS = 3


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


@asynccontextmanager
async def open_scheduler(
    *, lanes: Mapping[str, EngineLane], settings: SchedulerSettings | None = None
) -> AsyncIterator[Scheduler]:
    """Run a scheduler over ``lanes`` (model id -> lane) for the duration of the block.

    On exit, queued jobs fail with SchedulerClosed and held slots are cancelled
    (their holders see SchedulerClosed). Exceptions leave as themselves, never
    as an exception group.
    """
    scheduler = Scheduler(lanes=lanes, settings=settings)
    async with unwrapping(), trio.open_nursery() as nursery:
        scheduler._nursery = scheduler._reconciler.nursery = nursery
        await nursery.start(scheduler._serve_dispatcher)
        await nursery.start(scheduler._reconciler.serve)
        try:
            yield scheduler
        finally:
            scheduler._close()
            nursery.cancel_scope.cancel()
