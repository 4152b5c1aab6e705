"""Parking maintenance: the slot work that runs off the critical path.

With ``save_idle_slots``, the slot an owner's job leaves is saved off the
critical path once it has stayed idle for ``save_idle_delay``: the slot is
marked *being saved* in the table (not pinned), a job placed on it waits for the
save before anything is sent to it, and the copy is then current, so a handoff
skips the save: a keyed handoff makes 2 upstream calls (restore or erase, then
the request) instead of 3. ``statistics().parking`` counts ``handoffs`` and their
``handoff_calls`` (the requests included) and ``saved_idle``.

The slot a blind job leaves is erased off the critical path once it has stayed
idle for ``idle_erase_delay`` (pinned until the engine acknowledges), or before an
owner's job takes it, whichever comes first. A planned stop of an engine first
parks every session's KV its slots hold (:meth:`SlotMaintenance.park_owned`), and
a session's deletion erases the idle slots that hold its KV
(:meth:`SlotMaintenance.erase_session`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass

import trio

from gezel_trio.kv.prefix import Prefix
from gezel_trio.scheduler.lanes import EngineLane, can_park
from gezel_trio.scheduler.policy import SchedulerPolicy
from gezel_trio.scheduler.settings import SchedulerSettings
from gezel_trio.scheduler.slots import Content, SlotTable
from gezel_trio.scheduler.trio_job import _TrioJob

__all__ = ["SlotMaintenance"]

log = logging.getLogger("gezel_trio.scheduler")


@dataclass(frozen=True, eq=False, slots=True)
class _Cleanup:
    """The pin of a background erase (no job holds the slot meanwhile), or the mark of a
    background save."""

    model_id: str
    slot: int


@dataclass(frozen=True, eq=False, slots=True)
class _IdleSave:
    """A background save begun (:meth:`SlotMaintenance._begin_idle_save`): the slot is
    marked with ``mark``, the engine held by ``hold``, waiters wait on ``done``."""

    model_id: str
    lane: EngineLane
    slot: int
    session: str
    blocks: Prefix
    caller: str | None
    """The slot's caller, whose other owners may start from the copy (None: nobody)."""
    mark: _Cleanup
    hold: AbstractContextManager[object]
    done: trio.Event


