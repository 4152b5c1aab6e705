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
from the model's :class:`~gezel_trio.scheduler.slots.SlotTable`: it parks the
outgoing owner's KV (unless its parked copy is current), restores the caller's
own parked copy that shares the longest prefix with its request, or erases the
slot, recording each transition before the I/O. Every owner is parked alike: a
named session, a caller's keyless owner, a keyless conversation. Only
a slot whose content is the job's own owner's, or empty, is handed over to a
job with an owner (a named session, or a caller's keyless owner); when an
erase is not acknowledged the request fails (503) and the slot stays unknown.
A keyless job without an owner (``[scheduler] keyless = "blind"``) is blind
(``grant.blind``: the caller sends it with ``cache_prompt`` off, so it reads
nothing the slot held) and needs no erase before it. Exit records what the
slot now holds and wakes the dispatcher on every path. The slot a blind job
leaves is erased off the critical path once it has stayed idle for
``idle_erase_delay`` (pinned until the engine acknowledges), or before an
owner's job takes it, whichever comes first.

With ``save_idle_slots``, the slot an owner's job leaves is saved off the
critical path once it has stayed idle for ``save_idle_delay``: the slot is
marked *being saved* in the table (not pinned), a job placed on it waits for the
save before anything is sent to it, and the copy is then current, so a handoff
skips the save: a keyed handoff makes 2 upstream calls (restore or erase, then
the request) instead of 3. ``statistics().parking`` counts ``handoffs`` and their
``handoff_calls`` (the requests included) and ``saved_idle``.

For engines the host spawned, free slots come from the table; ``/slots`` is
only sampled to reconcile (after each engine start, every
``reconcile_interval``, and when capacity is zero): a slot busy with work the
host did not send is held out and erased before use. External engines may have
other clients, so each admission there consumes a fresh sample, and only slots
it names idle are pinned.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    AsyncExitStack,
    asynccontextmanager,
)
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType
from typing import Protocol, TypeVar, runtime_checkable

import trio

from gezel_trio._trio import unwrapping
from gezel_trio.errors import (
    EngineCrashed,
    EngineFailed,
    EngineStopped,
    GezelError,
    SchedulerClosed,
    UnknownModel,
)
from gezel_trio.scheduler.policy import (
    JOB_KINDS,
    Admit,
    Grant,
    Job,
    JobKind,
    JobState,
    LaneInfo,
    Load,
    Residency,
    RunExclusive,
    SchedulerPolicy,
    SchedulerStats,
    SlotMeasurement,
)
from gezel_trio.scheduler.prefix import Prefix, is_prefix, shared_blocks
from gezel_trio.scheduler.slots import Content

__all__ = [
    "EngineLane",
    "ParkingLane",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerSettings",
    "SlotRequest",
    "open_scheduler",
]

log = logging.getLogger("gezel_trio.scheduler")

T = TypeVar("T")


@runtime_checkable
class ParkingLane(Protocol):
    """A lane that can park a session's KV on disk and bring it back (slot save/restore)."""

    @property
    def parking_enabled(self) -> bool:
        """False for a model whose restores proved not to take (it erases instead)."""
        ...

    def is_parked(self, session: str | None, prefix: Prefix | None = None) -> bool:
        """Whether ``session`` has a parked copy to restore for a request of ``prefix``
        blocks (None: any copy)."""
        ...

    def parked_blocks(self, session: str | None, prefix: Prefix | None = None) -> Prefix | None:
        """The blocks of the copy a restore for ``prefix`` would bring back (None: none)."""
        ...

    def is_current(self, session: str, blocks: Prefix) -> bool:
        """Whether a parked copy of ``session`` holds exactly ``blocks``."""
        ...

    def note_miss(self) -> None:
        """A keyed job found its session neither in its slot nor parked."""
        ...

    async def park_slot(self, slot_id: int, session: str, blocks: Prefix = ()) -> int:
        """Save the slot's KV for ``session`` as a copy of ``blocks``: the tokens saved
        (0: the slot was empty)."""
        ...

    async def unpark_slot(self, slot_id: int, session: str, prefix: Prefix | None = None) -> int:
        """Restore ``session``'s parked copy for ``prefix`` into the slot: the tokens
        restored (0: none)."""
        ...


