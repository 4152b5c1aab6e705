"""Turns and admission: what the policy plans and admits, how much room an engine
has, which slot a job is pinned to, and a group's turn.

Plain bookkeeping with no I/O; :class:`~gezel_trio.scheduler.policy.SchedulerPolicy`
applies it (see its module docstring for the rules).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gezel_trio.kv.prefix import Prefix, is_prefix, shared_blocks
from gezel_trio.scheduler.jobs import SlotMeasurement
from gezel_trio.scheduler.pool import pool_jobs
from gezel_trio.scheduler.queues import Job, _Family, _JobDeque, _Model
from gezel_trio.scheduler.slots import Content, SlotTable

__all__ = [
    "Action",
    "Admission",
    "Admit",
    "Load",
    "RunExclusive",
    "admission_capacity",
    "choose_slot",
]


@dataclass(frozen=True, slots=True)
class Load:
    """Make ``model_id`` resident (``ensure_resident``), then report back."""

    model_id: str


@dataclass(frozen=True, slots=True)
class Admit:
    """Measure ``model_id``'s slots, then call :meth:`SchedulerPolicy.admit`."""

    model_id: str


@dataclass(frozen=True, slots=True)
class RunExclusive:
    """Start this exclusive job now: the group is drained and its model resident."""

    job: Job


Action = Load | Admit | RunExclusive


@dataclass(frozen=True, slots=True)
class Admission:
    """The result of one :meth:`SchedulerPolicy.admit`: jobs to start, and whether
    the Trio layer must poll ``/slots`` (capacity zero, none of our jobs running)."""

    jobs: tuple[Job, ...] = ()
    poll: bool = False


def admission_capacity(parallel: int, running: int, measured: SlotMeasurement | None) -> int:
    """How many more jobs may be admitted: ``min(parallel - running, measured.idle)``.

    The two bounds are combined, never both subtracted: the engine's idle count
    already excludes our running jobs that reached it. ``None`` (unknown) trusts
    the profile's ``parallel``.
    """
    room = parallel - running
    if measured is not None and measured.idle < room:
        room = measured.idle
    return max(room, 0)


def choose_slot(
    free: list[int],
    *,
    session: str | None,
    table: SlotTable,
    prefix: Prefix = (),
    wanted: Callable[[str], bool] = lambda _session: False,
    caller: str | None = None,
) -> int | None:
    """Pick the slot a job of ``session`` (its owner; None: blind) is pinned to, from
    ``free`` (not modified). ``prefix``: the request's blocks (:mod:`.prefix`).

    An owner may hold several slots. Among its free ones: the slot sharing the most
    blocks with the request among those whose recorded blocks it continues (they are
    a prefix of it) or shares more than half of (the same conversation told again
    otherwise: the request keeps more of the slot than it drops), else the most
    recently used one whose blocks or the request's are unknown. When every one of
    them holds another of the owner's conversations (sharing half of its blocks or
    less), the slot of another owner of its caller that shares more of the request
    than any of them (below) goes first (opencode's second session asks for a title,
    then its task: the task starts from the first session's task, not from the
    title's slot), then a fresh or clean slot, so that the other conversation stays,
    then the owner's slot sharing the most blocks (least recently used first); its
    KV is parked first and the owner's parked copy sharing the most blocks restored
    when that shares more (:meth:`SlotTable.preparation`). Otherwise, for a job that may share its
    ``caller``'s prefixes (:meth:`SlotTable.shares_with`), the slot of another owner
    of that caller sharing the most blocks with the request (more than message
    headers), whose owner has no job waiting in this turn, one not being saved
    first, least recently used first: the engine keeps that prefix. Otherwise the
    cheapest handoff
    (:meth:`SlotTable.handoff_cost`: a blind job takes a blind job's slot first,
    an owner's job a clean slot, and displacing another owner's KV comes last),
    then one not being saved in the background (a job there waits for the save),
    then one whose owner has no job waiting in this turn (``wanted`` says which
    owners do), least recently used first, then the lowest id. An owner's own
    slot that its request continues is taken even while it is being saved. ``None``
    when ``free`` is empty.
    """
    if not free:
        return None

    def cost(slot: int) -> tuple[int, bool, bool, int, int]:
        owner = table.owner(slot)
        return (
            table.handoff_cost(slot, session),
            table.saving(slot) is not None,
            owner is not None and wanted(owner),
            table.last_used(slot),
            slot,
        )

    def shared() -> tuple[int, int] | None:
        """The slot of another owner of ``caller`` sharing the most blocks, and how many."""
        if caller is None or not prefix:
            return None

        def share(slot: int) -> int:
            owner = table.owner(slot)
            if owner is None or wanted(owner):
                return 0
            return table.shares_with(slot, session, caller, prefix)

        shares = {slot: n for slot in free if (n := share(slot))}
        if not shares:
            return None
        best = min(shares, key=lambda slot: (-shares[slot], *cost(slot)[1:]))
        return best, shares[best]

    own = [slot for slot in free if session is not None and table.owner(slot) == session]
    if own:

        def fit(slot: int) -> tuple[int, int]:
            blocks = table.blocks(slot)
            if is_prefix(blocks, prefix):
                return len(blocks), table.last_used(slot)
            if not blocks or not prefix:
                return 0, table.last_used(slot)
            shared = shared_blocks(blocks, prefix)
            # The same conversation told again otherwise (Claude Code's --continue
            # rebuilds its history): it keeps more of the slot than it drops.
            return (shared if 2 * shared > len(blocks) else -1), table.last_used(slot)

        best = max(own, key=fit)
        if fit(best)[0] >= 0:
            return best
        closest = max(
            own, key=lambda s: (shared_blocks(table.blocks(s), prefix), -table.last_used(s))
        )
        other = shared()
        if other is not None and other[1] > shared_blocks(table.blocks(closest), prefix):
            return other[0]
        clean = [slot for slot in free if table.content(slot) in (Content.FRESH, Content.CLEAN)]
        if clean:
            return min(clean, key=cost)
        return closest
    other = shared()
    if other is not None:
        return other[0]
    return min(free, key=cost)


