"""Slot preparation: making a granted job's slot safe (and warm) before its request.

The caller's ``async with`` takes the GPU lease and *prepares* the slot
from the model's :class:`~gezel_trio.scheduler.slots.SlotTable`: it parks the
outgoing owner's KV (unless its parked copy is current), restores the caller's
own parked copy that shares the longest prefix with its request, or erases the
slot, recording each transition before the I/O. Every owner is parked alike: a
named session, a caller's keyless owner, a keyless conversation. Only
a slot whose content is the job's own owner's, or empty, is handed over to a
job with an owner (a named session, or a caller's keyless owner); when an
erase is not acknowledged the request fails (503) and the slot stays unknown.
A job that may share its caller's prefixes (``job.caller``) is sent onto a slot
of another owner of that caller without an erase, once that owner's KV is parked:
the engine keeps only the prefix the two share (an attention model; the host sets
``caller`` for no other). When no slot holds such a prefix but a parked copy of
another owner of the caller does, that copy is restored into the job's slot first
(it stays its owner's), and the same holds. A keyless job without an owner (``[scheduler] keyless =
"blind"``) is blind
(``grant.blind``: the caller sends it with ``cache_prompt`` off, so it reads
nothing the slot held) and needs no erase before it. So is an owner's job on a slot
that would otherwise be erased for it (``blind_handoff``): the engine empties the
slot as it starts the request, which saves the erase's upstream call; the slot is
the owner's once the engine answered it (``grant.answered``: its first token, or a
whole answer that read the prompt), and unknown if it did not. A job that carries
its caller's lead (``job.lead``: a model that cannot cut a slot back, see
:mod:`gezel_trio.kv.lead`) has a slot that holds nothing of its owner's started from
that lead instead of erased: its snapshot restored, or the lead prefilled alone and
saved as one; the slot then holds the lead as the owner's KV.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import trio

from gezel_trio.errors import EngineCrashed, EngineFailed, GezelError
from gezel_trio.kv.lead import LeadStart
from gezel_trio.kv.prefix import Prefix, is_prefix, shared_blocks
from gezel_trio.scheduler.jobs import Grant
from gezel_trio.scheduler.lanes import (
    EngineLane,
    LeadLane,
    ParkingLane,
    can_lead,
    can_park,
    unless_failed,
)
from gezel_trio.scheduler.maintenance import SlotMaintenance
from gezel_trio.scheduler.policy import SchedulerPolicy
from gezel_trio.scheduler.settings import SchedulerSettings
from gezel_trio.scheduler.slots import Content
from gezel_trio.scheduler.trio_job import _TrioJob

__all__ = ["SlotPreparer"]

log = logging.getLogger("gezel_trio.scheduler")


class SlotPreparer:
    """Park, restore or erase a granted job's slot from its slot table, recording each
    transition before its I/O; owned by the
    :class:`~gezel_trio.scheduler.dispatcher.Scheduler`. A background save of the
    slot (``maintenance``) is waited for first."""

    def __init__(
        self,
        *,
        policy: SchedulerPolicy,
        settings: SchedulerSettings,
        maintenance: SlotMaintenance,
        wake: Callable[[], None],
    ) -> None:
        self._policy = policy
        self.settings = settings
        self._maintenance = maintenance
        self._wake = wake

    def __repr__(self) -> str:
        return f"<SlotPreparer parking={self.settings.kv_parking}>"

    def check_pin(self, job: _TrioJob) -> None:
        table = self._policy.table_of(job)
        if job.slot_id is not None and table.pinned_to(job.slot_id) is not job:
            raise EngineCrashed(
                f"the engine for {job.model_id!r} restarted with fewer slots before the "
                "request was sent; it was not sent"
            )

    async def prepare(self, job: _TrioJob, lane: EngineLane) -> Grant:
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
            blind=slot is not None and (job.session is None or job.blind),
            answered=job.answer,
            erased=erased,
            queue_wait_s=trio.current_time() - job.submitted_at,
            prepare_calls=calls,
            generation=self._policy.table_of(job).generation,
            restored_tokens=restored,
            lead_tokens=job.lead_tokens,
        )

    async def _prepare_watched(
        self, job: _TrioJob, lane: EngineLane, slot: int
    ) -> tuple[int, bool, int]:
        """:meth:`_prepare_slot` on an engine the host does not run, abandoned when the
        engine fails meanwhile: a hung external engine answers no slot call, and its
        health checks say so sooner than the calls' own timeouts. The slot is left
        unknown and EngineFailed raised (the request is not sent)."""
        result = await unless_failed(lane, partial(self._prepare_slot, job, lane, slot))
        if result is None:
            raise EngineFailed(
                f"the engine for {job.model_id!r} failed while slot {slot} was prepared; "
                "the request was not sent"
            )
        return result[0]

    async def _prepare_slot(
        self, job: _TrioJob, lane: EngineLane, slot: int
    ) -> tuple[int, bool, int]:
        """Park, restore or erase ``slot`` until it holds only ``job``'s session's KV (or
        nothing); returns (upstream calls made, erased or restored, tokens restored
        that the next completion should reuse: 0 when the restored copy is not a
        prefix of the request). A background save of the slot is waited for first:
        its copy is then current, and the handoff skips the save."""
        await self._maintenance.wait_for_save(job.model_id, slot)
        calls = 0
        erased = False
        restored = 0
        parking = self._maintenance.parking(lane)
        restore_failed = False
        prefix = job.prefix

        def is_parked(session: str) -> bool:
            return not restore_failed and can_park(lane) and lane.is_parked(session, prefix)

        def is_current(session: str, blocks: Prefix) -> bool:
            return can_park(lane) and lane.is_current(session, blocks)

        def parked_shares(session: str) -> int | None:
            if restore_failed or not can_park(lane):
                return None
            blocks = lane.parked_blocks(session, prefix)
            return None if blocks is None else shared_blocks(blocks, prefix)

        lend_failed = False

        def lent() -> tuple[str, int] | None:
            if lend_failed or job.caller is None or job.session is None or not can_park(lane):
                return None
            found = lane.lent_copy(job.caller, job.session, prefix)
            return None if found is None else (found[0], shared_blocks(found[1], prefix))

        first_owner = self._policy.table_of(job).owner(slot)
        handoff = job.session is not None and first_owner not in (None, job.session)
        shared = False  # sent onto another owner's KV of its caller: the engine cuts it back
        wants_lead = False  # the slot is to be started from the caller's lead, not erased
        for _ in range(4):
            self.check_pin(job)
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
                caller=job.caller,
                lent=lent,
            )
            owner = table.owner(slot)
            shared = bool(table.shares_with(slot, job.session, job.caller, prefix))
            shared = shared and not prep.restore
            if parking and owner is not None and owner != job.session and prep.park is None:
                # its parked copy is still current, or its tail is not worth a save
                self._policy.note_park_skipped(tail=prep.drop_tail)
            if (
                parking
                and calls == 0
                and job.session is not None
                and owner != job.session
                and not prep.restore
                and prep.lend is None
            ):
                assert can_park(lane)
                lane.note_miss()
            if prep.calls == 0:
                break
            calls += prep.calls
            if prep.park is not None:
                assert can_park(lane)
                if not await self._park(job, lane, prep.park):
                    parking = False  # that session re-prefills later; go on without
            if prep.restore:
                assert can_park(lane) and job.session is not None
                restored = await self._restore(job, lane, job.session)
                if restored:
                    erased = True
                else:
                    restore_failed = True
            elif prep.lend is not None:
                assert can_park(lane)
                restored = await self._lend(job, lane, prep.lend)
                if restored:
                    erased = True
                else:
                    lend_failed = True
            elif prep.erase:
                if self._may_lead(job, lane):
                    calls -= 1  # no erase: the lead's prefill or restore empties the slot
                    wants_lead = True
                    break
                if self.settings.blind_handoff and job.session is not None:
                    # Sent with cache_prompt off, the request itself empties the slot:
                    # unknown until the engine's first token says it did (settle).
                    job.blind = True
                    calls -= 1
                    self._policy.note_sent_blind()
                    break
                await self._erase(job, lane)
                erased = True
        else:  # pragma: no cover - each round makes progress or raises
            raise EngineFailed(f"slot {slot} of {job.model_id!r} could not be prepared")
        self.check_pin(job)
        if self._may_lead(job, lane) and (
            wants_lead or self._policy.table_of(job).content(slot) in (Content.FRESH, Content.CLEAN)
        ):
            assert can_lead(lane)
            calls += await self._lead(job, lane)
        table = self._policy.table_of(job)
        blocks = table.blocks(slot)
        if restored and prefix and blocks and not is_prefix(blocks, prefix):
            restored = 0  # another branch of the conversation: only a part is reused
        if handoff:
            self._policy.note_handoff(calls=calls + 1, shared=shared)  # and the request
        table.sending(slot, job)
        return calls, erased, restored

    def _may_lead(self, job: _TrioJob, lane: EngineLane) -> bool:
        """Whether the job's slot, holding nothing of its owner's, is to be started
        from its caller's lead (see :mod:`gezel_trio.kv.lead`)."""
        return (
            job.lead is not None
            and job.session is not None
            and not job.lead_tokens
            and can_lead(lane)
            and lane.leads_enabled
        )

    async def _lead(self, job: _TrioJob, lane: LeadLane) -> int:
        """Start the job's slot from its caller's lead (:meth:`LeadLane.start_lead`,
        its restore or save within ``park_timeout``): the upstream calls made. The slot
        then holds the lead as the job's own KV (no parked copy of it); when that
        failed, the slot is unknown and the job is sent blind (``cache_prompt`` off),
        which empties it. Cancellation leaves the slot unknown."""
        slot, lead, session = job.slot_id, job.lead, job.session
        assert slot is not None and lead is not None and session is not None
        self._policy.table_of(job).sending(slot, job)
        try:
            start = await lane.start_lead(slot, lead, within=self.settings.park_timeout)
        except Exception:
            start = LeadStart(0, 1)
        self.check_pin(job)
        self._policy.note_lead(start)
        if start.tokens:
            self._policy.table_of(job).started(
                slot, job, session, keyless=job.keyless, blocks=lead.blocks
            )
            job.lead_tokens = start.tokens
        else:
            job.blind = True
            self._policy.note_sent_blind()
        return start.calls

    async def _park(self, job: _TrioJob, lane: ParkingLane, session: str) -> bool:
        """Save ``session``'s KV before its slot changes hands (within ``park_timeout``);
        False when it failed (the lane logs why; counted: the handoff goes on, that
        session re-prefills later). Cancellation (the job's client left) is no failure."""
        slot = job.slot_id
        assert slot is not None
        blocks = self._policy.table_of(job).blocks(slot)
        caller = self._policy.table_of(job).slots[slot].caller
        try:
            saved = await lane.park_slot(
                slot, session, blocks, within=self.settings.park_timeout, share_caller=caller
            )
        except Exception:
            self._policy.note_park(ok=False)
            return False
        self.check_pin(job)
        table = self._policy.table_of(job)
        if saved:
            table.parked(slot, job, session)
            self._policy.note_park(ok=True)
        else:  # the engine says the slot holds no token: it is empty
            table.erased(slot, job)
        return True

    async def _restore(self, job: _TrioJob, lane: ParkingLane, session: str) -> int:
        """Restore the job's own parked copy sharing the longest prefix with its request
        into its slot (which also replaces whatever the slot held), within
        ``park_timeout``: the tokens restored. 0 when it did not take or failed (the lane
        logs why): the slot is then unknown."""
        slot = job.slot_id
        assert slot is not None
        blocks = lane.parked_blocks(session, job.prefix) or ()
        self._policy.table_of(job).sending(slot, job)
        try:
            restored = await lane.unpark_slot(
                slot, session, job.prefix, within=self.settings.park_timeout
            )
        except Exception:
            restored = 0
        if not restored:
            self._policy.note_restore(ok=False)
            return 0
        self.check_pin(job)
        self._policy.table_of(job).restored(
            slot, job, session, keyless=job.keyless, blocks=blocks, caller=job.caller
        )
        self._policy.note_restore(ok=True)
        return restored

    async def _lend(self, job: _TrioJob, lane: ParkingLane, lender: str) -> int:
        """Restore the parked copy of ``lender``, another owner of the job's caller, into
        its slot (which replaces whatever the slot held), within ``park_timeout``: the
        tokens restored. The slot then holds ``lender``'s KV, current, that the job may
        start from (the engine keeps the prefix they share); the copy stays
        ``lender``'s. 0 when it did not take or failed (the lane logs why): the slot is
        then unknown. Cancellation leaves the slot unknown."""
        slot = job.slot_id
        assert slot is not None and job.caller is not None and job.session is not None
        found = lane.lent_copy(job.caller, job.session, job.prefix)
        if found is None or found[0] != lender:
            return 0
        self._policy.table_of(job).sending(slot, job)
        try:
            restored = await lane.unpark_slot(
                slot,
                job.session,
                job.prefix,
                within=self.settings.park_timeout,
                lent_to=job.caller,
            )
        except Exception:
            restored = 0
        if not restored:
            self._policy.note_restore(ok=False)
            return 0
        self.check_pin(job)
        self._policy.table_of(job).restored(slot, job, lender, blocks=found[1], caller=job.caller)
        self._policy.note_restore(ok=True, lent=True)
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
                self.check_pin(job)
                self._policy.table_of(job).erased(slot, job)
                self._policy.note_erase(ok=True)
                return
        self._policy.note_erase(ok=False)
        log.warning("erase of %s slot %d failed: %s", job.model_id, slot, failure)
        raise EngineFailed(
            f"the engine for {job.model_id!r} did not acknowledge the erase of slot {slot} "
            f"({failure}); the request was not sent"
        )
