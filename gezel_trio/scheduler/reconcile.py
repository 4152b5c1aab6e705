"""Slot samples: ``GET /slots`` for admission on external engines, and reconciliation
of the slot tables of engines the host spawned.

For engines the host spawned, free slots come from the table; ``/slots`` is
only sampled to reconcile (after each engine start, every
``reconcile_interval``, and when capacity is zero): a slot busy with work the
host did not send is held out and erased before use. External engines may have
other clients, so each admission there consumes a fresh sample, and only slots
it names idle are pinned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import trio

from gezel_trio.errors import EngineFailed
from gezel_trio.scheduler.jobs import SlotMeasurement
from gezel_trio.scheduler.lanes import EngineLane, unless_failed
from gezel_trio.scheduler.policy import SchedulerPolicy
from gezel_trio.scheduler.settings import SchedulerSettings

__all__ = ["Reconciler"]

log = logging.getLogger("gezel_trio.scheduler")


class Reconciler:
    """Samples of every lane's ``/slots``, owned by the
    :class:`~gezel_trio.scheduler.dispatcher.Scheduler`: an external engine's sample
    waits in :meth:`take_samples` for the next pass; a spawned engine's is applied to
    its slot table. Tasks run in ``nursery`` (the scheduler's); each sample wakes the
    dispatcher (``wake``), and a reconciliation that comes too soon asks for a later
    pass (``poll_later``)."""

    def __init__(
        self,
        *,
        policy: SchedulerPolicy,
        lanes: Mapping[str, EngineLane],
        settings: SchedulerSettings,
        wake: Callable[[], None],
        poll_later: Callable[[float], None],
    ) -> None:
        self._policy = policy
        self._lanes = lanes
        self.settings = settings
        self._wake = wake
        self._poll_later = poll_later
        self.nursery: trio.Nursery | None = None
        self._measure_failing: set[str] = set()
        self._measuring: set[str] = set()  # models with a /slots sample in flight
        self._measured: dict[str, SlotMeasurement | None] = {}  # samples for the next pass
        self._reconciled_at: dict[str, float] = {}
        self._reconciled_generation: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"<Reconciler measuring={sorted(self._measuring)}>"

    def take_samples(self) -> dict[str, SlotMeasurement | None]:
        """The samples that arrived since the last call (each is consumed once)."""
        fresh = self._measured
        self._measured = {}
        return fresh

    def reconcile_new_engine(self, model_id: str, generation: int, now: float) -> None:
        """Reconcile a spawned engine's table once per engine process, in the
        background."""
        if self._reconciled_generation.get(model_id) != generation:
            self._reconciled_generation[model_id] = generation
            self.reconcile_soon(model_id, now)

    def start_measure(self, model_id: str) -> None:
        if model_id not in self._measuring:
            self._measuring.add(model_id)
            assert self.nursery is not None
            self.nursery.start_soon(self._measure_task, model_id)

    async def _measure_task(self, model_id: str) -> None:
        try:
            self._measured[model_id] = await self.measure(model_id)
        finally:
            self._measuring.discard(model_id)
            self._wake()

    async def measure(self, model_id: str) -> SlotMeasurement | None:
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
                    sample = await unless_failed(lane, lane.measure_slots)
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

    def reconcile_soon(self, model_id: str, now: float) -> None:
        """Reconcile a spawned engine's table now, or after ``slot_poll`` if it was
        reconciled just now (the pass asks again while capacity stays zero)."""
        last = self._reconciled_at.get(model_id)
        if last is not None and now - last < self.settings.slot_poll:
            self._poll_later(last + self.settings.slot_poll)
            return
        if model_id not in self._measuring:
            self._measuring.add(model_id)
            self._reconciled_at[model_id] = now
            assert self.nursery is not None
            self.nursery.start_soon(self._reconcile, model_id)

    async def _reconcile(self, model_id: str) -> None:
        """One ``/slots`` sample applied to a spawned engine's table: slots busy with
        work the host did not send are held out until they are idle again."""
        try:
            lane = self._lanes.get(model_id)
            if lane is None or not lane.ready:
                return
            table = self._policy.table(model_id)
            generation, tick = table.generation, table.tick
            measured = await self.measure(model_id)
            if (
                measured is None
                or measured.ids is None
                or not self._policy.still_serves(model_id, table, generation)
            ):
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

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Reconcile every ready spawned engine every ``reconcile_interval`` seconds."""
        task_status.started()
        while True:
            await trio.sleep(self.settings.reconcile_interval)
            now = trio.current_time()
            for model_id, lane in list(self._lanes.items()):
                if lane.sole_client and lane.ready:
                    self.reconcile_soon(model_id, now)
