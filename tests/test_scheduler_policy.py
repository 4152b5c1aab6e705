"""The scheduler's pure policy: ordering, turns, fairness, capacity, ownership, pinning.

No event loop: these drive :class:`SchedulerPolicy` by hand, the way the Trio
dispatcher does (plan, perform the action, report back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gezel_trio.errors import QueueFull, UnknownModel
from gezel_trio.scheduler.admission import (
    Admit,
    Load,
    RunExclusive,
    admission_capacity,
    choose_slot,
)
from gezel_trio.scheduler.jobs import JobKind, JobState, SlotMeasurement
from gezel_trio.scheduler.policy import SHORT_LOOKAHEAD, SchedulerPolicy
from gezel_trio.scheduler.queues import Job, _JobDeque
from gezel_trio.scheduler.slots import SlotTable


@dataclass
class Lane:
    """An external engine by default: admissions consume the driver's samples."""

    model_id: str
    parallel: int = 2
    generation: int = 1
    display_name: str = ""
    sole_client: bool = False
    family: str | None = None

    @property
    def slot_count(self) -> int:
        return self.parallel


Measure = Callable[[str], SlotMeasurement | None]


class Driver:
    """Plays the Trio layer: plans, loads, measures, admits, settles."""

    def __init__(self, *models: str, parallel: int = 2, **options: Any) -> None:
        self.lanes = {m: Lane(m, parallel=parallel, display_name=m.upper()) for m in models}
        self.policy = SchedulerPolicy(self.lanes.values(), **options)
        self.now = 0.0
        self.loads: list[str] = []
        self.started: list[Job] = []
        self.external: dict[str, set[int]] = {m: set() for m in models}
        self.measure: Measure = self.engine_view

    def engine_view(self, model_id: str) -> SlotMeasurement:
        """What /slots says: slots not taken by our running jobs nor by outsiders."""
        lane = self.lanes[model_id]
        busy = {
            j.slot_id
            for j in self.started
            if j.state is JobState.RUNNING and j.model_id == model_id
        }
        idle = tuple(
            i for i in range(lane.parallel) if i not in busy and i not in self.external[model_id]
        )
        return SlotMeasurement(idle=len(idle), ids=idle)

    def submit(self, model: str, session: str | None = None, kind: JobKind = "completion") -> Job:
        return self.policy.enqueue(Job(model_id=model, kind=kind, session=session), now=self.now)

    def step(self, *, fail_loads: frozenset[str] = frozenset()) -> list[Job]:
        """Plan and act until nothing changes; returns the jobs started."""
        started: list[Job] = []
        for _ in range(100):
            actions = self.policy.plan()
            if not actions:
                break
            progressed = False
            for action in actions:
                if isinstance(action, Load):
                    self.loads.append(action.model_id)
                    if action.model_id in fail_loads:
                        self.policy.load_failed(action.model_id)
                    else:
                        self.policy.load_done(action.model_id)
                    progressed = True
                elif isinstance(action, RunExclusive):
                    started.append(action.job)
                    progressed = True
                elif isinstance(action, Admit):
                    got = self.policy.admit(
                        action.model_id, self.measure(action.model_id), now=self.now
                    ).jobs
                    started.extend(got)
                    progressed = progressed or bool(got)
            if not progressed:
                break
        self.started.extend(started)
        return started

    def settle(self, job: Job, *, ran: bool = True) -> None:
        job.ran = ran
        self.policy.settle(job, now=self.now)


def seqs(jobs: list[Job]) -> list[int]:
    return [j.seq for j in jobs]


# --------------------------------------------------------------------------- capacity


@pytest.mark.parametrize(
    ("parallel", "running", "measured", "expected"),
    [
        (2, 0, None, 2),  # unknown: trust the profile
        (2, 1, None, 1),
        (2, 1, SlotMeasurement(1), 1),  # one chat live: idle already excludes it
        (4, 1, SlotMeasurement(3), 3),
        (4, 1, SlotMeasurement(1), 1),  # outside traffic holds two slots
        (4, 0, SlotMeasurement(0), 0),
        (2, 2, SlotMeasurement(2), 0),  # our ceiling, though the sample lags
        (1, 3, None, 0),  # the ceiling was lowered under running jobs
    ],
)
def test_admission_capacity_is_min_never_both_subtracted(
    parallel: int, running: int, measured: SlotMeasurement | None, expected: int
) -> None:
    assert admission_capacity(parallel, running, measured) == expected


