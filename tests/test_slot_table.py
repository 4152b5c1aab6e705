"""The slot table (:mod:`gezel_trio.scheduler.slots`): plain transitions, then a model.

The unit tests drive each transition by hand. The state machine keeps the
engine's *truth* apart from the table (for each slot, the set of sessions whose
tokens really are in its KV) and plays the dispatcher's protocol against it
over random interleavings of erases, saves, restores, completions, cancellation,
crashes, foreign work and exclusive ops. A completion may be sent only where the
table says it is safe, and there a keyed job's slot must hold nothing but its own
session's tokens. A keyless job is blind (sent with ``cache_prompt`` off, it reads
nothing the slot holds): it may run on any slot, and what it leaves is erased
before a keyed job uses the slot.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from gezel_trio.kv.sessions import session_hash
from gezel_trio.scheduler.slots import Content, Preparation, SlotTable


class Job:
    """A stand-in for the dispatcher's job: only its identity matters to the table."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<job {self.name}>"


def run(table: SlotTable, slot: int, job: Job, session: str | None) -> None:
    """A completion of ``session`` on ``slot`` (already pinned to ``job``), start to end."""
    assert table.safe_for(slot, session)
    table.sending(slot, job)
    table.completed(slot, job, session)


def owned_by(session: str, *, slot: int = 0, size: int = 1) -> SlotTable:
    """A table whose ``slot`` holds ``session``'s KV, unpinned."""
    table = SlotTable(size, generation=1)
    job = Job("owner")
    table.pin(slot, job)
    run(table, slot, job, session)
    table.unpin(slot, job)
    return table


# --------------------------------------------------------------------------- pins


def test_pin_unpin_and_free_slots() -> None:
    table = SlotTable(3, generation=1)
    a, b = Job("a"), Job("b")
    assert table.free() == [0, 1, 2] and table.all_free()
    table.pin(1, a)
    assert table.pinned_to(1) is a and table.pinned_to(7) is None
    assert table.free() == [0, 2] and not table.all_free()
    with pytest.raises(AssertionError, match="already pinned"):
        table.pin(1, b)
    table.unpin(1, b)  # not b's pin: a no-op
    assert table.pinned_to(1) is a
    before = table.tick
    table.unpin(1, a)
    assert table.pinned_to(1) is None and table.slots[1].released > before
    table.unpin(1, a)  # twice: a no-op
    table.unpin(9, a)  # no such slot: a no-op
    assert table.all_free() and not SlotTable(0).all_free()
    assert repr(table) == "<SlotTable gen=1 slots=3 pinned=0>"


def test_only_the_pinned_job_may_change_a_slots_content() -> None:
    table = SlotTable(1, generation=1)
    a, b = Job("a"), Job("b")
    table.pin(0, a)
    changes: list[Callable[[], None]] = [
        lambda: table.sending(0, b),
        lambda: table.erased(0, b),
        lambda: table.restored(0, b, "s"),
        lambda: table.parked(0, b, "s"),
        lambda: table.completed(0, b, "s"),
    ]
    for change in changes:
        with pytest.raises(AssertionError, match="not pinned to"):
            change()
    assert table.content(0) is Content.FRESH


# --------------------------------------------------------------------------- content


def test_an_erase_is_unknown_until_acknowledged() -> None:
    table = owned_by("chat-1")
    job = Job("j")
    table.pin(0, job)
    table.sending(0, job)
    assert table.content(0) is Content.UNKNOWN and table.owner(0) is None
    assert not table.safe_for(0, "chat-1") and not table.safe_for(0, "chat-2")
    table.erased(0, job)  # acknowledged
    assert table.content(0) is Content.CLEAN
    assert table.safe_for(0, "chat-1") and table.safe_for(0, "chat-2")


def test_a_restore_is_unknown_until_acknowledged_and_then_owned_with_a_current_copy() -> None:
    table = owned_by("chat-1")
    job = Job("j")
    table.pin(0, job)
    table.sending(0, job)
    assert table.content(0) is Content.UNKNOWN
    table.restored(0, job, "chat-2")
    entry = table.slots[0]
    assert entry.content is Content.OWNED and entry.session == "chat-2" and entry.parked_current
    assert table.safe_for(0, "chat-2") and not table.safe_for(0, "chat-1")


def test_a_handoff_is_likely_only_when_no_clean_slot_is_left() -> None:
    table = SlotTable(3, generation=1)

    def complete(slot: int, session: str | None) -> None:
        job = Job(f"j{slot}")
        table.pin(slot, job)
        table.sending(slot, job)
        table.completed(slot, job, session)
        table.unpin(slot, job)

    complete(0, "chat-1")
    assert not table.handoff_likely(0)  # a lone owner, two fresh slots to spare
    complete(1, "chat-1")
    assert not table.handoff_likely(0)  # its own other conversation, one slot spare
    complete(2, "chat-1")
    assert table.handoff_likely(0)  # no slot left for a newcomer
    complete(2, "chat-2")
    assert table.handoff_likely(0)
    table = SlotTable(2, generation=1)
    complete(0, "chat-1")
    complete(1, None)
    assert table.handoff_likely(0)  # no slot to spare
    table = SlotTable(1, generation=1)
    complete(0, "chat-1")
    assert table.handoff_likely(0)
    table = SlotTable(4, generation=1)  # three owners on four slots: nobody is handed off
    for slot, owner in enumerate(("chat-1", "chat-2", "chat-3")):
        complete(slot, owner)
    assert not table.handoff_likely(0)