class EngineLane(LaneInfo, Protocol):
    """What the scheduler needs from one model's engine."""

    @property
    def ready(self) -> bool:
        """The engine is running and answering (requests can be sent now)."""
        ...

    async def ensure_resident(self) -> None:
        """Start or switch the engine lazily; raises project errors (EngineFailed, NoCapacity)."""
        ...

    async def wait_failed(self) -> None:
        """Return once the engine has failed (dead, or its health checks fail)."""
        ...

    async def measure_slots(self) -> SlotMeasurement | None:
        """``GET /slots``; ``None`` when unknown."""
        ...

    async def erase_slot(self, slot_id: int) -> None:
        """``POST /slots/{id}?action=erase``; returns once acknowledged, may raise."""
        ...

    def hold(self) -> AbstractContextManager[object]:
        """Keep the engine from being stopped (idle TTL, pressure) while entered."""
        ...

    def lease(self) -> AbstractAsyncContextManager[object]:
        """The GPU lease a running job holds (protects it from eviction)."""
        ...


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    """Every knob of the scheduler, in one place (config, host, tests, benchmarks).

    ``residency``: ``swap`` (one model resident at a time, one turn for all) or
    ``coexist`` (each model its own turns). ``max_queue`` bounds queued jobs
    (QueueFull beyond). ``slot_poll``: the ``/slots`` poll interval when capacity
    is zero and none of our jobs runs. ``reconcile_interval``: background
    ``/slots`` reconciliation of spawned engines. ``measure_timeout``,
    ``erase_timeout`` and ``park_timeout`` bound one sample, one erase and one
    save or restore. ``save_idle_slots``: save an owner's slot in the background
    once it has stayed idle ``save_idle_delay`` seconds after its job (with
    ``kv_parking``), so that a handoff finds its copy current.
    """

    residency: Residency = "swap"
    max_queue: int = 256
    slot_poll: float = 0.25
    affinity: bool = True
    affinity_max_wait: float = 1.0
    erase_on_handoff: bool = True
    kv_parking: bool = True
    measure_timeout: float = 2.0
    erase_timeout: float = 5.0
    park_timeout: float = 30.0
    reconcile_interval: float = 5.0
    idle_erase_delay: float = 0.1
    save_idle_slots: bool = True
    save_idle_delay: float = 0.0

    def __post_init__(self) -> None:
        if self.slot_poll <= 0:
            raise ValueError(f"slot_poll must be > 0, not {self.slot_poll}")
        if self.reconcile_interval <= 0:
            raise ValueError(f"reconcile_interval must be > 0, not {self.reconcile_interval}")
        if self.idle_erase_delay < 0:
            raise ValueError(f"idle_erase_delay must be >= 0, not {self.idle_erase_delay}")
        if self.save_idle_delay < 0:
            raise ValueError(f"save_idle_delay must be >= 0, not {self.save_idle_delay}")


@dataclass(frozen=True, eq=False, slots=True)
class _Cleanup:
    """The pin of a background erase (no job holds the slot meanwhile), or the mark of a
    background save."""

    model_id: str
    slot: int