# --------------------------------------------------------------------------- ownership


def _owned(table: SlotTable, slot: int, session: str | None) -> None:
    job = object()
    table.pin(slot, job)
    table.sending(slot, job)
    table.completed(slot, job, session)
    table.unpin(slot, job)


def test_choose_slot_prefers_own_then_fresh_then_unwanted_lru() -> None:
    table = SlotTable(4, generation=1)
    _owned(table, 0, "s0")
    _owned(table, 1, "s1")
    _owned(table, 2, "s1")
    _owned(table, 0, "s0")  # slot 0 used most recently
    assert choose_slot([0, 1, 2, 3], session="s1", table=table) == 2  # own, most recent
    assert choose_slot([0, 1, 3], session="s9", table=table) == 3  # fresh: no erase
    # no fresh slot: the owner with no waiting job, least recently used first
    assert choose_slot([0, 1], session="s9", table=table) == 1
    assert choose_slot([0, 1], session="s9", table=table, wanted=lambda s: s == "s1") == 0
    assert choose_slot([], session="s1", table=table) is None


# --------------------------------------------------------------------------- turns


def test_turn_claims_its_model_up_to_the_first_exclusive_op() -> None:
    d = Driver("a", "b", parallel=8)
    a1, b1, a2 = d.submit("a"), d.submit("b"), d.submit("a")
    x = d.submit("a", kind="calibrate")
    a3 = d.submit("a")
    assert seqs(d.step()) == seqs([a1, a2])  # a3 is behind the calibration
    assert d.loads == ["a"]
    for job in (a1, a2):
        d.settle(job)
    assert seqs(d.step()) == seqs([b1])  # b1 was at the head, ahead of the op
    d.settle(b1)
    assert d.step() == [x]
    assert x.state is JobState.RUNNING and x.slot_id is None
    d.settle(x)
    assert seqs(d.step()) == seqs([a3])


def test_open_turn_absorbs_only_while_its_model_is_at_the_head() -> None:
    d = Driver("a", "b", parallel=8)
    a1 = d.submit("a")
    assert d.step() == [a1]
    a2 = d.submit("a")
    assert d.step() == [a2]  # joins the running turn at once
    d.settle(a1)
    d.settle(a2)
    d.step()
    a3 = d.submit("a")
    assert d.step() == [a3]  # the drained turn is still open
    assert d.loads == ["a", "a"]  # residency re-ensured after the turn went idle
    b1 = d.submit("b")
    a4 = d.submit("a")
    assert d.step() == []  # b1 is at the head: the turn stops absorbing
    d.settle(a3)
    assert d.step() == [b1]
    d.settle(b1)
    assert d.step() == [a4]


def test_turn_retires_only_after_its_claimed_jobs_ran() -> None:
    d = Driver("a", "b", parallel=1)
    a1, a2 = d.submit("a"), d.submit("a")
    b1 = d.submit("b")
    assert d.step() == [a1]
    d.settle(a1)
    assert d.step() == [a2]  # claimed before b1 arrived: still a's turn
    d.settle(a2)
    assert d.step() == [b1]
    assert d.policy.switches == 1


def test_next_turn_prefers_another_model() -> None:
    d = Driver("a", "b", "c", parallel=4)
    a1 = d.submit("a")
    d.step()
    x = d.submit("a", kind="benchmark")
    a2, c1 = d.submit("a"), d.submit("c")
    d.settle(a1)
    assert d.step() == [x]
    d.settle(x)
    assert d.step() == [c1]  # a just ran: c goes first though a2 is older
    d.settle(c1)
    assert d.step() == [a2]