def test_a_completion_leaves_its_session_or_a_dirty_keyless_slot() -> None:
    table = SlotTable(2, generation=1)
    keyed, keyless = Job("keyed"), Job("keyless")
    table.pin(0, keyed)
    table.pin(1, keyless)
    table.sending(0, keyed)
    table.sending(1, keyless)
    assert table.content(0) is table.content(1) is Content.UNKNOWN  # while they run
    table.completed(0, keyed, "chat-1")
    table.completed(1, keyless, None)
    assert table.content(0) is Content.OWNED and table.owner(0) == "chat-1"
    assert table.content(1) is Content.KEYLESS and table.owner(1) is None
    assert table.last_used(0) < table.last_used(1)
    assert table.holders() == {"chat-1": [0]}
    assert table.safe_for(0, "chat-1") and not table.safe_for(0, "chat-2")
    assert not table.safe_for(1, "chat-1")  # a keyless job's KV is erased for a keyed one


@pytest.mark.parametrize("content", list(Content))
def test_a_keyless_job_is_blind_and_may_run_on_any_slot(content: Content) -> None:
    table = SlotTable(1, generation=1)
    table.slots[0].content = content
    if content is Content.OWNED:
        table.slots[0].session = "chat-1"
    assert table.safe_for(0, None)


def test_a_save_marks_the_parked_copy_current_only_for_the_slots_owner() -> None:
    table = owned_by("chat-1")
    job = Job("j")
    table.pin(0, job)
    table.parked(0, job, "chat-2")  # not what the slot holds: ignored
    assert not table.slots[0].parked_current
    table.parked(0, job, "chat-1")
    assert table.slots[0].parked_current and table.content(0) is Content.OWNED
    table.sending(0, job)  # anything sent makes the copy stale again
    assert not table.slots[0].parked_current


def test_forget_makes_every_slot_unknown_and_keeps_pins() -> None:
    table = owned_by("chat-1", size=3)
    job = Job("j")
    table.pin(2, job)
    table.forget()
    assert [e.content for e in table.slots] == [Content.UNKNOWN] * 3
    assert table.holders() == {} and table.pinned_to(2) is job
    assert table.preparation(1, "chat-1") == Preparation(erase=True)


# --------------------------------------------------------------------------- preparation


@pytest.mark.parametrize("parking", [False, True])
def test_preparation_for_the_slots_own_session_is_nothing(parking: bool) -> None:
    table = owned_by("chat-1")
    prep = table.preparation(0, "chat-1", parking=parking, is_parked=lambda _s: True)
    assert prep == Preparation() and prep.calls == 0


@pytest.mark.parametrize("session", ["chat-1", None])
def test_preparation_on_a_fresh_or_clean_slot_is_nothing(session: str | None) -> None:
    table = SlotTable(1, generation=1)
    assert table.preparation(0, session) == Preparation()
    job = Job("j")
    table.pin(0, job)
    table.sending(0, job)
    table.erased(0, job)
    assert table.preparation(0, session) == Preparation()


def test_preparation_for_another_session_erases() -> None:
    table = owned_by("chat-1")
    assert table.preparation(0, "chat-2") == Preparation(erase=True)


def test_preparation_for_a_keyless_job_only_parks_the_session_it_displaces() -> None:
    table = owned_by("chat-1")
    assert table.preparation(0, None) == Preparation()  # blind: no erase
    assert table.preparation(0, None, parking=True) == Preparation(park="chat-1")
    job = Job("j")
    table.pin(0, job)
    table.parked(0, job, "chat-1")
    on_disk = lambda s: s == "chat-1"  # noqa: E731
    assert table.preparation(0, None, parking=True, is_parked=on_disk) == Preparation()
    # its copy is current, unless the parked file was evicted since
    assert table.preparation(0, None, parking=True) == Preparation(park="chat-1")


def test_preparation_with_parking_saves_a_stale_copy_before_the_erase() -> None:
    table = owned_by("chat-1")
    prep = table.preparation(0, "chat-2", parking=True)
    assert prep == Preparation(park="chat-1", erase=True) and prep.calls == 2
    job = Job("j")
    table.pin(0, job)
    table.parked(0, job, "chat-1")  # the save was acknowledged
    on_disk = lambda s: s == "chat-1"  # noqa: E731
    assert table.preparation(0, "chat-2", parking=True, is_parked=on_disk) == Preparation(
        erase=True
    )


def test_preparation_with_parking_restores_the_incoming_sessions_copy() -> None:
    table = owned_by("chat-1")
    parked = {"chat-2"}
    prep = table.preparation(0, "chat-2", parking=True, is_parked=parked.__contains__)
    assert prep == Preparation(park="chat-1", restore=True) and prep.calls == 2
    assert table.preparation(0, "chat-3", parking=True, is_parked=parked.__contains__) == (
        Preparation(park="chat-1", erase=True)
    )
    # A fresh slot is safe as it is; a parked session still gets its KV back.
    fresh = SlotTable(1, generation=1)
    assert fresh.preparation(0, "chat-2", parking=True, is_parked=parked.__contains__) == (
        Preparation(restore=True)
    )
    assert fresh.preparation(0, "chat-2", is_parked=parked.__contains__) == Preparation()


@pytest.mark.parametrize("parking", [False, True])
@pytest.mark.parametrize("incoming", ["chat-1", "chat-2"])
def test_keyless_content_is_always_erased_for_a_keyed_job(parking: bool, incoming: str) -> None:
    table = SlotTable(1, generation=1)
    job = Job("keyless")
    table.pin(0, job)
    run(table, 0, job, None)
    table.unpin(0, job)
    assert table.content(0) is Content.KEYLESS
    prep = table.preparation(0, incoming, parking=parking)
    assert prep == Preparation(erase=True)  # nothing to park: a keyless job owns nothing
    # The next keyless job takes it as it is: it reads nothing the slot holds.
    assert table.preparation(0, None, parking=parking) == Preparation()


