"""The scheduler's policy: queue ordering, turns, fairness, capacity and slot ownership.

Pure bookkeeping with no I/O and no event loop, so every rule can be tested with
plain function calls. :mod:`gezel_trio.scheduler.dispatcher` wraps it in Trio: it
calls :meth:`SchedulerPolicy.plan` on every event, performs the I/O each
:class:`Action` asks for (an engine load, a ``GET /slots`` measurement, a job
start) and reports back (:meth:`~SchedulerPolicy.admit`,
:meth:`~SchedulerPolicy.load_done`, :meth:`~SchedulerPolicy.settle`).

The rules, in the order the policy applies them (see the issue-3 seed):

1. RESIDENCY. Jobs are partitioned into *groups* that share one engine turn:
   in ``swap`` mode every model is in one group (one resident model per GPU), in
   ``coexist`` mode each *family* is its own group. A turn switches model only
   from a fully drained group; nothing is refused for "wrong model". A family is
   one model, or the members of a replicated model (lanes with the same
   ``family``): a turn belongs to a family, so the replicas of a model run
   together, and every rule below applies to the family as to one model.
2. EXCLUSIVITY. ``calibrate``, ``sweep`` and ``benchmark`` jobs are turns of
   their own: the group drains (every replica of the family too), the job runs
   alone, nothing is admitted meanwhile.
3. THE OPEN TURN. A turn claims every queued job of its model up to the first
   exclusive job, and keeps absorbing same-model jobs that reach the head of the
   queue, even after its batch drained. A claim is a sequence-number bound, not
   a move: the turn's jobs are those of its model queued below the bound.
4. FAIRNESS. The turn stops absorbing when the group's queue head is another
   model's job or an exclusive job; it retires once its claimed jobs have run;
   the next turn prefers a model other than the one that just ran.
5. CAPACITY. ``min(parallel - running, nameable free slots)``. For an engine
   the host spawned (it is the engine's only client) the free slots are the
   slot table's: no ``/slots`` round trip on the request path. For an external
   engine (it may have other clients) they are the table's free slots that a
   fresh ``/slots`` sample names idle. Zero capacity with none of our jobs
   running asks the Trio layer to poll ``/slots`` (reconciliation).
6. OWNERSHIP. A job's ``session`` is its owner: a caller's named session, or
   the caller's keyless owner that all its keyless requests share (``None``
   only for a blind keyless job). Each model has a
   :class:`~gezel_trio.scheduler.slots.SlotTable`: per slot its content
   (fresh, clean, owned, blind-dirty, unknown), its pin and the engine
   generation. The Trio layer prepares a pinned slot (park, restore or erase)
   from the table before the job runs, recording every transition before the
   I/O that causes it, and a job never runs on a slot whose content is not its
   own owner's or empty, except where its owner's caller may share prefixes
   (``job.caller``): then it may run on another owner's KV of that caller that
   shares a prefix with its request, which the engine cuts back to that prefix.
   *Forgetting* (an exclusive op, ``forget_slots``) makes every slot unknown:
   each is erased before its next use. A new engine generation makes every
   slot fresh and keeps the pins of running jobs.
7. AFFINITY. Within a turn, jobs whose owner holds a slot go first; everything
   else is FIFO. An owner may hold several slots: a job goes to its owner's
   free slot that its request continues (:func:`choose_slot`), and two jobs of
   one owner never wait for each other while a slot is free.
   SHORT WORK FIRST: when the FIFO head has a long prefill ahead of it (more than
   :data:`SHORT_WORK` blocks of its prompt that neither a slot nor a parked copy
   it may start from holds), the earliest of the next :data:`SHORT_LOOKAHEAD`
   claimed jobs with a short one goes first, such as an agent's next turn on its
   parked KV behind another session's cold prompt: it waits the head's prefill
   otherwise, for a few blocks of its own. The head is passed over at most
   ``short_first_passes`` times, each by at most a batch of prefill; then it goes.
8. THE POOL. A family's members share their queued work. A job submitted with
   ``pool`` set (its session holds no KV anywhere, or it has none) may run on
   any member: a member with room takes such jobs from its siblings' claimed
   queues, earliest first. So may a keyless owner's job even where its owner
   holds KV: a caller's keyless requests are many conversations, and they
   must not queue on one member while another has room. A job its own member
   has room for runs there, whichever member's admission comes first in a
   pass: the router sent it there (the least loaded, or away from an overloaded
   member holding its prefix). A member whose load
   fails (or whose ``/slots`` cannot be sampled) is *down*: its queued
   completions move to a live sibling, in their queue order, and are counted
   (``failovers``); with no live sibling they fail (or wait) as a single
   model's would. A job's ``model_id`` is the member
   it was granted on.
9. PINNING. Every admitted job that uses a slot is pinned to a distinct slot id
   from the table. No job is ever admitted unpinned: when no id can be named
   the job waits. A job whose slot the engine chooses (embeddings: llama-server
   ignores ``id_slot`` there) is admitted only when every slot is free, pins
   them all, and leaves them all unknown.

Data structures are chosen so that one admission, and one turn start, cost
O(models + slots), never O(queued jobs): a FIFO deque per model and a per-model,
per-session index (both with lazy deletion and compaction), one deque of
exclusive jobs per group, and a claim bound per turn.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from functools import partial

from gezel_trio.errors import QueueFull, UnknownModel
from gezel_trio.kv.lead import LeadStart
from gezel_trio.kv.prefix import shared_blocks
from gezel_trio.scheduler.admission import (
    Action,
    Admission,
    Admit,
    Load,
    RunExclusive,
    _Group,
    _Turn,
    admission_capacity,
    choose_slot,
)
from gezel_trio.scheduler.jobs import (
    JOB_KINDS,
    RESIDENCIES,
    JobState,
    LaneInfo,
    Residency,
    SlotMeasurement,
)
from gezel_trio.scheduler.pool import fail_over
from gezel_trio.scheduler.queues import Job, _Family, _Model, detach
from gezel_trio.scheduler.slots import Content, SlotTable, SlotTableStats
from gezel_trio.scheduler.stats import ActiveOp, SchedulerStats

__all__ = ["SchedulerPolicy"]

_SWAP_GROUP = "*"

_NOTHING = Admission()

SHORT_WORK = 8
"""Blocks of new prompt (about 64 tokens each: 512, one batch of llama-server's) that a
job may have to compute and still count as short (SHORT WORK FIRST)."""
SHORT_LOOKAHEAD = 8
"""Claimed jobs behind the head that SHORT WORK FIRST looks at (a bound on the pass)."""


def _seq(job: Job | None) -> float:
    return math.inf if job is None else job.seq


def _work(job: Job, table: SlotTable) -> int | None:
    """Blocks of ``job``'s prompt that the engine is expected to compute: its prefix
    less the longest part of it that a slot it may use holds (its owner's, or one its
    caller's sharing lets it start from) or its parked copy (``job.reuse``). None:
    unknown (no blocks, or no slot to send to)."""
    if not job.prefix or not job.needs_slot:
        return None
    reuse = job.reuse
    if job.session is not None:
        for entry in table.slots:
            if entry.content is Content.OWNED and entry.session == job.session:
                reuse = max(reuse, shared_blocks(entry.blocks, job.prefix))
            else:
                reuse = max(reuse, entry.shares_with(job.session, job.caller, job.prefix))
    return len(job.prefix) - reuse


# --------------------------------------------------------------------------- policy


class SchedulerPolicy:
    """All scheduling decisions, with no I/O. See the module docstring for the rules.

    ``affinity`` turns session-first ordering within a turn on or off; a queued job
    that has waited ``affinity_max_wait`` seconds goes first regardless (without it,
    chats that hold slots and come straight back, as agents do, starve a chat that
    holds none); ``erase_on_handoff`` off (a benchmark baseline, never for users)
    skips the erase of another session's known KV before a handoff;
    ``short_first_passes`` bounds SHORT WORK FIRST (0: off).
    """

    def __init__(
        self,
        lanes: Iterable[LaneInfo] = (),
        *,
        residency: Residency = "swap",
        max_queue: int = 256,
        affinity: bool = True,
        erase_on_handoff: bool = True,
        affinity_max_wait: float = 1.0,
        short_first_passes: int = 0,
    ) -> None:
        if residency not in RESIDENCIES:
            raise ValueError(f"residency must be 'swap' or 'coexist', not {residency!r}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, not {max_queue}")
        self.residency: Residency = residency
        self.max_queue = max_queue
        self.affinity = affinity
        self.affinity_max_wait = affinity_max_wait
        self.short_first_passes = short_first_passes
        self.erase_on_handoff = erase_on_handoff
        self._models: dict[str, _Model] = {}
        self._families: dict[str, _Family] = {}
        self._groups: dict[str, _Group] = {}
        self._seq = 0
        self._queued = 0
        self._last_turn: str | None = None
        self._run_ewma_s: float | None = None
        # counters
        self.admissions = 0
        self.switches = 0
        self.erases_ok = 0
        self.erases_failed = 0
        self.erases_skipped = 0  # handoffs to the same session: KV kept
        self.erases_after_keyless = 0  # off the critical path, after a keyless job
        self.erases_sent_blind = 0  # handoffs sent with cache_prompt off instead
        self.blind_unanswered = 0  # of those, the engine answered no token: slot unknown
        self.parks_saved = 0
        self.parks_skipped = 0  # the parked copy was still current
        self.parks_skipped_tail = 0  # a short tail beyond a shared prefix, not saved
        self.parks_restored = 0
        self.parks_failed = 0
        self.parks_idle = 0  # saved in the background once the slot went idle
        self.handoffs = 0  # owner jobs placed on another owner's slot
        self.handoff_calls = 0  # upstream calls those made: park, restore, erase, request
        self.shared_prefixes = 0  # of those, sent onto their caller's other owner's prefix
        self.lent_prefixes = 0  # restores of another owner's parked copy of the job's caller
        self.leads_saved = 0  # slots started from a lead prefilled alone, then saved
        self.leads_restored = 0  # slots started from a caller's lead snapshot
        self.leads_failed = 0  # starts from a lead that failed (the job went blind)
        self.reconciliations = 0
        self.held_out = 0  # slots found busy with work the host did not send
        self.failovers = 0  # queued jobs moved off a member that went down
        self.pooled = 0  # pool jobs a member took from a sibling's queue
        self.short_first = 0  # jobs with a short prefill sent before a long head
        self.slot_polls = 0
        self.slot_measurements = 0
        self.slot_measure_failures = 0
        self.dispatch_passes = 0
        self.dispatch_seconds = 0.0
        for lane in lanes:
            self.add_lane(lane)

    def __repr__(self) -> str:
        turns = {k: (g.turn.family.key if g.turn else None) for k, g in self._groups.items()}
        return (
            f"<SchedulerPolicy {self.residency} queued={self._queued}/{self.max_queue} "
            f"turns={turns}>"
        )

    # ------------------------------------------------------------------ lanes

    def _group_key(self, family: _Family) -> str:
        return _SWAP_GROUP if self.residency == "swap" else family.key

    def _group_for(self, key: str) -> _Group:
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(key)
            group.last_turn = self._last_turn if key == _SWAP_GROUP else None
        return group

    @property
    def model_ids(self) -> tuple[str, ...]:
        return tuple(self._models)

    def add_lane(self, lane: LaneInfo) -> None:
        """Register a model. Raises ValueError if its id is already registered."""
        model_id = lane.model_id
        if model_id in self._models:
            raise ValueError(f"model {model_id!r} already has a lane")
        family_key = lane.family or model_id
        family = self._families.get(family_key)
        if family is None:
            family = self._families[family_key] = _Family(family_key)
        model = _Model(model_id, lane, family)
        family.members.append(model)
        model.group_key = key = self._group_key(family)
        self._models[model_id] = model
        self._group_for(key).models.append(model)

    def remove_lane(self, model_id: str) -> list[Job]:
        """Unregister a model. Its queued jobs are returned, marked FAILED, for the
        caller to fail; its running jobs settle normally but no longer hold a turn
        (in ``swap`` mode another model may be switched in while they finish).
        Raises UnknownModel for an id that has no lane."""
        model = self._models.pop(model_id, None)
        if model is None:
            raise UnknownModel(f"model {model_id!r} is not served by this scheduler")
        group = self._groups[model.group_key]
        failed = [*model.queue, *(j for j in group.exclusive if j.model_state is model)]
        turn = group.turn
        family = model.family
        if turn is not None and turn.exclusive is not None and turn.exclusive.model_state is model:
            if turn.exclusive.state is JobState.QUEUED:
                failed.append(turn.exclusive)
            group.turn = None
        elif turn is not None and turn.holds(model) and len(family.members) == 1:
            group.turn = None
        for job in failed:
            self._unqueue(job, JobState.FAILED)
        family.members.remove(model)
        if not family.members:
            del self._families[family.key]
        group.models.remove(model)
        if not group.models and not group.active:
            del self._groups[group.key]
        return failed

    def set_residency(self, residency: Residency) -> None:
        """Regroup live. Every turn restarts (its claims lapse, FIFO order is kept,
        and residency is re-ensured); running jobs and exclusive ops keep running
        and count against their new group."""
        if residency not in RESIDENCIES:
            raise ValueError(f"residency must be 'swap' or 'coexist', not {residency!r}")
        if residency == self.residency:
            return
        exclusives: list[Job] = []
        active: list[Job] = []
        for group in self._groups.values():
            active.extend(group.active)
            exclusives.extend(group.exclusive)
            turn = group.turn
            if turn is not None and turn.exclusive and turn.exclusive.state is JobState.QUEUED:
                exclusives.append(turn.exclusive)
        exclusives.sort(key=lambda j: j.seq)
        self.residency = residency
        self._groups = {}
        for model in self._models.values():
            model.group_key = self._group_key(model.family)
            self._group_for(model.group_key).models.append(model)
        for job in exclusives:
            assert job.model_state is not None
            self._group_for(job.model_state.group_key).exclusive.append(job)
        for job in active:
            assert job.model_state is not None
            self._group_for(job.model_state.group_key).active.append(job)
        if residency == "coexist" and self._last_turn in self._groups:
            self._groups[self._last_turn].last_turn = self._last_turn

    # ------------------------------------------------------------------ queue

    def others_waiting(self, model_id: str, session: str | None) -> bool:
        """Whether a job of an owner other than ``session`` waits for ``model_id``."""
        model = self._models.get(model_id)
        return model is not None and any(job.session != session for job in model.queue)

    @property
    def queued(self) -> int:
        return self._queued

    def enqueue(self, job: Job, *, now: float) -> Job:
        """Queue ``job`` (assigns its ``seq``). Raises UnknownModel or QueueFull."""
        model = self._models.get(job.model_id)
        if model is None:
            raise UnknownModel(f"model {job.model_id!r} is not served by this scheduler")
        if job.kind not in JOB_KINDS:
            raise ValueError(f"unknown job kind {job.kind!r}")
        if self._queued >= self.max_queue:
            raise QueueFull(
                f"the scheduler queue is full ({self._queued} of {self.max_queue} waiting)",
                retry_after=self.retry_after(),
            )
        job.seq = self._seq
        self._seq += 1
        job.submitted_at = now
        job.state = JobState.QUEUED
        job.model_state = model
        model.down = False  # routed here as healthy: give it a try
        if job.exclusive:
            self._groups[model.group_key].exclusive.append(job)
        else:
            model.append(job)
        model.waiting += 1
        self._queued += 1
        return job

    def cancel(self, job: Job) -> bool:
        """Take a queued job out of the queue. False if it is no longer queued."""
        if job.state is not JobState.QUEUED:
            return False
        self._unqueue(job, JobState.CANCELLED)
        return True

    def _unqueue(self, job: Job, state: JobState) -> None:
        detach(job)
        job.state = state
        model = job.model_state
        if model is not None:
            model.waiting -= 1
        self._queued -= 1

    def fail_all(self) -> list[Job]:
        """Every queued job, marked FAILED (shutdown): the caller fails them."""
        failed: list[Job] = []
        for group in self._groups.values():
            failed.extend(group.exclusive)
            turn = group.turn
            if turn is not None and turn.exclusive and turn.exclusive.state is JobState.QUEUED:
                failed.append(turn.exclusive)
        for model in self._models.values():
            failed.extend(model.queue)
        for job in failed:
            self._unqueue(job, JobState.FAILED)
        return failed

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue's expected drain time
        (mean job duration x queued / total slots), clamped to 1..60."""
        ewma = self._run_ewma_s if self._run_ewma_s is not None else 1.0
        slots = sum(max(1, m.lane.parallel) for m in self._models.values()) or 1
        if self.residency == "swap":
            slots = max((max(1, m.lane.parallel) for m in self._models.values()), default=1)
        return int(min(60, max(1, math.ceil(ewma * self._queued / slots))))

    # ------------------------------------------------------------------ turns

    def _head(self, group: _Group, *, skip: _Family | None = None) -> Job | None:
        """The group's earliest queued job (skipping one family's queues)."""
        best = group.exclusive.head()
        for model in group.models:
            if model.family is skip:
                continue
            job = model.queue.head()
            if job is not None and (best is None or job.seq < best.seq):
                best = job
        return best

    def _pick(self, group: _Group) -> _Family | None:
        """The next turn's family: the earliest-queued family other than the one that
        just ran, among jobs ahead of the first exclusive op; else that same family."""
        barrier = _seq(group.exclusive.head())
        other: _Family | None = None
        other_seq = math.inf
        same: _Family | None = None
        for model in group.models:
            job = model.queue.head()
            if job is None or job.seq > barrier:
                continue
            if model.family.key == group.last_turn:
                same = model.family
            elif job.seq < other_seq:
                other, other_seq = model.family, job.seq
        return other if other is not None else same

    def _start_turn(self, group: _Group) -> _Turn | None:
        head = self._head(group)
        if head is None:
            return None
        if head.exclusive:
            model = head.model_state
            assert model is not None
            if group.running() > 0:
                return None  # exclusive ops start from a drained engine (every replica)
            group.exclusive.discard(head)
            family = model.family
            turn = _Turn(family, exclusive=head)
        else:
            picked = self._pick(group)
            if picked is None:  # pragma: no cover - head is a completion, so some model has one
                return None
            family = picked
            if group.running(other_than=family) > 0:
                return None  # switch only from a drained engine
            # every queued job of its family, up to the first exclusive op
            turn = _Turn(family, bound=min(_seq(group.exclusive.head()), self._seq))
        previous = group.last_turn
        if self.residency == "swap" and previous is not None and previous != family.key:
            # The outgoing engine may be stopped; if it is, its next generation is
            # fresh, and if it is not, nobody else touched its slots: its table holds.
            self.switches += 1
        group.turn = turn
        group.last_turn = self._last_turn = family.key
        return turn

    def _absorb(self, group: _Group, turn: _Turn) -> None:
        """Claim same-family jobs while they are at the head of the group's queue:
        every job of the family queued before the earliest job of anyone else."""
        if not turn.family.has_queue():
            return
        limit = min(_seq(self._head(group, skip=turn.family)), self._seq)
        if limit > turn.bound:
            turn.bound = limit

    def _has_queued(self, group: _Group) -> bool:
        return bool(group.exclusive) or any(m.queue for m in group.models)

    def plan(self) -> list[Action]:
        """Re-derive what to do now, for every group: loads to start, exclusive jobs
        to start, models whose slots to measure for admission. Marks planned loads
        (``loading``) and started exclusive jobs (RUNNING) so they are not repeated."""
        actions: list[Action] = []
        for group in list(self._groups.values()):
            self._plan_group(group, actions)
        return actions

    def _plan_group(self, group: _Group, actions: list[Action]) -> None:
        if group.active:
            return  # an exclusive op owns the engine
        while True:
            turn = group.turn
            if turn is None:
                turn = self._start_turn(group)
                if turn is None:
                    return
            job = turn.exclusive
            if job is not None:
                if job.state is not JobState.QUEUED:  # cancelled while waiting its turn
                    group.turn = None
                    continue
                model = job.model_state
                assert model is not None
                if model.model_id not in turn.loaded:  # (the group drained when it started)
                    self._want_load(model, actions)
                    return
                self._unqueue_to_running(job)
                group.active.append(job)
                actions.append(RunExclusive(job))
                return
            self._absorb(group, turn)
            family = turn.family
            if turn.head() is None:
                if family.running == 0:
                    if self._has_queued(group):
                        group.turn = None  # drained, and someone else is at the head
                        continue
                    turn.loaded.clear()  # idle open turn: re-ensure residency on next use
                return
            if len(family.members) == 1:
                model = family.members[0]
                if model.model_id in turn.loaded:
                    if model.running < max(1, model.lane.parallel):
                        actions.append(Admit(model.model_id))
                else:
                    self._want_load(model, actions)
                return
            self._plan_pool(turn, actions)
            return

    def _plan_pool(self, turn: _Turn, actions: list[Action]) -> None:
        """A replicated family's turn: load members with jobs of their own, admit on
        every loaded member with room that has jobs or can take pool jobs, and
        start one more member while pool jobs outnumber the loaded members' room."""
        family = turn.family
        pool = len(turn.pool_jobs())
        idle: _Model | None = None  # a member that could be started for the pool
        for model in family.members:
            loaded = model.model_id in turn.loaded
            room = max(1, model.lane.parallel) - model.running
            if turn.head_of(model) is None:
                if not loaded:
                    if not model.down and not model.loading and idle is None:
                        idle = model
                    continue
                if model.down or pool == 0:
                    continue
            elif not loaded:
                self._want_load(model, actions)
                continue
            if room > 0:
                actions.append(Admit(model.model_id))
        if idle is not None and pool:
            spare = sum(
                max(1, m.lane.parallel) - m.running
                for m in family.members
                if not m.down and (m.loading or m.model_id in turn.loaded)
            )
            if pool > spare:
                self._want_load(idle, actions)

    def _want_load(self, model: _Model, actions: list[Action]) -> None:
        if not model.loading:
            model.loading = True
            actions.append(Load(model.model_id))

    def _unqueue_to_running(self, job: Job) -> None:
        detach(job)
        job.state = JobState.RUNNING
        model = job.model_state
        assert model is not None
        model.waiting -= 1
        self._queued -= 1

    def load_done(self, model_id: str) -> None:
        """``ensure_resident`` returned for ``model_id``: its turn may admit."""
        model = self._models.get(model_id)
        if model is None:
            return
        model.loading = False
        model.down = False
        self.sync_table(model)
        group = self._groups.get(model.group_key)
        if group is not None and group.turn is not None and group.turn.holds(model):
            group.turn.loaded.add(model_id)

    def is_turn(self, model_id: str) -> bool:
        """True while ``model_id``'s family holds its group's turn."""
        model = self._models.get(model_id)
        if model is None:
            return False
        group = self._groups.get(model.group_key)
        return group is not None and group.turn is not None and group.turn.holds(model)

    def load_aborted(self, model_id: str) -> None:
        """The load was cancelled (shutdown): no verdict either way."""
        model = self._models.get(model_id)
        if model is not None:
            model.loading = False

    def load_failed(self, model_id: str) -> list[Job]:
        """``ensure_resident`` raised: the model is down. A replica's queued
        completions move to a live sibling (see THE POOL); otherwise the turn's
        claimed jobs are returned marked FAILED for the caller to fail, and the turn
        retires so the next request for the model retries. An exclusive job of the
        model fails either way."""
        model = self._models.get(model_id)
        if model is None:
            return []
        model.loading = False
        model.down = True
        self.fail_over(model_id)
        group = self._groups.get(model.group_key)
        if group is None or group.turn is None or not group.turn.holds(model):
            return []
        turn = group.turn
        failed: list[Job] = []
        if turn.exclusive is None:
            failed = turn.claimed(model)
        elif turn.exclusive.model_state is model and turn.exclusive.state is JobState.QUEUED:
            failed.append(turn.exclusive)
        for job in failed:
            self._unqueue(job, JobState.FAILED)
        turn.loaded.discard(model_id)
        if turn.family.running == 0 and not (turn.exclusive is None and turn.head()):
            group.turn = None
        return failed

    def member_down(self, model_id: str) -> int:
        """``model_id`` failed outside a load (its ``/slots`` could not be sampled, or
        its engine could not be restarted for an admitted job): a replica is down, and
        its queued completions move to a live sibling (returns how many; a model of its
        own keeps them)."""
        model = self._models.get(model_id)
        if model is None or len(model.family.members) == 1:
            return 0
        model.down = True
        return self.fail_over(model_id)

    def member_reachable(self, model_id: str) -> None:
        """``model_id`` answered again (a sample, or a job routed to it)."""
        model = self._models.get(model_id)
        if model is not None:
            model.down = False

    def is_down(self, model_id: str) -> bool:
        model = self._models.get(model_id)
        return model is not None and model.down

    def fail_over(self, model_id: str) -> int:
        """Move ``model_id``'s queued completions to its live siblings (see
        :func:`.pool.fail_over`); returns how many moved."""
        model = self._models.get(model_id)
        if model is None:
            return 0
        moved = fail_over(model)
        self.failovers += moved
        return moved

    # ------------------------------------------------------------------ admission

    def sync_table(self, model: _Model) -> list[Job]:
        """Adopt the lane's engine generation and slot count in ``model``'s table.

        Returns the running jobs whose pins the new engine no longer has (it has
        fewer slots): they must not send anything more.
        """
        lost = model.table.sync(model.lane.generation, max(1, model.lane.slot_count))
        return [job for job in lost if isinstance(job, Job)]

    def table(self, model_id: str) -> SlotTable:
        """``model_id``'s slot table (synced to its lane's current generation); raises
        ``KeyError`` for a model that is not served."""
        table = self.served_table(model_id)
        if table is None:
            raise KeyError(model_id)
        return table

    def served_table(self, model_id: str) -> SlotTable | None:
        """``model_id``'s slot table (synced), or None once the model is removed: for
        work that outlived a job of it (a background save)."""
        model = self._models.get(model_id)
        if model is None:
            return None
        self.sync_table(model)
        return model.table

    def still_serves(self, model_id: str, table: SlotTable, generation: int | None) -> bool:
        """Whether ``table`` is still ``model_id``'s (the model neither removed nor replaced
        by a reload) and its engine still the ``generation`` it was read at: for work
        that read the table before an await."""
        return self.served_table(model_id) is table and table.generation == generation

    def table_of(self, job: Job) -> SlotTable:
        """The slot table of ``job``'s model (even if the model was removed since)."""
        model = job.model_state
        assert model is not None
        self.sync_table(model)
        return model.table

    def admit(self, model_id: str, measured: SlotMeasurement | None, *, now: float) -> Admission:
        """Admit jobs of ``model_id``'s turn onto free slots of its table: its own
        claimed jobs first, then pool jobs of its siblings (see THE POOL).

        ``measured`` is a fresh ``/slots`` sample for an external engine (only the
        slots it names idle may be pinned; ``None`` or no ids: nothing is admitted);
        it is ignored for an engine the host spawned. Re-derives everything (the
        turn may have changed meanwhile). Each admitted job is RUNNING and pinned
        (``slot_id``), except exclusive ops and calls that use no slot.
        """
        model = self._models.get(model_id)
        if model is None:
            return _NOTHING
        group = self._groups[model.group_key]
        turn = group.turn
        if group.active or turn is None or not turn.holds(model) or turn.exclusive is not None:
            return _NOTHING
        if model_id not in turn.loaded:
            return _NOTHING
        self._absorb(group, turn)
        if turn.head() is None:
            return _NOTHING
        lane = model.lane
        self.sync_table(model)
        table = model.table
        free = table.free()
        if lane.sole_client:
            measured = None  # the table knows; a sample has nothing to add
        else:
            # Another client may be using any slot: pin only what the sample names idle.
            named = () if measured is None or measured.ids is None else measured.ids
            free = [slot for slot in free if slot in named]
        room = _room(model, free, measured)
        if room <= 0:
            return Admission(poll=model.running == 0 and turn.head_of(model) is not None)
        holders = table.holders() if self.affinity else {}

        def wanted(session: str) -> bool:
            return turn.pending_for(model, session) is not None

        admitted: list[Job] = []
        while room > 0:
            job = self._next(turn, model, holders, now, table)
            if job is None:
                break
            if job.any_slot:
                # The engine picks its slot: it may run only when it can have them all.
                if model.running > 0 or not table.all_free() or len(free) < len(table):
                    break
                self._start(model, job, None, now)
                for each in free:
                    table.pin(each, job)
                admitted.append(job)
                break
            self._start(model, job, self._pin(job, free, table, wanted), now)
            admitted.append(job)
            room -= 1
        if room > 0 and len(model.family.members) > 1:
            for job in turn.pool_jobs(skip=model, room=partial(self._own_room, turn)):
                if room == 0:
                    break
                if job.any_slot or job.state is not JobState.QUEUED:
                    continue
                self._unqueue_to_running(job)
                job.model_id = model.model_id
                job.model_state = model
                self.pooled += 1
                self._start(model, job, self._pin(job, free, table, wanted), now, queued=False)
                admitted.append(job)
                room -= 1
        return Admission(tuple(admitted))

    @staticmethod
    def _own_room(turn: _Turn, model: _Model) -> int:
        """How many of its claimed jobs ``model`` admits itself when its admission
        comes in this pass: its free slots within its capacity, for a spawned engine
        of the turn that has loaded (an external engine's room is a sample's: 0)."""
        if not model.lane.sole_client or model.model_id not in turn.loaded:
            return 0
        return _room(model, model.table.free(), None)

    def _pin(
        self, job: Job, free: list[int], table: SlotTable, wanted: Callable[[str], bool]
    ) -> int | None:
        """The slot ``job`` is pinned to, taken out of ``free`` (None: it uses none)."""
        if not job.needs_slot:
            return None
        pin = choose_slot(
            free,
            session=job.session,
            table=table,
            prefix=job.prefix,
            wanted=wanted,
            caller=None if job.parked else job.caller,
        )
        assert pin is not None  # the caller checked there is room
        free.remove(pin)
        if job.session is not None and table.owner(pin) == job.session:
            self.erases_skipped += 1
        return pin

    def _next(
        self,
        turn: _Turn,
        model: _Model,
        holders: Mapping[str, list[int]],
        now: float,
        table: SlotTable,
    ) -> Job | None:
        """Affinity: ``model``'s earliest job whose session holds a slot, else its FIFO
        head, before which a job with a short prefill may go (SHORT WORK FIRST). The
        FIFO head goes first anyway once it has waited ``affinity_max_wait`` (past
        affinity) and once it has been passed over ``short_first_passes`` times.
        """
        head = turn.head_of(model)
        if head is None:
            return None
        if self.affinity and holders and now - head.submitted_at < self.affinity_max_wait:
            best: Job | None = None
            for session in holders:
                job = turn.pending_for(model, session)
                if job is not None and (best is None or job.seq < best.seq):
                    best = job
            if best is not None:
                return best
        short = self._short_before(turn, model, head, table)
        if short is None:
            return head
        head.passed += 1
        self.short_first += 1
        return short

    def _short_before(self, turn: _Turn, model: _Model, head: Job, table: SlotTable) -> Job | None:
        """The earliest of the :data:`SHORT_LOOKAHEAD` claimed jobs behind ``head`` whose
        prefill is short, when ``head``'s is long and it may still be passed over."""
        if head.passed >= self.short_first_passes:
            return None
        work = _work(head, table)
        if work is None or work <= SHORT_WORK:
            return None
        seen = 0
        for job in model.queue.prefix():
            if job is head:
                continue
            if job.seq >= turn.bound or seen >= SHORT_LOOKAHEAD:
                return None
            seen += 1
            short = _work(job, table)
            if short is not None and short <= SHORT_WORK:
                return job
        return None

    def _start(
        self, model: _Model, job: Job, slot: int | None, now: float, *, queued: bool = True
    ) -> None:
        if queued:
            self._unqueue_to_running(job)
        job.slot_id = slot
        job.generation = model.table.generation
        job.admitted_at = now
        model.running += 1
        self.admissions += 1
        if slot is not None:
            model.table.pin(slot, job)

    def settle(self, job: Job, *, now: float) -> None:
        """``job`` left its ``async with`` block (finished, failed or cancelled).

        Records what its slot now holds: a job whose request was sent leaves its
        session's KV (keyless: dirty), and its pin is released. An exclusive op or
        an any-slot job leaves every slot unknown.
        """
        if job.state is not JobState.RUNNING:
            return
        job.state = JobState.DONE
        model = job.model_state
        assert model is not None
        if job.admitted_at is not None:
            took = max(0.0, now - job.admitted_at)
            ewma = self._run_ewma_s
            self._run_ewma_s = took if ewma is None else 0.8 * ewma + 0.2 * took
        table = model.table
        if job.exclusive:
            group = self._groups.get(model.group_key)
            if group is not None:
                if job in group.active:
                    group.active.remove(job)
                if group.turn is not None and group.turn.exclusive is job:
                    group.turn = None
            table.forget()  # the op used the engine's slots as it pleased
            return
        model.running -= 1
        if job.any_slot:
            for entry in table.slots:
                if entry.pin is job:
                    table.unpin(entry.id, job)
            if job.ran:
                table.forget()
            return
        slot = job.slot_id
        if slot is None or table.pinned_to(slot) is not job:
            return  # no slot, or the engine restarted with fewer slots
        if job.ran and (not job.blind or job.answered):
            table.completed(
                slot, job, job.session, keyless=job.keyless, blocks=job.prefix, caller=job.caller
            )
        elif job.ran:
            # a blind handoff the engine answered no token: it may not have cleared the
            # slot, which stays unknown (erased before anyone else's request)
            self.blind_unanswered += 1
        table.unpin(slot, job)

    def forget_slots(self, model_id: str) -> None:
        """Make every slot of ``model_id`` unknown (see :meth:`SlotTable.forget`)."""
        model = self._models.get(model_id)
        if model is not None:
            model.table.forget()

    # ------------------------------------------------------------------ counters, stats

    def note_erase(self, *, ok: bool, after_keyless: bool = False) -> None:
        """An erase ended: acknowledged (``ok``) or not; ``after_keyless``: one off the
        critical path, of the slot a keyless job left."""
        if ok:
            self.erases_ok += 1
            if after_keyless:
                self.erases_after_keyless += 1
        else:
            self.erases_failed += 1

    def note_sent_blind(self) -> None:
        """A slot that would have been erased for its new owner's job is not: the job
        is sent with ``cache_prompt`` off (see ``SchedulerSettings.blind_handoff``)."""
        self.erases_sent_blind += 1

    def note_park(self, *, ok: bool, idle: bool = False) -> None:
        """A save of a slot's KV ended: tokens saved (``ok``) or failed; ``idle``: a
        background save of an idle slot. A save of an empty slot is not counted."""
        if not ok:
            self.parks_failed += 1
        elif idle:
            self.parks_idle += 1
        else:
            self.parks_saved += 1

    def note_park_skipped(self, *, tail: bool = False) -> None:
        """A handoff found the outgoing owner's parked copy current (``tail``: its short
        tail beyond the prefix its slot keeps not worth saving): no save."""
        if tail:
            self.parks_skipped_tail += 1
        else:
            self.parks_skipped += 1

    def note_lead(self, start: LeadStart) -> None:
        """A slot was started from its job's lead (see :mod:`gezel_trio.kv.lead`)."""
        if not start.tokens:
            self.leads_failed += 1
        elif start.restored:
            self.leads_restored += 1
        elif start.saved:
            self.leads_saved += 1

    def note_restore(self, *, ok: bool, lent: bool = False) -> None:
        """A restore of a parked copy into a slot took (``ok``) or did not; ``lent``: the
        copy of another owner of the job's caller, that the job starts from."""
        if ok:
            self.parks_restored += 1
            self.lent_prefixes += lent
        else:
            self.parks_failed += 1

    def note_handoff(self, *, calls: int, shared: bool = False) -> None:
        """An owner's job was placed on another owner's slot, with ``calls`` upstream
        calls (park, restore, erase, and the request itself); ``shared``: sent onto
        that owner's KV, of the same caller, neither restored nor erased (the engine
        kept the prefix they share)."""
        self.handoffs += 1
        self.handoff_calls += calls
        self.shared_prefixes += shared

    def note_measurement(self, *, ok: bool) -> None:
        self.slot_measurements += 1
        if not ok:
            self.slot_measure_failures += 1

    def note_poll(self) -> None:
        self.slot_polls += 1

    def note_pass(self, seconds: float) -> None:
        self.dispatch_passes += 1
        self.dispatch_seconds += seconds

    def running_count(self, model_id: str) -> int:
        model = self._models.get(model_id)
        return 0 if model is None else model.running

    def note_reconciliation(self, held_out: int) -> None:
        self.reconciliations += 1
        self.held_out += held_out

    def snapshot(self) -> SchedulerStats:
        waiting: dict[str, int] = {}
        waiting_ids: dict[str, int] = {}
        running: dict[str, int] = {}
        owners: dict[str, dict[int, str | None]] = {}
        slots: dict[str, SlotTableStats] = {}
        loading: list[str] = []
        for model in self._models.values():
            if model.waiting:
                waiting_ids[model.model_id] = model.waiting
                waiting[model.display_name] = waiting.get(model.display_name, 0) + model.waiting
            if model.running:
                running[model.model_id] = model.running
            if model.loading:
                loading.append(model.model_id)
            table = model.table
            if table.generation is not None and table.generation == model.lane.generation:
                stats = table.statistics()
                if stats.owners:
                    owners[model.model_id] = stats.owners
                slots[model.model_id] = stats
        active = tuple(
            ActiveOp(job.model_id, job.kind) for g in self._groups.values() for job in g.active
        )
        return SchedulerStats(
            residency=self.residency,
            queued=self._queued,
            max_queue=self.max_queue,
            waiting=waiting,
            waiting_model_ids=waiting_ids,
            running=running,
            last_turn=self._last_turn,
            turns={k: (g.turn.family.key if g.turn else None) for k, g in self._groups.items()},
            active=active[0] if active else None,
            active_ops=active,
            loading=tuple(loading),
            slot_owners=owners,
            slots=slots,
            erases={
                "ok": self.erases_ok,
                "failed": self.erases_failed,
                "skipped_same_session": self.erases_skipped,
                "after_keyless": self.erases_after_keyless,
                "sent_blind": self.erases_sent_blind,
                "blind_unanswered": self.blind_unanswered,
            },
            parking={
                "saved": self.parks_saved,
                "save_skipped_current": self.parks_skipped,
                "save_skipped_tail": self.parks_skipped_tail,
                "restored": self.parks_restored,
                "failed": self.parks_failed,
                "saved_idle": self.parks_idle,
                "handoffs": self.handoffs,
                "handoff_calls": self.handoff_calls,
                "shared_within_caller": self.shared_prefixes,
                "lent_within_caller": self.lent_prefixes,
                "leads_saved": self.leads_saved,
                "leads_restored": self.leads_restored,
                "leads_failed": self.leads_failed,
            },
            pool={"failovers": self.failovers, "pooled": self.pooled},
            admissions=self.admissions,
            short_first=self.short_first,
            reconciliations=self.reconciliations,
            held_out=self.held_out,
            switches=self.switches,
            slot_polls=self.slot_polls,
            slot_measurements=self.slot_measurements,
            slot_measure_failures=self.slot_measure_failures,
            dispatch_passes=self.dispatch_passes,
            dispatch_seconds=self.dispatch_seconds,
        )


def _room(model: _Model, free: list[int], measured: SlotMeasurement | None) -> int:
    """How many more jobs ``model`` may admit onto ``free`` slots: its capacity
    (:func:`admission_capacity`, with an external engine's sample) within them."""
    return min(admission_capacity(max(1, model.lane.parallel), model.running, measured), len(free))