def test_nothing_is_admitted_while_an_exclusive_op_runs() -> None:
    d = Driver("a", parallel=4)
    x = d.submit("a", kind="sweep")
    assert d.step() == [x]
    a1 = d.submit("a")
    assert d.step() == []
    assert d.policy.snapshot().active is not None
    d.settle(x)
    assert d.step() == [a1]


def test_exclusive_op_waits_for_every_model_of_its_group_to_drain() -> None:
    d = Driver("a", "b", parallel=2, residency="coexist")
    a1, b1 = d.submit("a"), d.submit("b")
    assert {j.seq for j in d.step()} == {a1.seq, b1.seq}
    d.policy.set_residency("swap")
    x = d.submit("a", kind="benchmark")
    d.settle(a1)
    assert d.step() == []  # b1 still runs on the same GPU
    d.settle(b1)
    assert d.step() == [x]


def test_swap_never_mixes_models_and_coexist_does() -> None:
    d = Driver("a", "b", parallel=2)
    a1, b1 = d.submit("a"), d.submit("b")
    assert d.step() == [a1]
    d.policy.set_residency("coexist")
    assert d.step() == [b1]
    assert d.policy.snapshot().running == {"a": 1, "b": 1}


def test_set_residency_returns_claimed_jobs_in_fifo_order() -> None:
    d = Driver("a", "b", parallel=1, residency="coexist")
    a1, a2, b1, a3 = d.submit("a"), d.submit("a"), d.submit("b"), d.submit("a")
    assert {j.seq for j in d.step()} == {a1.seq, b1.seq}
    d.policy.set_residency("swap")
    d.settle(b1)
    assert d.step() == []  # a1 still running: a's turn (a2 is at the head)
    d.settle(a1)
    assert d.step() == [a2]
    d.settle(a2)
    assert d.step() == [a3]


# --------------------------------------------------------------------------- affinity, pinning


def test_affinity_runs_slot_holders_first_then_fifo() -> None:
    d = Driver("a", parallel=2)
    s1, s2 = d.submit("a", "s1"), d.submit("a", "s2")
    assert [j.slot_id for j in d.step()] == [0, 1]
    d.settle(s1)
    d.settle(s2)
    k1, x1, s2b, k2, s1b = (
        d.submit("a"),
        d.submit("a", "s3"),
        d.submit("a", "s2"),
        d.submit("a"),
        d.submit("a", "s1"),
    )
    started = d.step()
    assert started == [s2b, s1b]  # slot holders first, FIFO among them
    assert [j.slot_id for j in started] == [1, 0]  # each on its own slot
    table = d.policy.table("a")
    assert all(table.safe_for(j.slot_id, j.session) for j in started if j.slot_id is not None)
    for job in started:
        d.settle(job)
    started = d.step()
    assert started == [k1, x1]  # then FIFO, keyless included
    assert x1.slot_id is not None and not table.safe_for(x1.slot_id, x1.session)  # erased first
    assert k1.slot_id is not None and table.handoff_cost(k1.slot_id, None) == 3  # blind
    for job in started:
        d.settle(job)
    assert d.step() == [k2]


def test_affinity_off_is_plain_fifo() -> None:
    d = Driver("a", parallel=1, affinity=False)
    s1 = d.submit("a", "s1")
    d.step()
    k1, s1b = d.submit("a"), d.submit("a", "s1")
    d.settle(s1)
    assert d.step() == [k1]
    d.settle(k1)
    assert d.step() == [s1b]


def _job(d: Driver, session: str, blocks: int, *, reuse: int = 0, first: int = 0) -> Job:
    """A queued completion of ``session`` whose prompt is ``blocks`` blocks (numbered
    from ``first``), ``reuse`` of them in a parked copy."""
    prefix = tuple(range(first, first + blocks))
    return d.policy.enqueue(
        Job(model_id="a", session=session, prefix=prefix, reuse=reuse), now=d.now
    )