@pytest.mark.parametrize("incoming", ["chat-1", "chat-2"])
def test_unknown_content_is_erased_even_without_erase_on_handoff(incoming: str) -> None:
    table = owned_by("chat-1")
    table.forget()
    assert table.preparation(0, incoming, erase_on_handoff=False) == Preparation(erase=True)


def test_erase_on_handoff_off_skips_the_erase_of_known_content() -> None:
    table = owned_by("chat-1")
    assert table.preparation(0, "chat-2", erase_on_handoff=False) == Preparation()
    assert table.preparation(0, "chat-2", erase_on_handoff=False, parking=True) == (
        Preparation(park="chat-1")
    )


# --------------------------------------------------------------------------- reconciliation


def test_reconcile_holds_out_a_busy_unpinned_slot_until_it_is_idle() -> None:
    table = owned_by("chat-1", size=3)
    ours = Job("ours")
    table.pin(1, ours)
    at = table.tick
    assert table.reconcile([0, 1], sampled_at=at) == [0]  # 1 is our own job's
    assert table.slots[0].held_out and table.content(0) is Content.UNKNOWN
    assert table.content(1) is Content.FRESH and not table.slots[1].held_out
    assert table.free() == [2]
    with pytest.raises(AssertionError, match="held out"):
        table.pin(0, Job("late"))
    assert table.reconcile([0], sampled_at=table.tick) == []  # still busy: not newly
    assert table.slots[0].held_out
    assert table.reconcile([], sampled_at=table.tick) == []  # idle: released
    assert not table.slots[0].held_out and 0 in table.free()
    assert table.content(0) is Content.UNKNOWN  # and erased before its next use
    assert table.preparation(0, "chat-1") == Preparation(erase=True)


def test_reconcile_ignores_a_slot_released_after_the_sample_was_requested() -> None:
    table = SlotTable(2, generation=1)
    job = Job("j")
    table.pin(0, job)
    table.sending(0, job)
    at = table.tick  # the sample is requested while the completion runs ...
    table.completed(0, job, "chat-1")
    table.unpin(0, job)  # ... and the slot is released before the answer comes
    assert table.reconcile([0], sampled_at=at) == []
    assert not table.slots[0].held_out and table.owner(0) == "chat-1"
    # A sample requested after the release is believed.
    assert table.reconcile([0], sampled_at=table.tick) == [0]
    assert table.slots[0].held_out and table.owner(0) is None


def test_reconcile_ignores_slot_ids_the_table_does_not_have() -> None:
    table = SlotTable(1, generation=1)
    assert table.reconcile([5], sampled_at=table.tick) == []
    assert table.free() == [0]


# --------------------------------------------------------------------------- generations


def test_a_new_generation_makes_every_slot_fresh_and_keeps_pins() -> None:
    table = owned_by("chat-1", size=3)
    job = Job("j")
    table.pin(2, job)
    table.sending(2, job)
    table.reconcile([1], sampled_at=table.tick)
    assert table.slots[1].held_out
    assert table.sync(2, 3) == []
    assert table.generation == 2
    assert [e.content for e in table.slots] == [Content.FRESH] * 3
    assert not table.slots[1].held_out and table.pinned_to(2) is job
    table.completed(2, job, "chat-2")  # the pinned job carries on
    assert table.owner(2) == "chat-2"


def test_sync_to_a_smaller_engine_returns_the_jobs_whose_pins_were_lost() -> None:
    table = SlotTable(4, generation=1)
    jobs = [Job(str(i)) for i in range(4)]
    for i in (0, 2, 3):
        table.pin(i, jobs[i])
    lost = table.sync(2, 2)
    assert lost == [jobs[2], jobs[3]]
    assert len(table) == 2 and table.pinned_to(0) is jobs[0] and table.pinned_to(2) is None
    table.unpin(3, jobs[3])  # a lost job's release is a no-op
    assert table.sync(3, 4) == [] and table.free() == [1, 2, 3]


def test_sync_to_the_same_generation_keeps_what_it_knew() -> None:
    table = owned_by("chat-1", size=2)
    assert table.sync(1, 2) == []  # nothing changed
    assert table.owner(0) == "chat-1"
    assert table.sync(1, 3) == []  # same process, more slots
    assert table.owner(0) == "chat-1" and table.content(2) is Content.FRESH


def test_the_first_sync_sizes_an_empty_table() -> None:
    table = SlotTable()
    assert len(table) == 0 and table.free() == []
    assert table.sync(1, 2) == [] and table.free() == [0, 1]


# --------------------------------------------------------------------------- status


def test_statistics_hash_sessions_and_never_show_them() -> None:
    table = SlotTable(4, generation=7)
    a, b, c = Job("a"), Job("b"), Job("c")
    table.pin(0, a)
    run(table, 0, a, "secret-session-key")
    table.pin(1, b)
    run(table, 1, b, None)
    table.pin(2, c)
    table.sending(2, c)
    stats = table.statistics()
    assert stats.generation == 7 and stats.slots == 4 and stats.pinned == 3
    assert stats.held_out == 0
    assert stats.contents == {"owned": 1, "keyless": 1, "unknown": 1, "fresh": 1}
    assert stats.owners[0] == session_hash("secret-session-key")
    assert all(stats.owners.get(slot) is None for slot in (1, 2, 3))
    assert "secret-session-key" not in repr(stats)