class _Turn:
    """One family's turn in a group: its members' jobs queued below ``bound``, or one
    exclusive job (of one member)."""

    __slots__ = ("bound", "exclusive", "family", "loaded")

    def __init__(self, family: _Family, *, bound: float = 0, exclusive: Job | None = None) -> None:
        self.family = family
        self.exclusive = exclusive
        self.bound = bound  # jobs of the family with seq < bound are claimed
        self.loaded: set[str] = set()
        """Members whose ensure_resident returned since the turn last became busy."""

    def __repr__(self) -> str:
        what = f"exclusive={self.exclusive.kind}" if self.exclusive else f"bound={self.bound}"
        return f"<_Turn {self.family.key} {what} loaded={sorted(self.loaded)}>"

    def holds(self, model: _Model) -> bool:
        """True while ``model`` is a member of the turn's family."""
        return model.family is self.family

    def head(self) -> Job | None:
        """The earliest claimed job not yet admitted, of any member."""
        best: Job | None = None
        for model in self.family.members:
            job = self.head_of(model)
            if job is not None and (best is None or job.seq < best.seq):
                best = job
        return best

    def head_of(self, model: _Model) -> Job | None:
        """``model``'s earliest claimed job not yet admitted."""
        job = model.queue.head()
        return job if job is not None and job.seq < self.bound else None

    def pending_for(self, model: _Model, session: str) -> Job | None:
        """The earliest claimed job of ``session`` on ``model`` not yet admitted."""
        index = model.sessions.get(session)
        if index is None:
            return None
        job = index.head()
        return job if job is not None and job.seq < self.bound else None

    def claimed(self, model: _Model) -> list[Job]:
        out: list[Job] = []
        for job in model.queue.prefix():
            if job.seq >= self.bound:
                break
            out.append(job)
        return out

    def pool_jobs(
        self, *, skip: _Model | None = None, room: Callable[[_Model], int] = lambda _m: 0
    ) -> list[Job]:
        """Claimed jobs any member may take (see :func:`.pool.pool_jobs`)."""
        return pool_jobs(self.family, self.bound, skip=skip, room=room)


class _Group:
    __slots__ = ("active", "exclusive", "key", "last_turn", "models", "turn")

    def __init__(self, key: str) -> None:
        self.key = key
        self.models: list[_Model] = []
        self.exclusive = _JobDeque()  # queued exclusive jobs, FIFO
        self.turn: _Turn | None = None
        self.last_turn: str | None = None  # the family that had the last turn
        self.active: list[Job] = []  # running exclusive jobs

    def __repr__(self) -> str:
        return f"<_Group {self.key} turn={self.turn!r} active={len(self.active)}>"

    def running(self, *, other_than: _Family | None = None) -> int:
        return len(self.active) + sum(m.running for m in self.models if m.family is not other_than)