def test_a_short_prefill_goes_before_a_long_head() -> None:
    """An agent's next turn on its parked KV (2 new blocks) does not wait behind another
    session's cold 40-block prompt; the head goes next."""
    d = Driver("a", parallel=1, short_first_passes=4)
    busy = d.submit("a", "busy")
    d.step()
    cold = _job(d, "cold", 40)
    warm = _job(d, "warm", 20, reuse=18, first=100)
    d.settle(busy)
    assert d.step() == [warm]
    assert cold.passed == 1 and d.policy.snapshot().short_first == 1
    d.settle(warm)
    assert d.step() == [cold]


def test_a_long_head_is_passed_over_at_most_short_first_passes_times() -> None:
    d = Driver("a", parallel=1, short_first_passes=2)
    first = d.submit("a", "busy")
    d.step()
    cold = _job(d, "cold", 40)
    shorts = [_job(d, f"s{i}", 4, first=100 * (i + 1)) for i in range(3)]
    running = first
    order = []
    for _ in range(4):
        d.settle(running)
        (running,) = d.step()
        order.append(running)
    assert order == [shorts[0], shorts[1], cold, shorts[2]]


def test_short_work_first_off_is_first_come_first_served() -> None:
    d = Driver("a", parallel=1)  # the policy's default: 0 passes
    busy = d.submit("a", "busy")
    d.step()
    cold = _job(d, "cold", 40)
    _job(d, "warm", 20, reuse=18, first=100)
    d.settle(busy)
    assert d.step() == [cold]


def test_what_a_job_may_start_from_counts_as_done() -> None:
    """The blocks its owner's slot holds count as done; the same blocks in another
    owner's slot do not (no caller sharing here)."""
    d = Driver("a", parallel=2, affinity=False, short_first_passes=4)
    own, hold = _job(d, "own", 30), _job(d, "hold", 30, first=900)
    assert d.step() == [own, hold]
    d.settle(own)  # slot 0 keeps own's 30 blocks; hold keeps slot 1 busy
    cold = _job(d, "cold", 40, first=700)
    stranger = _job(d, "stranger", 32)  # the same first 30 blocks, another owner
    back = _job(d, "own", 32)  # own's next turn: 2 new blocks
    assert d.step() == [back]
    assert back.slot_id == 0 and cold.passed == 1 and stranger.state is JobState.QUEUED


def test_a_job_of_unknown_work_neither_jumps_nor_is_passed_over() -> None:
    d = Driver("a", parallel=1, short_first_passes=4)
    busy = d.submit("a", "busy")
    d.step()
    unknown = d.submit("a", "unknown")  # no blocks
    short = _job(d, "short", 2)
    d.settle(busy)
    assert d.step() == [unknown]
    d.settle(unknown)
    cold = _job(d, "cold", 40, first=100)
    late = d.submit("a", "late")
    assert d.step() == [short]
    d.settle(short)
    assert d.step() == [cold] and late.state is JobState.QUEUED


def test_short_work_first_looks_only_a_few_jobs_behind_the_head() -> None:
    d = Driver("a", parallel=1, short_first_passes=4)
    busy = d.submit("a", "busy")
    d.step()
    cold = _job(d, "cold", 40)
    for i in range(SHORT_LOOKAHEAD):
        _job(d, f"long{i}", 40, first=100 * (i + 1))
    _job(d, "short", 2, first=10_000)
    d.settle(busy)
    assert d.step() == [cold]


def test_pins_are_distinct_and_exclude_running_pins() -> None:
    d = Driver("a", parallel=4)
    # The engine has not seen our jobs yet: every sample reports all four slots idle.
    d.measure = lambda model: SlotMeasurement(idle=4, ids=(0, 1, 2, 3))
    first = [d.submit("a") for _ in range(2)]
    assert [j.slot_id for j in d.step()] == [0, 1]
    later = [d.submit("a") for _ in range(3)]
    got = d.step()
    assert [j.slot_id for j in got] == [2, 3]  # capacity 2 (4 - 2 running), pins 2 and 3
    assert later[2].state is JobState.QUEUED
    d.settle(first[0])
    got = d.step()
    assert [j.slot_id for j in got] == [0]