# --------------------------------------------------------------------------- the model

SESSIONS = ("session-ann", "session-bea", "session-cat")
FOREIGN = "foreign"
Outcome = Literal["ack", "fail", "cancel"]
OUTCOMES: tuple[Outcome, ...] = ("ack", "ack", "fail", "cancel")
StepKind = Literal["park", "restore", "erase"]
ENVIRONMENT = (
    "cancel",
    "cancel",
    "idle_erase",
    "request_sample",
    "apply_sample",
    "request_sample",
    "apply_sample",
    "foreign_work_lands",
    "foreign_work_ends",
    "evict_parked_copy",
    "crash",
    "exclusive_op",
)


@dataclass(eq=False)
class ModelJob:
    """A job as the dispatcher runs it: its pin, its remaining steps, its completion."""

    id: int
    session: str | None
    slot: int
    steps: list[tuple[StepKind, str | None]] = field(default_factory=list)
    sent: bool = False
    ended: bool = False
    caller: str | None = None
    """Its caller, when it may start from another owner's prefix of that caller."""
    peers: frozenset[str] = frozenset()
    """The sessions of its caller (whose tokens it may be sent onto, with ``caller``)."""
    blocks: tuple[int, ...] = ()
    """Its request's prefix blocks (``()``: unknown)."""

    @property
    def token(self) -> str:
        """What this job's completion leaves in the KV."""
        return self.session if self.session is not None else f"keyless-{self.id}"

    @property
    def allowed(self) -> frozenset[str] | None:
        """What its slot's KV may hold when its completion is sent (keyless: anything,
        it is sent blind)."""
        return None if self.session is None else frozenset({self.session}) | self.peers

    def __repr__(self) -> str:
        return f"<job {self.id} {self.session or 'keyless'} on slot {self.slot}>"


@dataclass(frozen=True)
class Sample:
    """A ``/slots`` sample as requested: what the engine will report busy."""

    foreign: frozenset[int]
    ours: frozenset[int]
    """Busy with our own completions (their slots may be released before it is applied)."""
    tick: int
    generation: int
    clock: int

    @property
    def busy(self) -> frozenset[int]:
        return self.foreign | self.ours