@dataclass(eq=False, slots=True)
class _TrioJob(Job):
    granted: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None
    hold: AbstractContextManager[object] | None = None
    scope: trio.CancelScope | None = None


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
            return await scheduler._prepare(job, lane)
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
            scheduler._release(job)
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
        self._measure_failing: set[str] = set()
        self._measuring: set[str] = set()  # models with a /slots sample in flight
        self._measured: dict[str, SlotMeasurement | None] = {}  # samples for the next pass
        self._reconciled_at: dict[str, float] = {}
        self._reconciled_generation: dict[str, int] = {}
        self._saves: dict[tuple[str, int], trio.Event] = {}  # background saves in flight

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

    def slot(
        self,
        model_id: str,
        *,
        session: str | None = None,
        keyless: bool = False,
        prefix: Prefix = (),
        kind: JobKind = "completion",
        any_slot: bool = False,
        needs_slot: bool = True,
        pool: bool = False,
    ) -> SlotRequest:
        """Wait for a slot of ``model_id`` and hold it for the ``async with`` block.

        ``session`` is the request's owner: a caller's named session, or with
        ``keyless`` the caller's keyless owner
        (:meth:`~gezel_trio.sessions.SessionKeys.keyless`), whose KV is erased and
        never parked when its slot changes owner. ``None`` is a blind keyless job
        (``grant.blind``: sent with ``cache_prompt`` off). ``prefix``: the
        request's blocks (:func:`~gezel_trio.scheduler.prefix.prefix_blocks`), so
        that it goes to its owner's slot it continues; ``()`` when unknown (its
        owner's most recently used free slot).

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
        if self._closed or self._nursery is None:
            raise SchedulerClosed("the scheduler is not running")
        self._policy.enqueue(job, now=trio.current_time())
        self._wake()

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

    def _release(self, job: _TrioJob) -> None:
        """The caller's block is over (or never started): settle the job. Synchronous,
        so cancellation cannot interrupt it. A blind job's slot is erased later, once
        it has stayed idle; an owner's is saved then (``save_idle_slots``)."""
        if job.state is not JobState.RUNNING:
            return
        self._running.discard(job)
        policy = self._policy
        policy.settle(job, now=trio.current_time())
        self._drop_hold(job)
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
                if job.session is None:
                    self._nursery.start_soon(self._erase_when_idle, job, lane, released)
                elif self.settings.save_idle_slots and self._parking(lane):
                    self._nursery.start_soon(
                        self._save_when_idle, job.model_id, lane, slot, released
                    )
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

    # ------------------------------------------------------------------ preparation

    def _check_pin(self, job: _TrioJob) -> None:
        table = self._policy.table_of(job)
        if job.slot_id is not None and table.pinned_to(job.slot_id) is not job:
            raise EngineCrashed(
                f"the engine for {job.model_id!r} restarted with fewer slots before the "
                "request was sent; it was not sent"
            )

    async def _prepare(self, job: _TrioJob, lane: EngineLane) -> Grant:
        """Make the job's slot safe (and warm) for it and return its grant.

        Each step is recorded in the slot table before its I/O: a step cut short
        by cancellation or a failure leaves the slot unknown. Raises EngineFailed
        when the slot cannot be made safe (the request is not sent).
        """
        if not job.exclusive and not lane.ready:
            # The engine went away after admission (a crash): restart it lazily
            # rather than fail a request the engine never saw. If that fails, a
            # replica hands the rest of its queue on before this job fails.
            try:
                await lane.ensure_resident()
            except GezelError:
                if self._policy.member_down(job.model_id):
                    self._wake()
                raise
        calls, erased, restored = 0, False, 0
        slot = job.slot_id
        if slot is not None:
            if lane.sole_client:
                calls, erased, restored = await self._prepare_slot(job, lane, slot)
            else:
                calls, erased, restored = await self._prepare_watched(job, lane, slot)
        job.ran = True
        return Grant(
            model_id=job.model_id,
            slot_id=slot,
            blind=slot is not None and job.session is None,
            erased=erased,
            queue_wait_s=trio.current_time() - job.submitted_at,
            prepare_calls=calls,
            generation=self._policy.table_of(job).generation,
            restored_tokens=restored,
        )

    async def _prepare_watched(
        self, job: _TrioJob, lane: EngineLane, slot: int
    ) -> tuple[int, bool, int]:
        """:meth:`_prepare_slot` on an engine the host does not run, abandoned when the
        engine fails meanwhile: a hung external engine answers no slot call, and its
        health checks say so sooner than the calls' own timeouts. The slot is left
        unknown and EngineFailed raised (the request is not sent)."""
        result = await _unless_failed(lane, partial(self._prepare_slot, job, lane, slot))
        if result is None:
            raise EngineFailed(
                f"the engine for {job.model_id!r} failed while slot {slot} was prepared; "
                "the request was not sent"
            )
        return result[0]

    def _parking(self, lane: EngineLane | None) -> bool:
        return self.settings.kv_parking and isinstance(lane, ParkingLane) and lane.parking_enabled

    async def _wait_for_save(self, model_id: str, slot: int) -> None:
        """Return once no background save is in flight on ``slot`` (at most
        ``park_timeout``: the save's own bound). Cancellation just stops the wait."""
        while self._policy.table(model_id).saving(slot) is not None:
            done = self._saves.get((model_id, slot))
            if done is None:
                return
            with trio.move_on_after(self.settings.park_timeout) as scope:
                await done.wait()
            if scope.cancelled_caught:
                return

    async def _prepare_slot(
        self, job: _TrioJob, lane: EngineLane, slot: int
    ) -> tuple[int, bool, int]:
        """Park, restore or erase ``slot`` until it holds only ``job``'s session's KV (or
        nothing); returns (upstream calls made, erased or restored, tokens restored
        that the next completion should reuse: 0 when the restored copy is not a
        prefix of the request). A background save of the slot is waited for first:
        its copy is then current, and the handoff skips the save."""
        await self._wait_for_save(job.model_id, slot)
        calls = 0
        erased = False
        restored = 0
        parking = self._parking(lane)
        restore_failed = False
        prefix = job.prefix

        def is_parked(session: str) -> bool:
            return (
                not restore_failed
                and isinstance(lane, ParkingLane)
                and lane.is_parked(session, prefix)
            )

        def is_current(session: str, blocks: Prefix) -> bool:
            return isinstance(lane, ParkingLane) and lane.is_current(session, blocks)

        def parked_shares(session: str) -> int | None:
            if restore_failed or not isinstance(lane, ParkingLane):
                return None
            blocks = lane.parked_blocks(session, prefix)
            return None if blocks is None else shared_blocks(blocks, prefix)

        first_owner = self._policy.table_of(job).owner(slot)
        handoff = job.session is not None and first_owner not in (None, job.session)
        for _ in range(4):
            self._check_pin(job)
            table = self._policy.table_of(job)
            prep = table.preparation(
                slot,
                job.session,
                erase_on_handoff=self._policy.erase_on_handoff,
                parking=parking,
                is_parked=is_parked,
                prefix=prefix,
                is_current=is_current,
                parked_shares=parked_shares,
            )
            owner = table.owner(slot)
            if parking and owner is not None and owner != job.session and prep.park is None:
                self._policy.parks_skipped += 1  # its parked copy is still current
            if (
                parking
                and calls == 0
                and job.session is not None
                and owner != job.session
                and not prep.restore
            ):
                assert isinstance(lane, ParkingLane)
                lane.note_miss()
            if prep.calls == 0:
                break
            calls += prep.calls
            if prep.park is not None:
                assert isinstance(lane, ParkingLane)
                if not await self._park(job, lane, prep.park):
                    parking = False  # that session re-prefills later; go on without
            if prep.restore:
                assert isinstance(lane, ParkingLane) and job.session is not None
                restored = await self._restore(job, lane, job.session)
                if restored:
                    erased = True
                else:
                    restore_failed = True
            elif prep.erase:
                await self._erase(job, lane)
                erased = True
        else:  # pragma: no cover - each round makes progress or raises
            raise EngineFailed(f"slot {slot} of {job.model_id!r} could not be prepared")
        self._check_pin(job)
        table = self._policy.table_of(job)
        blocks = table.blocks(slot)
        if restored and prefix and blocks and not is_prefix(blocks, prefix):
            restored = 0  # another branch of the conversation: only a part is reused
        if handoff:
            self._policy.handoffs += 1
            self._policy.handoff_calls += calls + 1  # and the request itself
        table.sending(slot, job)
        return calls, erased, restored

    async def _park(self, job: _TrioJob, lane: ParkingLane, session: str) -> bool:
        """Save ``session``'s KV before its slot changes hands; False when it failed
        (logged and counted: the handoff goes on, that session re-prefills later)."""
        slot = job.slot_id
        assert slot is not None
        blocks = self._policy.table_of(job).blocks(slot)
        with trio.move_on_after(self.settings.park_timeout):
            try:
                saved = await lane.park_slot(slot, session, blocks)
            except Exception as exc:
                log.warning("parking %s slot %d failed: %r", job.model_id, slot, exc)
            else:
                self._check_pin(job)
                table = self._policy.table_of(job)
                if saved:
                    table.parked(slot, job, session)
                    self._policy.parks_saved += 1
                else:  # the engine says the slot holds no token: it is empty
                    table.erased(slot, job)
                return True
        self._policy.parks_failed += 1
        return False

    async def _restore(self, job: _TrioJob, lane: ParkingLane, session: str) -> int:
        """Restore the job's own parked copy sharing the longest prefix with its request
        into its slot (which also replaces whatever the slot held): the tokens restored.
        0 when it did not take: the slot is then unknown."""
        slot = job.slot_id
        assert slot is not None
        blocks = lane.parked_blocks(session, job.prefix) or ()
        self._policy.table_of(job).sending(slot, job)
        restored = 0
        with trio.move_on_after(self.settings.park_timeout):
            try:
                restored = await lane.unpark_slot(slot, session, job.prefix)
            except Exception as exc:
                log.warning("restoring %s slot %d failed: %r", job.model_id, slot, exc)
        if not restored:
            self._policy.parks_failed += 1
            return 0
        self._check_pin(job)
        self._policy.table_of(job).restored(slot, job, session, keyless=job.keyless, blocks=blocks)
        self._policy.parks_restored += 1
        return restored

    async def _erase(self, job: _TrioJob, lane: EngineLane) -> None:
        """Erase the job's slot and await the acknowledgement. Raises EngineFailed when
        the engine does not acknowledge it (the slot stays unknown)."""
        slot = job.slot_id
        assert slot is not None
        self._policy.table_of(job).sending(slot, job)
        failure = f"no answer within {self.settings.erase_timeout:g}s"
        with trio.move_on_after(self.settings.erase_timeout):
            try:
                await lane.erase_slot(slot)
            except Exception as exc:
                failure = repr(exc)
            else:
                self._check_pin(job)
                self._policy.table_of(job).erased(slot, job)
                self._policy.note_erase(ok=True)
                return
        self._policy.note_erase(ok=False)
        log.warning("erase of %s slot %d failed: %s", job.model_id, slot, failure)
        raise EngineFailed(
            f"the engine for {job.model_id!r} did not acknowledge the erase of slot {slot} "
            f"({failure}); the request was not sent"
        )

    async def park_owned(self, model_id: str) -> int:
        """Save every slot of ``model_id`` that holds a session's KV not parked yet:
        what a planned stop of its engine runs before the SIGTERM. Returns how many
        were saved.

        Background saves in flight end first (each within ``park_timeout``). Each slot
        is pinned while it is saved (no job can take it meanwhile) and each save has
        ``park_timeout``; a failed or cut save loses only that session's KV (it
        re-prefills). Works while the scheduler shuts down too (no tasks needed).
        Cancellation stops between or inside saves; what was saved stays parked.
        """
        lane = self._lanes.get(model_id)
        if not self._parking(lane):
            return 0
        assert isinstance(lane, ParkingLane)
        for key in [key for key in self._saves if key[0] == model_id]:
            await self._wait_for_save(*key)  # a background save ends first
        table = self._policy.table(model_id)
        generation = table.generation
        saved = 0
        for entry in list(table.slots):
            session = entry.session
            if (
                entry.content is not Content.OWNED
                or session is None
                or entry.pin is not None
                or entry.held_out
                or entry.saving is not None
                or (entry.parked_current and lane.is_current(session, entry.blocks))
            ):
                continue
            cleanup = _Cleanup(model_id, entry.id)
            table.pin(entry.id, cleanup)
            try:
                with trio.move_on_after(self.settings.park_timeout):
                    try:
                        tokens = await lane.park_slot(entry.id, session, entry.blocks)
                    except Exception as exc:
                        log.warning("parking %s slot %d failed: %r", model_id, entry.id, exc)
                        self._policy.parks_failed += 1
                        continue
                    table = self._policy.table(model_id)
                    if table.generation == generation and table.pinned_to(entry.id) is cleanup:
                        if tokens:
                            table.parked(entry.id, cleanup, session)
                        else:
                            table.erased(entry.id, cleanup)
                    if tokens:
                        self._policy.parks_saved += 1
                        saved += 1
            finally:
                self._policy.table(model_id).unpin(entry.id, cleanup)
                self._wake()
        return saved

    def sessions_in_slots(self) -> list[tuple[str, int, str]]:
        """(model id, slot, session) for every slot whose table says it holds a
        session's KV."""
        out: list[tuple[str, int, str]] = []
        for model_id in list(self._lanes):
            for entry in self._policy.table(model_id).slots:
                if entry.content is Content.OWNED and entry.session is not None:
                    out.append((model_id, entry.id, entry.session))
        return out

    async def erase_session(self, session: str) -> tuple[int, int]:
        """Erase every idle slot that holds ``session``'s KV: (erased, busy), where busy
        counts slots a running job of the session holds (not touched). A failed erase
        leaves the slot unknown (erased before its next use), so it is counted erased:
        the session's KV is never served from it again. A background save of such a
        slot ends first, so that the caller's deletion of the parked copies that
        follows covers it. Cancellation leaves the slot being erased unknown."""
        erased = busy = 0
        for model_id, slot, owner in self.sessions_in_slots():
            if owner != session:
                continue
            lane = self._lanes.get(model_id)
            await self._wait_for_save(model_id, slot)  # its copy is then dropped with the rest
            table = self._policy.table(model_id)
            if lane is None or slot >= len(table) or table.owner(slot) != session:
                continue
            if (
                table.pinned_to(slot) is not None
                or table.slots[slot].held_out
                or table.saving(slot) is not None
            ):
                busy += 1
                continue
            cleanup = _Cleanup(model_id, slot)
            table.pin(slot, cleanup)
            try:
                table.sending(slot, cleanup)
                if lane.ready:
                    with trio.move_on_after(self.settings.erase_timeout):
                        try:
                            await lane.erase_slot(slot)
                        except Exception as exc:
                            log.warning("erase of %s slot %d failed: %r", model_id, slot, exc)
                        else:
                            table = self._policy.table(model_id)
                            if table.pinned_to(slot) is cleanup:
                                table.erased(slot, cleanup)
                erased += 1
            finally:
                self._policy.table(model_id).unpin(slot, cleanup)
                self._wake()
        return erased, busy

    async def _erase_when_idle(self, job: _TrioJob, lane: EngineLane, released: int) -> None:
        """Erase the slot a keyless job left, once nobody has used it for
        ``idle_erase_delay``. The slot is pinned (to this cleanup) until the engine
        acknowledges; a failure leaves it unknown (erased before its next keyed use)."""
        await trio.sleep(self.settings.idle_erase_delay)
        slot = job.slot_id
        assert slot is not None
        table = self._policy.table_of(job)
        if slot >= len(table) or not lane.ready:
            return
        entry = table.slots[slot]
        if (
            entry.pin is not None
            or entry.held_out
            or entry.content is not Content.KEYLESS
            or entry.released != released
        ):
            return  # used again since (or made fresh by a restart)
        cleanup = _Cleanup(job.model_id, slot)
        table.pin(slot, cleanup)
        try:
            with lane.hold(), trio.move_on_after(self.settings.erase_timeout):
                table.sending(slot, cleanup)
                try:
                    await lane.erase_slot(slot)
                except Exception as exc:
                    log.warning("erase of %s slot %d failed: %r", job.model_id, slot, exc)
                    self._policy.note_erase(ok=False)
                    return
                table = self._policy.table_of(job)
                if table.pinned_to(slot) is cleanup:
                    table.erased(slot, cleanup)
                self._policy.note_erase(ok=True)
                self._policy.erases_after_keyless += 1
        finally:
            self._policy.table_of(job).unpin(slot, cleanup)
            self._wake()

    async def _save_when_idle(
        self, model_id: str, lane: EngineLane, slot: int, released: int
    ) -> None:
        """Save the KV an owner's job left in ``slot`` once nobody has used the slot for
        ``save_idle_delay``, unless its parked copy is current already or no handoff
        is likely (:meth:`SlotTable.handoff_likely`, or another owner waiting). The slot is
        marked as being saved (not pinned): a job placed on it meanwhile waits for the
        save (:meth:`_prepare_slot`), and finds the copy current. A failed save is
        logged and counted (a handoff saves it then). Cancellation (shutdown) cuts the
        save: the slot keeps its content, its copy not current; the engine's file, if
        it wrote one, is deleted (:meth:`ModelRuntime.park_slot
        <gezel_trio.host.runtime.ModelRuntime.park_slot>`)."""
        await trio.sleep(self.settings.save_idle_delay)
        table = self._policy.table(model_id)
        if (
            not self._parking(lane)
            or not lane.ready
            or slot >= len(table)
            or table.slots[slot].released != released
        ):
            return  # used again since (or made fresh by a restart)
        assert isinstance(lane, ParkingLane)
        entry = table.slots[slot]
        if entry.parked_current and lane.is_current(entry.session or "", entry.blocks):
            return
        if not (
            table.handoff_likely(slot) or self._policy.others_waiting(model_id, entry.session)
        ):
            return  # a lone owner with clean slots to spare: its handoff may never come
        mark = _Cleanup(model_id, slot)
        session = table.begin_save(slot, mark)
        if session is None:
            return
        blocks = entry.blocks
        self._saves[(model_id, slot)] = done = trio.Event()
        tokens: int | None = None
        try:
            with lane.hold(), trio.move_on_after(self.settings.park_timeout):
                try:
                    tokens = await lane.park_slot(slot, session, blocks)
                except Exception as exc:
                    log.warning("saving idle %s slot %d failed: %r", model_id, slot, exc)
        finally:
            self._policy.table(model_id).end_save(slot, mark, session, tokens=tokens)
            if tokens is None:
                self._policy.parks_failed += 1
            elif tokens:
                self._policy.parks_idle += 1
            if self._saves.get((model_id, slot)) is done:
                del self._saves[(model_id, slot)]
            done.set()
            self._wake()

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
        fresh = self._measured
        self._measured = {}
        now = trio.current_time()
        for action in policy.plan():
            if isinstance(action, Admit):
                model_id = action.model_id
                lane = self._lanes[model_id]
                measured: SlotMeasurement | None = None
                if not lane.sole_client:
                    if model_id not in fresh:
                        self._start_measure(model_id)
                        continue
                    measured = fresh[model_id]
                elif self._reconciled_generation.get(model_id) != lane.generation:
                    # a new engine process: reconcile its table once, in the background
                    self._reconciled_generation[model_id] = lane.generation
                    self._reconcile_soon(model_id, now)
                admission = policy.admit(model_id, measured, now=now)
                for admitted in admission.jobs:
                    assert isinstance(admitted, _TrioJob)
                    self._grant(admitted, lane)
                if admission.poll:
                    if lane.sole_client:
                        self._reconcile_soon(model_id, now)
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

    def _start_measure(self, model_id: str) -> None:
        if model_id not in self._measuring:
            self._measuring.add(model_id)
            assert self._nursery is not None
            self._nursery.start_soon(self._measure_task, model_id)

    async def _measure_task(self, model_id: str) -> None:
        try:
            self._measured[model_id] = await self._measure(model_id)
        finally:
            self._measuring.discard(model_id)
            self._wake()

    async def _measure(self, model_id: str) -> SlotMeasurement | None:
        """Sample ``model_id``'s slots; ``None`` when the sample fails or takes longer
        than ``measure_timeout`` (then nothing can be pinned on an external engine)."""
        lane = self._lanes.get(model_id)
        if lane is None:
            return None
        timeout = self.settings.measure_timeout
        failure: str | None = None
        with trio.move_on_after(timeout):
            try:
                if lane.sole_client:
                    measured = await lane.measure_slots()
                else:  # a hung external engine: its health checks may tell first
                    sample = await _unless_failed(lane, lane.measure_slots)
                    if sample is None:
                        raise EngineFailed("the engine failed its health checks")
                    measured = sample[0]
            except Exception as exc:
                failure = repr(exc)
            else:
                self._policy.note_measurement(ok=measured is not None)
                self._policy.member_reachable(model_id)
                if model_id in self._measure_failing:
                    self._measure_failing.discard(model_id)
                    log.info("slot measurement of %s works again", model_id)
                return measured
        if failure is None:
            failure = f"timed out after {timeout}s"
        self._policy.note_measurement(ok=False)
        moved = self._policy.member_down(model_id)
        if moved:
            log.warning("%s is unreachable: %d queued jobs moved to its replicas", model_id, moved)
        if model_id not in self._measure_failing:  # say it once, not on every pass
            self._measure_failing.add(model_id)
            log.warning("slot measurement of %s failed (%s): jobs wait", model_id, failure)
        return None

    # ------------------------------------------------------------------ reconciliation

    def _reconcile_soon(self, model_id: str, now: float) -> None:
        """Reconcile a spawned engine's table now, or after ``slot_poll`` if it was
        reconciled just now (the pass asks again while capacity stays zero)."""
        last = self._reconciled_at.get(model_id)
        if last is not None and now - last < self.settings.slot_poll:
            self._poll_later(last + self.settings.slot_poll)
            return
        if model_id not in self._measuring:
            self._measuring.add(model_id)
            self._reconciled_at[model_id] = now
            assert self._nursery is not None
            self._nursery.start_soon(self._reconcile, model_id)

    async def _reconcile(self, model_id: str) -> None:
        """One ``/slots`` sample applied to a spawned engine's table: slots busy with
        work the host did not send are held out until they are idle again."""
        try:
            lane = self._lanes.get(model_id)
            if lane is None or not lane.ready:
                return
            table = self._policy.table(model_id)
            generation, tick = table.generation, table.tick
            measured = await self._measure(model_id)
            table = self._policy.table(model_id)
            if measured is None or measured.ids is None or table.generation != generation:
                return
            idle = set(measured.ids)
            busy = [entry.id for entry in table.slots if entry.id not in idle]
            newly = table.reconcile(busy, sampled_at=tick)
            self._policy.note_reconciliation(len(newly))
            if newly:
                log.warning(
                    "slots %s of %s are busy with work the host did not send: held out, "
                    "erased before use",
                    newly,
                    model_id,
                )
        finally:
            self._measuring.discard(model_id)
            self._wake()

    async def _serve_reconciliation(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Reconcile every ready spawned engine every ``reconcile_interval`` seconds."""
        task_status.started()
        while True:
            await trio.sleep(self.settings.reconcile_interval)
            now = trio.current_time()
            for model_id, lane in list(self._lanes.items()):
                if lane.sole_client and lane.ready:
                    self._reconcile_soon(model_id, now)

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


async def _unless_failed(lane: EngineLane, call: Callable[[], Awaitable[T]]) -> tuple[T] | None:
    """``(await call(),)``, or None when ``lane``'s engine fails first (``call`` is then
    cancelled). Exceptions of ``call`` pass through."""
    result: tuple[T] | None = None
    async with unwrapping(), trio.open_nursery() as nursery:

        async def cancel_on_failure() -> None:
            await lane.wait_failed()
            nursery.cancel_scope.cancel()

        nursery.start_soon(cancel_on_failure)
        result = (await call(),)
        nursery.cancel_scope.cancel()
    return result


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
        scheduler._nursery = nursery
        await nursery.start(scheduler._serve_dispatcher)
        await nursery.start(scheduler._serve_reconciliation)
        try:
            yield scheduler
        finally:
            scheduler._close()
            nursery.cancel_scope.cancel()