def test_no_admission_without_named_ids_nor_beyond_the_named_pool() -> None:
    d = Driver("a", parallel=3)
    d.measure = lambda model: SlotMeasurement(idle=2)  # a count, no per-slot rows
    first = [d.submit("a"), d.submit("a")]
    assert d.step() == []  # nothing can be pinned: nothing is sent
    d.measure = lambda model: SlotMeasurement(idle=2, ids=(2,))  # names fewer than it counts
    # Only as many jobs as there are nameable slots: an unpinned job would land on
    # whatever slot the engine picks, possibly one holding another chat's KV.
    assert d.step() == first[:1]
    assert first[0].slot_id == 2 and first[1].state is JobState.QUEUED


def test_a_spawned_engine_admits_from_its_table_without_a_sample() -> None:
    d = Driver("a", parallel=2)
    d.lanes["a"].sole_client = True
    d.measure = lambda model: None  # never consulted
    jobs = [d.submit("a", f"s{i}") for i in range(3)]
    assert d.step() == jobs[:2]
    assert sorted(j.slot_id for j in jobs[:2] if j.slot_id is not None) == [0, 1]
    d.settle(jobs[0])
    assert d.step() == [jobs[2]] and jobs[2].slot_id == jobs[0].slot_id


def test_an_any_slot_job_waits_for_every_slot_and_leaves_them_unknown() -> None:
    d = Driver("a", parallel=2)
    d.lanes["a"].sole_client = True
    chat = d.submit("a", "s1")
    embed = Job(model_id="a", any_slot=True, needs_slot=False)
    d.policy.enqueue(embed, now=0.0)
    later = d.submit("a", "s2")
    assert d.step() == [chat]  # the embedding waits: one slot is pinned
    d.settle(chat)
    assert d.step() == [embed]
    table = d.policy.table("a")
    assert embed.slot_id is None and table.free() == []
    d.settle(embed)
    assert [table.content(i).value for i in range(2)] == ["unknown", "unknown"]
    assert d.step() == [later]


@pytest.mark.parametrize(("ran", "expect_owner"), [(True, "s2"), (False, "s1")])
def test_settle_records_what_the_slot_holds(ran: bool, expect_owner: str) -> None:
    d = Driver("a", parallel=1)
    s1 = d.submit("a", "s1")
    d.step()
    d.settle(s1)
    s2 = d.submit("a", "s2")
    d.step()
    d.settle(s2, ran=ran)  # not ran: nothing was sent, the slot still holds s1's KV
    table = d.policy.table("a")
    assert table.owner(0) == expect_owner
    assert table.free() == [0]


def test_an_engine_restart_makes_every_slot_fresh_and_keeps_running_pins() -> None:
    d = Driver("a", parallel=2)
    s1 = d.submit("a", "s1")
    d.step()
    d.lanes["a"].generation += 1
    table = d.policy.table("a")
    assert table.pinned_to(0) is s1 and table.content(0).value == "fresh"
    d.settle(s1)
    assert table.owner(0) == "s1"  # conservative: it may have reached the new engine
    s2 = d.submit("a", "s2")
    d.step()
    assert s2.slot_id == 1  # the fresh slot: no erase needed


def test_erase_on_handoff_off_tracks_but_never_erases() -> None:
    d = Driver("a", parallel=1, erase_on_handoff=False)
    s1 = d.submit("a", "s1")
    d.step()
    d.settle(s1)
    s2 = d.submit("a", "s2")
    d.step()
    table = d.policy.table("a")
    assert not table.preparation(0, "s2", erase_on_handoff=False).erase
    d.settle(s2)
    assert table.owner(0) == "s2"


# --------------------------------------------------------------------------- queue


def test_cancel_and_queue_bound() -> None:
    d = Driver("a", parallel=1, max_queue=3)
    a1 = d.submit("a")
    d.step()
    queued = [d.submit("a", f"s{i}") for i in range(3)]
    with pytest.raises(QueueFull) as info:
        d.submit("a")
    assert info.value.retry_after >= 1
    assert d.policy.cancel(queued[1]) and not d.policy.cancel(queued[1])
    assert d.policy.queued == 2 and d.policy.snapshot().waiting_model_ids == {"a": 2}
    d.submit("a")  # room again
    d.settle(a1)
    assert d.step() == [queued[0]]
    with pytest.raises(UnknownModel):
        d.submit("nope")