class SlotTableMachine(RuleBasedStateMachine):
    """The table against the engine's truth, under the dispatcher's protocol."""

    def __init__(self) -> None:
        super().__init__()
        self.table = SlotTable()
        self.generation = 0
        self.parking = False
        self.truth: list[set[str]] = []
        """For each slot: the sessions (or keyless / foreign tokens) really in its KV."""
        self.jobs: dict[int, ModelJob] = {}
        self.next_id = 0
        self.parked: dict[str, frozenset[str]] = {}
        """The parking index: session -> what its saved copy holds."""
        self.clock = 0
        """Model events, to order foreign work against samples."""
        self.foreign_busy: set[int] = set()
        self.undiscovered: dict[int, int] = {}
        """Slots running foreign work that no sample has shown yet -> when it landed.
        Nothing can know of them, so no job is pinned to them until one does."""
        self.samples: list[Sample] = []
        """Requested ``/slots`` samples, applied in order."""

    # ------------------------------------------------------------------ helpers

    def _pick(self, data: st.DataObject, jobs: list[ModelJob]) -> ModelJob:
        return data.draw(st.sampled_from(sorted(jobs, key=lambda j: j.id)), label="job")

    def _pinnable(self) -> list[int]:
        return [s for s in self.table.free() if s not in self.undiscovered]

    def _preparable(self) -> list[ModelJob]:
        return [j for j in self.jobs.values() if not j.sent and not j.steps]

    def _stepping(self) -> list[ModelJob]:
        return [j for j in self.jobs.values() if j.steps]

    def _sendable(self) -> list[ModelJob]:
        return [
            j
            for j in self.jobs.values()
            if not j.sent and self.table.safe_for(j.slot, j.session, j.caller, j.blocks)
        ]

    def _running(self) -> list[ModelJob]:
        return [j for j in self.jobs.values() if j.sent and not j.ended]

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _restart(self, size: int) -> None:
        """A new engine process (crash, restart, stop-and-start): every KV is empty."""
        self.generation += 1
        self.truth = [set() for _ in range(size)]
        self.parked.clear()  # the lane drops its parking index with the process
        self.foreign_busy.clear()
        self.undiscovered.clear()
        expected = sorted(j.id for j in self.jobs.values() if j.slot >= size)
        lost = self.table.sync(self.generation, size)
        assert sorted(j.id for j in lost if isinstance(j, ModelJob)) == expected
        assert len(lost) == len(expected)
        for job in lost:
            assert isinstance(job, ModelJob)
            del self.jobs[job.id]  # it must not send anything more

    def _caller(self, session: str | None) -> str | None:
        """The caller whose other owners' prefixes ``session``'s jobs may start from
        (None: none; none in this model)."""
        return None

    def _blocks(self, session: str | None) -> tuple[int, ...]:
        """The prefix blocks of ``session``'s requests (``()``: unknown, in this model)."""
        return ()

    def _submit(self, slot: int, session: str | None) -> ModelJob:
        job = ModelJob(self.next_id, session, slot)
        job.blocks = self._blocks(session)
        job.caller = self._caller(session)
        if job.caller is not None:
            job.peers = frozenset(s for s in SESSIONS if self._caller(s) == job.caller)
        self.next_id += 1
        self.table.pin(slot, job)
        self.jobs[job.id] = job
        return job

    def _prepare(self, job: ModelJob) -> None:
        """``preparation`` for the job's slot, checked, as the job's list of steps."""
        safe = self.table.safe_for(job.slot, job.session, job.caller, job.blocks)
        owner = self.table.owner(job.slot)
        prep = self.table.preparation(
            job.slot,
            job.session,
            parking=self.parking,
            is_parked=self.parked.__contains__,
            caller=job.caller,
            prefix=job.blocks,
        )
        assert not (prep.restore and prep.erase)
        assert safe or prep.restore or prep.erase, f"{job!r}: unsafe slot, nothing planned"
        if job.session is None:  # blind: at most the save of the session it displaces
            assert safe and not prep.restore and not prep.erase
        elif self.table.shares_with(job.slot, job.session, job.caller, job.blocks):
            assert not prep.erase  # the engine keeps the prefix the two share
        elif safe:
            assert prep.park is None and not prep.erase
        if prep.restore:
            assert self.parking and job.session is not None and job.session in self.parked
        if prep.park is not None:
            assert self.parking and prep.park == owner and owner != job.session
        job.steps = []
        if prep.park is not None:
            job.steps.append(("park", prep.park))
        if prep.restore:
            job.steps.append(("restore", job.session))
        if prep.erase:
            job.steps.append(("erase", None))

    def _step(self, job: ModelJob, outcome: Outcome, *, carried_out: bool = False) -> None:
        """Run the job's next step. ``carried_out``: whether the engine did a step whose
        request was cancelled in flight."""
        kind, session = job.steps.pop(0)
        slot = job.slot
        if kind == "park":  # a save changes no content: nothing to record before it
            assert session is not None
            if outcome == "ack":
                self.parked[session] = frozenset(self.truth[slot])
                self.table.parked(slot, job, session)
            elif outcome == "cancel" and carried_out and session in self.parked:
                self.parked[session] = frozenset(self.truth[slot])  # the file was rewritten
            # a failed save: the handoff goes on
        else:
            self.table.sending(slot, job)
            if kind == "restore" and (session is None or session not in self.parked):
                # the parked copy is gone: the engine answers with an error
                outcome, carried_out = ("fail" if outcome == "ack" else outcome), False
            if outcome == "ack" or (outcome == "cancel" and carried_out):
                if kind == "erase":
                    self.truth[slot] = set()
                else:
                    assert session is not None
                    self.truth[slot] = set(self.parked[session])
            if outcome == "ack":
                if kind == "erase":
                    self.table.erased(slot, job)
                else:
                    assert session is not None
                    self.table.restored(
                        slot,
                        job,
                        session,
                        keyless=self._keyless(session),
                        blocks=self._blocks(session),
                        caller=self._caller(session),
                    )
            elif outcome == "fail":
                job.steps.clear()  # the dispatcher re-derives its plan (or gives up)
        if outcome == "cancel":
            self._release(job)

    def _send(self, job: ModelJob) -> None:
        """THE check: a keyed completion is sent only onto a KV holding nothing but its
        own session's tokens, or its caller's when it shares them. (A keyless one is
        sent blind: it reads nothing.)"""
        assert self.table.safe_for(job.slot, job.session, job.caller, job.blocks)
        truth = self.truth[job.slot]
        assert job.allowed is None or truth <= job.allowed, (
            f"{job!r} sends its completion onto a KV holding {sorted(truth)}, "
            f"which the table calls {self.table.slots[job.slot]!r}"
        )
        if self.table.shares_with(job.slot, job.session, job.caller, job.blocks):
            # The engine keeps only the prefix the two prompts share: the KV of those
            # tokens depends on nothing else, so it is exactly what the job would compute.
            self.truth[job.slot] = set()
        self.table.sending(job.slot, job)
        job.sent = True
        job.steps.clear()

    def _keyless(self, session: str) -> bool:
        """Whether ``session`` is a caller's keyless owner (none in this model)."""
        return False

    def _end(self, job: ModelJob, *, tokens: bool) -> None:
        """The job's completion ends (finished, failed or cancelled)."""
        if tokens:
            self.truth[job.slot].add(job.token)
        self.table.completed(job.slot, job, job.session, blocks=job.blocks, caller=job.caller)
        job.ended = True

    def _release(self, job: ModelJob, *, tokens: bool = True) -> None:
        if job.sent and not job.ended:
            self._end(job, tokens=tokens)
        self.table.unpin(job.slot, job)
        del self.jobs[job.id]

    def _apply(self, sample: Sample) -> None:
        if sample.generation != self.generation:
            return  # the dispatcher drops a sample of another engine process
        busy = sample.busy
        before = [(e.pin, e.content, e.session) for e in self.table.slots]
        newly = self.table.reconcile(busy, sampled_at=sample.tick)
        for entry, (pin, content, session) in zip(self.table.slots, before, strict=True):
            if entry.held_out:  # until a sample shows it idle
                assert entry.pin is None and entry.id in busy
                assert entry.content is Content.UNKNOWN
            if entry.id in newly:
                assert entry.id in busy and entry.pin is None
            if pin is not None:  # a pinned slot is our job's business
                assert (entry.content, entry.session) == (content, session)
            if entry.id in sample.ours - sample.foreign and entry.released > sample.tick:
                assert entry.id not in newly, f"{entry!r}: our own work, released since"
        for slot, landed in list(self.undiscovered.items()):
            if landed < sample.clock:  # the sample was requested while it ran: it saw it
                assert slot in busy and self.table.slots[slot].held_out, (
                    f"slot {slot} ran foreign work the sample saw, and was not held out"
                )
            if self.table.slots[slot].held_out:
                del self.undiscovered[slot]

    # ------------------------------------------------------------------ rules

    @initialize(size=st.integers(1, 3), parking=st.sampled_from((False, True, True, True)))
    def start(self, size: int, parking: bool) -> None:
        """A table for a fresh engine; KV parking on in most runs (restores need it)."""
        self.parking = parking
        self._restart(size)

    @precondition(lambda self: bool(self._pinnable()))
    @rule(data=st.data(), session=st.sampled_from((*SESSIONS, None)))
    def submit(self, data: st.DataObject, session: str | None) -> None:
        """A job is admitted: pinned to a free slot."""
        self._submit(data.draw(st.sampled_from(self._pinnable()), label="slot"), session)

    @precondition(lambda self: bool(self._preparable()))
    @rule(data=st.data())
    def prepare(self, data: st.DataObject) -> None:
        """The job plans what its slot needs (again, after a step failed)."""
        self._prepare(self._pick(data, self._preparable()))

    @precondition(lambda self: bool(self._stepping()))
    @rule(
        data=st.data(),
        outcome=st.sampled_from(("ack", "fail", "cancel")),
        carried_out=st.booleans(),
    )
    def step(self, data: st.DataObject, outcome: Outcome, carried_out: bool) -> None:
        """The job's next step: acknowledged, failed before it was sent, or cancelled
        in flight (the engine may or may not have carried it out)."""
        self._step(self._pick(data, self._stepping()), outcome, carried_out=carried_out)

    @precondition(lambda self: bool(self._sendable()))
    @rule(data=st.data())
    def send_completion(self, data: st.DataObject) -> None:
        """A job whose slot the table calls safe sends its completion."""
        self._send(self._pick(data, self._sendable()))

    @precondition(lambda self: bool(self._running()))
    @rule(data=st.data())
    def end_completion(self, data: st.DataObject) -> None:
        """The completion ends, and so does the job's block (settled: completed and
        unpinned)."""
        job = self._pick(data, self._running())
        self._end(job, tokens=True)
        self._release(job)

    @precondition(lambda self: bool(self._pinnable()))
    @rule(data=st.data(), session=st.sampled_from((*SESSIONS, None)))
    def whole_job(self, data: st.DataObject, session: str | None) -> None:
        """A job from admission to release in one step, as the dispatcher runs it (so
        that slots change hands often within a run): up to four rounds of preparation,
        each step acknowledged, failed or cancelled in flight; then its completion."""
        job = self._submit(data.draw(st.sampled_from(self._pinnable()), label="slot"), session)
        for _ in range(4):
            self._prepare(job)
            while job.steps:
                outcome = data.draw(st.sampled_from(OUTCOMES), label="outcome")
                self._step(job, outcome, carried_out=data.draw(st.booleans(), label="done"))
                if outcome == "cancel":
                    return  # released
            if self.table.safe_for(job.slot, job.session, job.caller, job.blocks):
                break
        else:
            self._release(job)  # the slot could not be made safe: the request fails
            return
        self._send(job)
        self._end(job, tokens=True)
        self._release(job)

    @rule(data=st.data(), event=st.sampled_from(ENVIRONMENT))
    def environment(self, data: st.DataObject, event: str) -> None:
        """Something the jobs do not control (one rule, so the jobs get most steps)."""
        getattr(self, f"_{event}")(data)

    def _cancel(self, data: st.DataObject) -> None:
        """A job ends now, at any point (its client went away, its block is over): a
        completion cut short may or may not have left tokens."""
        if self.jobs:
            job = self._pick(data, list(self.jobs.values()))
            self._release(job, tokens=data.draw(st.booleans(), label="left tokens"))

    def _idle_erase(self, data: st.DataObject) -> None:
        """The background erase of a slot a keyless job left idle: pinned to the
        cleanup until the engine acknowledges (or the erase fails or is cut short)."""
        idle = [s for s in self._pinnable() if self.table.content(s) is Content.KEYLESS]
        if idle:
            slot = data.draw(st.sampled_from(idle), label="slot")
            outcome = data.draw(st.sampled_from(OUTCOMES), label="outcome")
            cleanup = self._submit(slot, None)
            cleanup.steps = [("erase", None)]
            cleanup.sent = cleanup.ended = True  # it sends no completion
            self._step(cleanup, outcome, carried_out=data.draw(st.booleans(), label="done"))
            if cleanup.id in self.jobs:
                self._release(cleanup)

    def _request_sample(self, data: st.DataObject) -> None:
        if len(self.samples) < 3:
            ours = frozenset(j.slot for j in self._running())
            foreign = frozenset(self.foreign_busy)
            self.samples.append(
                Sample(foreign, ours, self.table.tick, self.generation, self._tick())
            )

    def _apply_sample(self, data: st.DataObject) -> None:
        if self.samples:
            self._apply(self.samples.pop(0))

    def _foreign_work_lands(self, data: st.DataObject) -> None:
        """Work the host did not send runs on a slot nobody of ours holds."""
        unpinned = [e.id for e in self.table.slots if e.pin is None]
        if unpinned:
            slot = data.draw(st.sampled_from(unpinned), label="slot")
            self.truth[slot].add(FOREIGN)
            self.foreign_busy.add(slot)
            self.undiscovered.setdefault(slot, self._tick())

    def _foreign_work_ends(self, data: st.DataObject) -> None:
        done = sorted(self.foreign_busy - set(self.undiscovered))
        if done:
            self.foreign_busy.discard(data.draw(st.sampled_from(done), label="slot"))

    def _evict_parked_copy(self, data: st.DataObject) -> None:
        if self.parked:
            del self.parked[data.draw(st.sampled_from(sorted(self.parked)), label="session")]

    def _crash(self, data: st.DataObject) -> None:
        """The engine crashes and restarts (or is stopped and started), maybe resized."""
        size = data.draw(st.one_of(st.none(), st.integers(1, 3)), label="new size")
        self._restart(len(self.table) if size is None else size)

    def _exclusive_op(self, data: st.DataObject) -> None:
        """An exclusive op runs alone and uses the engine as it pleases."""
        if not self.jobs:
            tokens = st.sets(st.sampled_from((*SESSIONS, FOREIGN, "keyless-exclusive")))
            for slot in range(len(self.truth)):
                self.truth[slot] = set(data.draw(tokens, label=f"slot {slot} after the op"))
            self.table.forget()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def the_table_never_vouches_for_more_than_the_truth(self) -> None:
        assert len(self.table) == len(self.truth)
        for entry in self.table.slots:
            assert isinstance(entry.content, Content)
            assert (entry.session is not None) is (entry.content is Content.OWNED)
            if entry.id in self.undiscovered:
                continue  # foreign work nothing has seen yet
            truth = self.truth[entry.id]
            if entry.content in (Content.FRESH, Content.CLEAN):
                assert not truth, f"{entry!r} holds {sorted(truth)}"
            elif entry.content is Content.OWNED:
                assert truth <= {entry.session}, f"{entry!r} holds {sorted(truth)}"
            # KEYLESS and UNKNOWN vouch for nothing: erased before a keyed job's use

    @invariant()
    def one_job_per_slot_and_one_slot_per_job(self) -> None:
        for entry in self.table.slots:
            if entry.pin is not None:
                assert isinstance(entry.pin, ModelJob)
                assert self.jobs.get(entry.pin.id) is entry.pin and entry.pin.slot == entry.id
                assert not entry.held_out
        for job in self.jobs.values():
            assert self.table.pinned_to(job.slot) is job

    @invariant()
    def statistics_show_no_session(self) -> None:
        stats = self.table.statistics()
        text = repr(stats)
        assert not any(s in text for s in SESSIONS)
        assert stats.pinned == len(self.jobs) and stats.slots == len(self.table)

    def teardown(self) -> None:
        """Every slot ends in a known state: with every job gone and every sample in,
        a fresh job can be made safe on any slot."""
        if sys.exc_info()[1] is not None or not self.table.slots:
            return  # the run failed (or never started): report that, not this
        for job in list(self.jobs.values()):
            self._release(job)
        assert all(e.pin is None for e in self.table.slots)
        while self.samples:
            self._apply(self.samples.pop(0))
        foreign = frozenset(self.foreign_busy)
        self._apply(Sample(foreign, frozenset(), self.table.tick, self.generation, self._tick()))
        assert not self.undiscovered
        self.foreign_busy.clear()
        self.table.reconcile((), sampled_at=self.table.tick)
        assert self.table.all_free()
        for slot in range(len(self.table)):
            for session in ("session-new", *SESSIONS, None):
                job = self._submit(slot, session)
                self._prepare(job)
                while job.steps:
                    self._step(job, "ack")
                assert self.table.safe_for(slot, session, job.caller, job.blocks), self.table.slots[
                    slot
                ]
                assert job.allowed is None or self.truth[slot] <= job.allowed
                self._release(job)


SlotTableMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=60, deadline=None
)
test_slot_table_against_the_engines_truth = SlotTableMachine.TestCase


# --------------------------------------------------------------------------- copies, saves


def _holding(table: SlotTable, slot: int, session: str, blocks: tuple[int, ...]) -> None:
    job = Job("turn")
    table.pin(slot, job)
    table.sending(slot, job)
    table.completed(slot, job, session, blocks=blocks)
    table.unpin(slot, job)


def test_an_owners_slot_holding_another_of_its_conversations_parks_it_and_restores() -> None:
    from gezel_trio.kv.prefix import shared_blocks

    table = SlotTable(1, generation=1)
    _holding(table, 0, "agent", (1, 2, 3))  # the main agent's conversation
    copies = {(7, 8)}  # the sub-agent's, parked
    current: set[tuple[int, ...]] = set()

    def shares(prefix: tuple[int, ...]) -> Callable[[str], int | None]:
        def best(session: str) -> int | None:
            found = [shared_blocks(c, prefix) for c in copies if shared_blocks(c, prefix)]
            return max(found) if session == "agent" and found else None

        return best

    def prep(prefix: tuple[int, ...]) -> Preparation:
        return table.preparation(
            0,
            "agent",
            parking=True,
            is_parked=lambda s: shares(prefix)(s) is not None,
            prefix=prefix,
            is_current=lambda s, b: s == "agent" and b in current,
            parked_shares=shares(prefix),
        )

    assert prep((1, 2, 3, 4)) == Preparation()  # it continues the slot
    assert prep((7, 8, 9)) == Preparation(park="agent", restore=True)
    assert prep((5, 6)) == Preparation(park="agent")  # a new conversation: no copy
    mark = object()
    table.begin_save(0, mark)  # saved in the background
    table.end_save(0, mark, "agent", tokens=10)
    assert prep((7, 8, 9)) == Preparation(park="agent", restore=True)  # not on disk
    current.add((1, 2, 3))
    assert prep((7, 8, 9)) == Preparation(restore=True)  # its copy is current: no save
    copies.add((1, 2, 9, 9))
    assert prep((1, 2, 9, 9, 10)) == Preparation(restore=True)  # shares 4 > 2
    copies.discard((1, 2, 9, 9))
    copies.add((1, 9))
    assert prep((1, 5, 6)) == Preparation()  # the copy shares 1 block, as the slot does
    # without parking, or without the copies' blocks, nothing changes for its owner
    assert table.preparation(0, "agent", prefix=(7, 8)) == Preparation()
    assert table.preparation(0, "agent", parking=True, prefix=(7, 8)) == Preparation()
    # another owner's copy never comes into it
    assert table.preparation(
        0, "other", parking=True, prefix=(7, 8), is_current=lambda s, b: True
    ) == Preparation(erase=True)