class SlotMaintenance:
    """Background saves and erases of idle slots, parking before a stop, erasing a
    session's slots; owned by the :class:`~gezel_trio.scheduler.dispatcher.Scheduler`,
    which reads ``lanes`` live and is woken through ``wake`` after each change."""

    def __init__(
        self,
        *,
        policy: SchedulerPolicy,
        lanes: Mapping[str, EngineLane],
        settings: SchedulerSettings,
        wake: Callable[[], None],
    ) -> None:
        self._policy = policy
        self._lanes = lanes
        self.settings = settings
        self._wake = wake
        self._saves: dict[tuple[str, int], trio.Event] = {}  # background saves in flight

    def __repr__(self) -> str:
        return f"<SlotMaintenance saves={sorted(self._saves)}>"

    def parking(self, lane: EngineLane | None) -> bool:
        return self.settings.kv_parking and can_park(lane) and lane.parking_enabled

    async def wait_for_save(self, model_id: str, slot: int) -> None:
        """Return once no background save is in flight on ``slot`` (at most
        ``park_timeout``: the save's own bound), or once ``model_id`` is removed (its
        save then ends on its own). Cancellation just stops the wait."""
        while (table := self._policy.served_table(model_id)) is not None and (
            table.saving(slot) is not None
        ):
            done = self._saves.get((model_id, slot))
            if done is None:
                return
            with trio.move_on_after(self.settings.park_timeout) as scope:
                await done.wait()
            if scope.cancelled_caught:
                return

    async def park_owned(self, model_id: str) -> int:
        """Save every slot of ``model_id`` that holds a session's KV not parked yet:
        what a planned stop of its engine runs before the SIGTERM. Returns how many
        were saved.

        Background saves in flight end first (each within ``park_timeout``). Each slot
        is pinned while it is saved (no job can take it meanwhile) and each save has
        ``park_timeout``; a failed or cut save loses only that session's KV (it
        re-prefills). Works while the scheduler shuts down too (no tasks needed).
        Parking ends early if the model is removed or its engine restarts meanwhile.
        Cancellation stops between or inside saves; what was saved stays parked.
        """
        lane = self._lanes.get(model_id)
        if not self.parking(lane):
            return 0
        assert can_park(lane)
        for key in [key for key in self._saves if key[0] == model_id]:
            await self.wait_for_save(*key)  # a background save ends first
        table = self._policy.served_table(model_id)
        if table is None:
            return 0
        generation = table.generation
        saved = 0
        for entry in list(table.slots):
            if not self._policy.still_serves(model_id, table, generation):
                break
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
                try:
                    tokens = await lane.park_slot(
                        entry.id,
                        session,
                        entry.blocks,
                        within=self.settings.park_timeout,
                        share_caller=entry.caller,
                    )
                except Exception:  # the lane logged why
                    self._policy.note_park(ok=False)
                    continue
                if (
                    self._policy.still_serves(model_id, table, generation)
                    and table.pinned_to(entry.id) is cleanup
                ):
                    if tokens:
                        table.parked(entry.id, cleanup, session)
                    else:
                        table.erased(entry.id, cleanup)
                if tokens:
                    self._policy.note_park(ok=True)
                    saved += 1
            finally:
                table.unpin(entry.id, cleanup)
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
            await self.wait_for_save(model_id, slot)  # its copy is then dropped with the rest
            lane = self._lanes.get(model_id)
            table = self._policy.served_table(model_id)
            if (
                lane is None
                or table is None  # removed meanwhile (a reload)
                or slot >= len(table)
                or table.owner(slot) != session
            ):
                continue
            if (
                table.pinned_to(slot) is not None
                or table.slots[slot].held_out
                or table.saving(slot) is not None
            ):
                busy += 1
                continue
            cleanup = _Cleanup(model_id, slot)
            generation = table.generation
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
                            if (
                                self._policy.still_serves(model_id, table, generation)
                                and table.pinned_to(slot) is cleanup
                            ):
                                table.erased(slot, cleanup)
                erased += 1
            finally:
                table.unpin(slot, cleanup)
                self._wake()
        return erased, busy

    async def erase_when_idle(self, job: _TrioJob, lane: EngineLane, released: int) -> None:
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
                self._policy.note_erase(ok=True, after_keyless=True)
        finally:
            self._policy.table_of(job).unpin(slot, cleanup)
            self._wake()

    def save_soon(
        self, nursery: trio.Nursery, model_id: str, lane: EngineLane, slot: int, released: int
    ) -> None:
        """Save the KV an owner's job left in ``slot`` in the background (see
        :meth:`save_when_idle`). Without ``save_idle_delay`` the save is decided, marked
        and holds the engine now, in the same step as the job's release (the caller's),
        so that between the job and its save the slot never looks unmarked nor the engine
        idle; its I/O then runs in ``nursery``. A slot no handoff is likely to take is
        saved only once it has stayed idle ``save_lone_delay``."""
        if self.settings.save_idle_delay > 0:
            nursery.start_soon(self.save_when_idle, model_id, lane, slot, released)
            return
        table = self._unsaved(model_id, lane, slot, released)
        if table is None:
            return
        lone = self.settings.save_lone_delay
        if lone > 0 and not self._handoff_likely(model_id, table, slot):
            if math.isfinite(lone):
                nursery.start_soon(self._save_lone, model_id, lane, slot, released, lone)
            return
        save = self._begin_idle_save(model_id, lane, table, slot)
        if save is None:
            return
        try:
            nursery.start_soon(self._run_idle_save, save)
        except BaseException:
            self._end_idle_save(save, tokens=None)
            raise

    async def save_when_idle(
        self, model_id: str, lane: EngineLane, slot: int, released: int
    ) -> None:
        """Save the KV an owner's job left in ``slot`` once nobody has used the slot for
        ``save_idle_delay``, unless its parked copy is current already; a slot that no
        handoff is likely to take (:meth:`SlotTable.handoff_likely`, and no other owner
        waiting) only once it has stayed idle ``save_lone_delay``. The slot is marked as
        being saved (not pinned): a job placed on it meanwhile waits for the save
        (:meth:`SlotPreparer.prepare <.preparation.SlotPreparer.prepare>`), and finds
        the copy current. A failed save is logged and counted (a handoff saves it then).
        Cancellation (shutdown) cuts the wait or the save: the slot keeps its content,
        its copy not current; the engine's file, if it wrote one, is deleted
        (:meth:`ModelRuntime.park_slot <gezel_trio.host.runtime.ModelRuntime.park_slot>`)."""
        idle = self.settings.save_idle_delay
        await trio.sleep(idle)
        table = self._unsaved(model_id, lane, slot, released)
        if table is None:
            return
        if not self._handoff_likely(model_id, table, slot):
            lone = self.settings.save_lone_delay
            if math.isfinite(lone):
                await self._save_lone(model_id, lane, slot, released, max(lone - idle, 0.0))
            return
        save = self._begin_idle_save(model_id, lane, table, slot)
        if save is not None:
            await self._run_idle_save(save)

    async def _save_lone(
        self, model_id: str, lane: EngineLane, slot: int, released: int, after: float
    ) -> None:
        """Save ``slot`` once it has stayed idle ``after`` more seconds, though no handoff
        is likely: a new session of its caller that shares its prefix, or its owner back
        after its engine stopped, then finds its copy current instead of saving it on the
        way (an agent's own next turn, which mostly comes sooner, waits for no save).
        Cancellation (shutdown) cuts the wait or the save, as in :meth:`save_when_idle`."""
        if after > 0:
            await trio.sleep(after)
        table = self._unsaved(model_id, lane, slot, released)
        save = None if table is None else self._begin_idle_save(model_id, lane, table, slot)
        if save is not None:
            await self._run_idle_save(save)

    def _unsaved(
        self, model_id: str, lane: EngineLane, slot: int, released: int
    ) -> SlotTable | None:
        """The table of ``slot`` when the slot still holds, unused since its job's release
        (``released``), an owner's KV whose parked copy is not current (None: nothing to
        save: used again since, made fresh by a restart, removed, or parked already)."""
        table = self._policy.served_table(model_id)
        if (
            table is None  # removed since (a reload)
            or not self.parking(lane)
            or not lane.ready
            or slot >= len(table)
            or table.slots[slot].released != released
        ):
            return None  # used again since (or made fresh by a restart)
        assert can_park(lane)
        entry = table.slots[slot]
        if entry.content is not Content.OWNED or entry.session is None:
            return None
        if entry.parked_current and lane.is_current(entry.session, entry.blocks):
            return None
        return table

    def _handoff_likely(self, model_id: str, table: SlotTable, slot: int) -> bool:
        """Whether ``slot`` may soon change hands (:meth:`SlotTable.handoff_likely`, or
        another owner waiting): its save then goes ahead at once."""
        session = table.slots[slot].session
        return table.handoff_likely(slot) or self._policy.others_waiting(model_id, session)

    def _begin_idle_save(
        self, model_id: str, lane: EngineLane, table: SlotTable, slot: int
    ) -> _IdleSave | None:
        """Mark ``slot`` of ``table`` (found :meth:`_unsaved` in this step) as being saved,
        hold the engine and register the save, ended by :meth:`_end_idle_save` (no I/O;
        None: the slot cannot be marked)."""
        entry = table.slots[slot]
        mark = _Cleanup(model_id, slot)
        session = table.begin_save(slot, mark)
        if session is None:
            return None
        hold = lane.hold()
        hold.__enter__()
        done = trio.Event()
        self._saves[(model_id, slot)] = done
        return _IdleSave(
            model_id, lane, slot, session, entry.blocks, entry.caller, mark, hold, done
        )

    async def _run_idle_save(self, save: _IdleSave) -> None:
        """The I/O of a save begun by :meth:`_begin_idle_save` (within ``park_timeout``).
        A failure is counted (the lane logs why); a cancelled save (shutdown) is not."""
        tokens: int | None = None
        failed = False
        try:
            assert can_park(save.lane)
            try:
                tokens = await save.lane.park_slot(
                    save.slot,
                    save.session,
                    save.blocks,
                    within=self.settings.park_timeout,
                    share_caller=save.caller,
                )
            except Exception:
                failed = True
        finally:
            self._end_idle_save(save, tokens=tokens, failed=failed)

    def _end_idle_save(self, save: _IdleSave, *, tokens: int | None, failed: bool = False) -> None:
        """Record the end of ``save`` (``tokens`` None: failed, cut or never run; only a
        ``failed`` one counts as a failure) and release its mark, its engine hold and its
        waiters."""
        key = (save.model_id, save.slot)
        try:
            table = self._policy.served_table(save.model_id)
            if table is not None:  # (a model removed meanwhile took its table along)
                table.end_save(save.slot, save.mark, save.session, tokens=tokens)
            if failed:
                self._policy.note_park(ok=False, idle=True)
            elif tokens:
                self._policy.note_park(ok=True, idle=True)
        finally:
            if self._saves.get(key) is save.done:
                del self._saves[key]
            save.done.set()
            save.hold.__exit__(None, None, None)
            self._wake()