def test_lazy_deques_stay_bounded_under_cancel_churn() -> None:
    d = Driver("a", "b", parallel=1, max_queue=10)
    d.submit("a")
    d.step()
    d.submit("b")  # stuck behind a's turn: the head of b's queue
    for _ in range(5000):
        d.policy.cancel(d.submit("b", "s"))
    deque_b = d.policy._models["b"].queue  # the memory bound is the point
    assert len(deque_b) == 1 and deque_b.entries() <= 2 * 64 + 2


def test_job_deque_removal_anywhere() -> None:
    q = _JobDeque()
    jobs = [Job(model_id="a", seq=i) for i in range(200)]
    for job in jobs:
        q.append(job)
    for job in jobs[1:150]:
        q.discard(job)
    assert len(q) == 51 and q.head() is jobs[0]
    q.discard(jobs[0])
    assert q.head() is jobs[150] and list(q) == jobs[150:]
    assert q.entries() <= 2 * len(q) + 64


def test_load_failure_fails_the_turns_claimed_jobs_and_retries_later() -> None:
    d = Driver("a", "b", parallel=2)
    b1, b2 = d.submit("b"), d.submit("b")
    a1 = d.submit("a")
    assert d.step(fail_loads=frozenset({"b"})) == [a1]
    assert b1.state is JobState.FAILED and b2.state is JobState.FAILED
    assert d.policy.queued == 0
    d.settle(a1)
    b3 = d.submit("b")
    assert d.step() == [b3]
    assert d.loads == ["b", "a", "b"]


def test_remove_lane_returns_its_queued_jobs() -> None:
    d = Driver("a", "b", parallel=1)
    a1 = d.submit("a")
    d.step()
    a2, b1 = d.submit("a"), d.submit("b")
    failed = d.policy.remove_lane("a")
    assert failed == [a2] and a2.state is JobState.FAILED
    assert d.step() == [b1]  # a's running job no longer holds the turn
    d.settle(a1)
    assert d.policy.snapshot().running == {"b": 1}


# --------------------------------------------------------------------------- invariants


_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"),
            st.integers(0, 2),
            st.sampled_from([None, "s0", "s1", "s2"]),
            st.sampled_from(["completion"] * 6 + ["benchmark"]),
        ),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
        st.tuples(st.just("settle"), st.integers(0, 50), st.booleans(), st.booleans()),
        st.tuples(st.just("step"), st.booleans()),
        st.tuples(st.just("restart"), st.integers(0, 2)),
        st.tuples(st.just("outside"), st.integers(0, 2), st.integers(0, 2)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, residency=st.sampled_from(["swap", "coexist"]))
def test_policy_invariants_hold_under_any_sequence(
    ops: list[tuple[Any, ...]], residency: str
) -> None:
    models = ("a", "b", "c")
    d = Driver(*models, parallel=2, residency=residency, max_queue=20)
    jobs: list[Job] = []

    def check() -> None:
        pol = d.policy
        queued = [j for j in jobs if j.state is JobState.QUEUED]
        running = [j for j in jobs if j.state is JobState.RUNNING]
        assert pol.queued == len(queued) == sum(pol.snapshot().waiting_model_ids.values())
        for m in models:
            mine = [j for j in running if j.model_id == m and not j.exclusive]
            assert pol.running_count(m) == len(mine) <= d.lanes[m].parallel
            pins = [j.slot_id for j in mine if j.slot_id is not None]
            assert len(pins) == len(set(pins))  # distinct pins among running jobs
        exclusive = [j for j in running if j.exclusive]
        for x in exclusive:  # an exclusive op runs alone in its group
            others = [
                j
                for j in running
                if j is not x and (residency == "swap" or j.model_id == x.model_id)
            ]
            assert others == []
        if residency == "swap":
            assert len({j.model_id for j in running}) <= 1

    for op in ops:
        kind = op[0]
        if kind == "submit":
            _, mi, session, jk = op
            try:
                jobs.append(d.submit(models[mi], session, jk))
            except QueueFull:
                pass
        elif kind == "cancel":
            queued = [j for j in jobs if j.state is JobState.QUEUED]
            if queued:
                d.policy.cancel(queued[op[1] % len(queued)])
        elif kind == "settle":
            running = [j for j in jobs if j.state is JobState.RUNNING]
            if running:
                d.settle(running[op[1] % len(running)], ran=bool(op[2]))
        elif kind == "step":
            d.step(fail_loads=frozenset({"c"}) if op[1] else frozenset())
        elif kind == "restart":
            d.lanes[models[op[1]]].generation += 1
        elif kind == "outside":
            d.external[models[op[1]]] = set(range(op[2]))
        check()

    # Liveness: with outside traffic gone and loads succeeding, everything queued runs.
    for m in models:
        d.external[m] = set()
    for _ in range(200):
        for job in [j for j in jobs if j.state is JobState.RUNNING]:
            d.settle(job)
        d.step()
        check()
        if not any(j.state in (JobState.QUEUED, JobState.RUNNING) for j in jobs):
            break
    assert not any(j.state is JobState.QUEUED for j in jobs)