def test_a_restored_copy_is_current_and_records_its_blocks() -> None:
    table = SlotTable(2, generation=1)
    job = Job("restore")
    table.pin(0, job)
    table.sending(0, job)
    table.restored(0, job, "agent", keyless=True, blocks=(1, 2))
    entry = table.slots[0]
    assert (entry.content, entry.session, entry.blocks) == (Content.OWNED, "agent", (1, 2))
    assert entry.parked_current and entry.keyless
    # a save of a conversation that continues another slot's makes that one stale only
    _holding(table, 1, "agent", (1, 2, 3))
    other = Job("save")
    table.pin(1, other)
    table.parked(1, other, "agent")
    assert table.slots[1].parked_current and not table.slots[0].parked_current
    table.unpin(1, other)
    table.unpin(0, job)
    _holding(table, 0, "agent", (7,))
    table.pin(0, job)
    table.parked(0, job, "agent")
    assert table.slots[0].parked_current and table.slots[1].parked_current  # two copies


def test_a_background_save_marks_the_slot_until_it_ends() -> None:
    table = owned_by("chat-1", size=2)
    mark = object()
    assert table.begin_save(1, mark) is None  # fresh: nothing to save
    assert table.begin_save(0, mark) == "chat-1"
    assert table.saving(0) is mark and table.begin_save(0, object()) is None
    assert table.free() == [0, 1]  # not pinned: an owner's request may be placed on it
    # a reconciliation sample taken meanwhile does not hold it out
    assert table.reconcile([0], sampled_at=table.tick) == []
    assert table.content(0) is Content.OWNED
    table.end_save(0, object(), "chat-1", tokens=10)  # another save's end: ignored
    assert table.saving(0) is mark
    table.end_save(0, mark, "chat-1", tokens=10)
    assert table.saving(0) is None and table.slots[0].parked_current
    on_disk = {"chat-1"}.__contains__
    assert table.preparation(0, "chat-2", parking=True, is_parked=on_disk) == Preparation(
        erase=True
    )
    # a failed or cut save changes nothing: the copy is not current
    fresh = owned_by("chat-1")
    fresh.begin_save(0, mark)
    fresh.end_save(0, mark, "chat-1", tokens=None)
    assert fresh.saving(0) is None and not fresh.slots[0].parked_current
    assert fresh.content(0) is Content.OWNED
    # an empty slot (nothing saved) is clean
    fresh.begin_save(0, mark)
    fresh.end_save(0, mark, "chat-1", tokens=0)
    assert fresh.content(0) is Content.CLEAN
    # a pinned or held-out slot is never marked
    busy = owned_by("chat-1")
    busy.pin(0, Job("j"))
    assert busy.begin_save(0, mark) is None