# --------------------------------------------------------------------------- replicas: the pool


def _replicas(*members: str, others: tuple[str, ...] = (), **options: Any) -> Driver:
    """A driver whose ``members`` are replicas of one model ``m`` (spawned engines)."""
    d = Driver(parallel=2, **options)
    for model_id in members:
        lane = Lane(model_id, parallel=2, display_name="M", sole_client=True, family="m")
        d.lanes[model_id] = lane
        d.external[model_id] = set()
        d.policy.add_lane(lane)
    for model_id in others:
        lane = Lane(model_id, parallel=2, display_name=model_id.upper(), sole_client=True)
        d.lanes[model_id] = lane
        d.external[model_id] = set()
        d.policy.add_lane(lane)
    return d


def _pooled(d: Driver, model: str, session: str | None = None) -> Job:
    job = Job(model_id=model, session=session, pool=True)
    return d.policy.enqueue(job, now=d.now)


@pytest.mark.parametrize("residency", ["swap", "coexist"])
def test_replicas_run_in_one_turn_and_a_free_sibling_takes_pool_jobs(residency: str) -> None:
    d = _replicas("m@0", "m@1", others=("x",), residency=residency)
    jobs = [_pooled(d, "m@0") for _ in range(4)]  # all routed to one member
    started = d.step()
    assert sorted(d.loads) == ["m@0", "m@1"]  # the pool loads its members together
    assert seqs(started) == seqs(jobs)  # two slots each: nobody waits
    assert {j.model_id for j in jobs} == {"m@0", "m@1"}
    assert d.policy.snapshot().pool["pooled"] == 2
    if residency == "swap":  # the family is one turn: the other model waits for it
        x = d.submit("x")
        assert d.step() == []
        for job in jobs:
            d.settle(job)
        assert d.step() == [x]


def test_a_job_bound_to_its_kv_is_not_taken_by_a_sibling() -> None:
    d = _replicas("m@0", "m@1", residency="coexist")
    warm = [_pooled(d, "m@0", f"s{i}") for i in range(4)]
    assert d.step() == warm
    for job in warm:
        d.settle(job)
    on_0 = [j.session for j in warm if j.model_id == "m@0"]
    assert len(on_0) == 2  # two went to the sibling
    busy = [_pooled(d, "m@0"), _pooled(d, "m@0")]
    assert d.step() == busy and {j.model_id for j in busy} == {"m@0"}  # own room first
    keyed = _pooled(d, "m@0", on_0[0])  # its session holds a slot of m@0: it stays
    assert d.step() == []
    assert keyed.state is JobState.QUEUED and keyed.model_id == "m@0"
    parked = d.submit("m@0", on_0[1])  # routed to its parked KV: not a pool job
    assert d.step() == [] and parked.model_id == "m@0"
    d.settle(busy[0])
    d.settle(busy[1])
    assert d.step() == [keyed, parked]
    assert {keyed.model_id, parked.model_id} == {"m@0"}
    assert d.policy.snapshot().pool["pooled"] == 2  # only the two of the warm-up


def test_a_pool_job_runs_on_its_own_member_when_that_member_has_room() -> None:
    """The router sent a keyless job to the second member (the least loaded, or away
    from an overloaded member holding its prefix): the first member's admission comes
    first in the pass and has room too, but the job is its own member's."""
    d = _replicas("m@0", "m@1", residency="coexist")
    warm = [_pooled(d, "m@0") for _ in range(4)]
    d.step()
    assert d.loads == ["m@0", "m@1"]
    for job in warm:
        d.settle(job)
    pooled = d.policy.snapshot().pool["pooled"]
    shed = d.policy.enqueue(Job(model_id="m@1", session="k", keyless=True, pool=True), now=d.now)
    assert d.step() == [shed] and shed.model_id == "m@1"
    assert d.policy.snapshot().pool["pooled"] == pooled
    # With no room left on its member, a sibling with room still takes one
    busy = [_pooled(d, "m@1") for _ in range(2)]
    assert sorted(seqs(d.step())) == seqs(busy)
    assert [j.model_id for j in busy] == ["m@1", "m@0"]
    assert d.policy.snapshot().pool["pooled"] == pooled + 1


def test_one_member_starts_for_a_few_jobs_and_a_sibling_for_more() -> None:
    d = _replicas("m@0", "m@1", residency="coexist")
    first = _pooled(d, "m@0")
    assert d.step() == [first] and d.loads == ["m@0"]  # its room covers the pool
    more = [_pooled(d, "m@0") for _ in range(3)]
    d.step()
    assert d.loads == ["m@0", "m@1"]
    assert all(j.state is JobState.RUNNING for j in more)


def test_an_exclusive_op_drains_every_replica() -> None:
    d = _replicas("m@0", "m@1", residency="coexist")
    a = _pooled(d, "m@1")
    assert d.step() == [a] and a.model_id == "m@1"
    op = d.submit("m@0", kind="calibrate")
    later = _pooled(d, "m@0")
    assert d.step() == []  # m@0 is idle, but its sibling is not drained
    d.settle(a)
    assert d.step() == [op]
    assert d.step() == []  # nothing runs beside it, on either replica
    d.settle(op)
    assert d.step() == [later]


def test_a_replica_that_fails_to_load_hands_its_queue_to_a_sibling_in_order() -> None:
    d = _replicas("m@0", "m@1", residency="coexist")
    jobs = [_pooled(d, "m@0", f"s{i}") for i in range(3)] + [d.submit("m@0", "bound")]
    started = d.step(fail_loads=frozenset({"m@0"}))
    assert all(j.state is not JobState.FAILED for j in jobs)
    assert {j.model_id for j in jobs} == {"m@1"}
    assert seqs(started) == seqs(jobs[:2])  # m@1's two slots, in queue order
    assert d.policy.snapshot().pool["failovers"] == 4
    assert d.policy.is_down("m@0")
    for job in started:
        d.settle(job)
    assert seqs(d.step(fail_loads=frozenset({"m@0"}))) == seqs(jobs[2:])


def test_with_every_replica_down_their_jobs_fail_as_one_models_would() -> None:
    d = _replicas("m@0", "m@1", residency="coexist")
    jobs = [_pooled(d, "m@0"), _pooled(d, "m@1")]
    d.step(fail_loads=frozenset({"m@0", "m@1"}))
    assert [j.state for j in jobs] == [JobState.FAILED, JobState.FAILED]
    assert d.policy.queued == 0


def test_an_unreachable_replica_hands_its_queue_on_and_comes_back_when_routed_to() -> None:
    d = _replicas("m@0", "m@1", residency="coexist")
    queued = [d.submit("m@0", "s1")]
    assert d.policy.member_down("m@0") == 1
    assert queued[0].model_id == "m@1" and d.policy.is_down("m@0")
    assert d.policy.member_down("x") == 0  # unknown: nothing
    d.submit("m@0")  # the router saw it healthy again: it gets a try
    assert not d.policy.is_down("m@0")