def test_a_restart_forgets_a_save_in_flight() -> None:
    table = owned_by("chat-1")
    mark = object()
    table.begin_save(0, mark)
    table.sync(1, 2)  # same process, more slots: still being saved
    assert table.saving(0) is mark
    table.sync(2, 2)  # a new process: fresh, and the save's end changes nothing
    assert table.saving(0) is None
    table.end_save(0, mark, "chat-1", tokens=10)
    assert table.content(0) is Content.FRESH and not table.slots[0].parked_current


def test_placement_avoids_a_slot_being_saved_unless_its_owner_continues_it() -> None:
    from gezel_trio.scheduler.admission import choose_slot

    table = SlotTable(2, generation=1)
    _holding(table, 0, "ann", (1, 2))
    _holding(table, 1, "bea", (5,))
    assert choose_slot([0, 1], session="cid", table=table) == 0  # least recently used
    table.begin_save(0, object())
    assert choose_slot([0, 1], session="cid", table=table) == 1  # not the one being saved
    assert choose_slot([0, 1], session="ann", table=table, prefix=(1, 2, 3)) == 0  # its own
    assert choose_slot([0], session="cid", table=table) == 0  # only it: waits for the save


def test_an_owner_that_tells_its_conversation_again_otherwise_keeps_its_slot() -> None:
    """``claude -p --continue`` rebuilds the history it sends: the request diverges from
    its slot's blocks late (it keeps more of the slot than it drops) and goes there,
    not to a fresh slot that would re-prefill it all. A request sharing half of the
    slot's blocks or less is another conversation: the fresh slot keeps the first."""
    from gezel_trio.scheduler.admission import choose_slot

    table = SlotTable(2, generation=1)
    _holding(table, 0, "agent", (1, 2, 3, 4, 5, 6))  # slot 1 is fresh
    assert choose_slot([0, 1], session="agent", table=table, prefix=(1, 2, 3, 4, 9)) == 0
    assert choose_slot([0, 1], session="agent", table=table, prefix=(1, 2, 3, 9)) == 1
    assert choose_slot([0, 1], session="agent", table=table, prefix=(1, 9)) == 1
    # of two, the one sharing the most, as the engine's own choice
    _holding(table, 1, "agent", (1, 2, 3))
    assert choose_slot([0, 1], session="agent", table=table, prefix=(1, 2, 3, 4, 5, 8)) == 0
    assert choose_slot([0, 1], session="agent", table=table, prefix=(1, 2, 3, 7)) == 1
