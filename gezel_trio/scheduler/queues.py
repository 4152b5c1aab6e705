"""The queue structures: a queued job, the per-model FIFO and per-session index
that hold it, and the family a model's queue belongs to.

A FIFO deque per model and a per-model, per-session index, both with lazy deletion
and compaction, so that one admission and one turn start cost O(models + slots),
never O(queued jobs). No I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from gezel_trio.kv.lead import Lead
from gezel_trio.kv.prefix import Prefix
from gezel_trio.scheduler.jobs import JobKind, JobState, LaneInfo
from gezel_trio.scheduler.slots import SlotTable

__all__ = ["Job", "detach"]

_COMPACT_MIN = 64  # never compact a deque shorter than this


@dataclass(eq=False, slots=True)
class Job:
    """One queued request or host operation. The Trio layer subclasses it."""

    model_id: str
    kind: JobKind = "completion"
    session: str | None = None  # its owner (None: a blind keyless job)
    keyless: bool = False  # ``session`` is a caller's keyless owner (never parked)
    prefix: Prefix = ()  # the request's prefix blocks (placement within its owner)
    caller: str | None = None  # its owner may share its caller's prefixes (None: no)
    parked: bool = False  # its owner has a parked copy for it (no shared prefix sought)
    reuse: int = 0  # blocks of ``prefix`` it starts from outside a slot (a parked copy)
    passed: int = 0  # times a job with a short prefill went before it (SHORT WORK FIRST)
    lead: Lead | None = None  # its caller's lead to start from (a model that cannot cut back)
    lead_tokens: int = 0  # tokens of that lead its slot holds for it (0: none)
    seq: int = -1
    submitted_at: float = 0.0
    state: JobState = JobState.QUEUED
    slot_id: int | None = None
    any_slot: bool = False  # the engine picks the slot (embeddings): holds every slot
    needs_slot: bool = True  # False: occupies capacity, sends nothing to a slot
    pool: bool = False  # may run on any member of its family (see THE POOL)
    ran: bool = False  # its request was sent (the slot's content is the job's from now)
    blind: bool = False  # sent with cache_prompt off instead of an erase (an owner's job)
    answered: bool = False  # a blind job's engine sent its first token: it cleared the slot
    generation: int | None = None  # engine generation the job was admitted on
    admitted_at: float | None = None
    model_state: _Model | None = field(default=None, repr=False)
    home: _JobDeque | None = field(default=None, repr=False)
    session_home: _JobDeque | None = field(default=None, repr=False)

    @property
    def exclusive(self) -> bool:
        return self.kind != "completion"

    def answer(self) -> None:
        """The engine sent the first token of this job's answer (see ``Grant.answered``)."""
        self.answered = True


def detach(job: Job) -> None:
    """Take ``job`` out of the deques it is a live member of (its model's FIFO, or its
    group's exclusive queue, and its session's index)."""
    home = job.home
    if home is not None:
        home.discard(job)
    index = job.session_home
    if index is not None:
        index.discard(job)


class _JobDeque:
    """A FIFO of jobs with O(1) removal from anywhere (lazy deletion + compaction).

    A job is a live member while its ``home`` (or ``session_home`` for an index
    deque) points at this deque; entries that left are skipped at the head and
    dropped wholesale when they outnumber the live ones.
    """

    __slots__ = ("_index", "_items", "_key", "_live", "_owner")

    def __init__(
        self, *, index: bool = False, key: str = "", owner: dict[str, _JobDeque] | None = None
    ) -> None:
        self._items: deque[Job] = deque()
        self._live = 0
        self._index = index
        self._key = key
        self._owner = owner

    def __len__(self) -> int:
        return self._live

    def __bool__(self) -> bool:
        return self._live > 0

    def __repr__(self) -> str:
        return f"<_JobDeque live={self._live} entries={len(self._items)}>"

    def _member(self, job: Job) -> bool:
        return (job.session_home if self._index else job.home) is self

    def _bind(self, job: Job, value: _JobDeque | None) -> None:
        if self._index:
            job.session_home = value
        else:
            job.home = value

    def __iter__(self) -> Iterator[Job]:
        return (job for job in list(self._items) if self._member(job))

    def prefix(self) -> Iterator[Job]:
        """Live jobs from the head, lazily (stop early; do not mutate meanwhile)."""
        return (job for job in self._items if self._member(job))

    def append(self, job: Job) -> None:
        self._bind(job, self)
        self._items.append(job)
        self._live += 1

    def insert(self, job: Job) -> None:
        """Add ``job`` in ``seq`` order (O(1) at the tail, else O(entries): a job moved
        from another queue, which is rare)."""
        items = self._items
        if not items or items[-1].seq < job.seq:
            self.append(job)
            return
        self._bind(job, self)
        self._live += 1
        self._items = deque(sorted([*self, job], key=lambda j: j.seq))

    def head(self) -> Job | None:
        items = self._items
        if self._index:
            while items:
                job = items[0]
                if job.session_home is self:
                    return job
                items.popleft()
        else:
            while items:
                job = items[0]
                if job.home is self:
                    return job
                items.popleft()
        return None

    def discard(self, job: Job) -> None:
        """Remove ``job`` if it is a live member (O(1) amortized: entries that left
        are dropped from the head as it advances, or all at once when they
        outnumber the live ones)."""
        if not self._member(job):
            return
        self._bind(job, None)
        self._live -= 1
        items = self._items
        if self._live == 0:
            items.clear()
            if self._owner is not None and self._owner.get(self._key) is self:
                del self._owner[self._key]
        elif items[0] is job:
            items.popleft()
            self.head()  # drop entries that left behind it
        elif len(items) > _COMPACT_MIN and len(items) > 2 * self._live:
            if self._index:
                self._items = deque([j for j in items if j.session_home is self])
            else:
                self._items = deque([j for j in items if j.home is self])

    def entries(self) -> int:
        """Stored entries, live or not (for tests of the compaction bound)."""
        return len(self._items)


class _Model:
    __slots__ = (
        "display_name",
        "down",
        "family",
        "group_key",
        "lane",
        "loading",
        "model_id",
        "queue",
        "running",
        "sessions",
        "table",
        "waiting",
    )

    def __init__(self, model_id: str, lane: LaneInfo, family: _Family) -> None:
        self.model_id = model_id
        self.lane = lane
        self.display_name = lane.display_name
        self.family = family
        self.group_key = ""
        self.queue = _JobDeque()  # queued completions, FIFO (a turn claims a prefix)
        self.sessions: dict[str, _JobDeque] = {}  # session -> its queued completions
        self.waiting = 0  # queued jobs of this model (claimed or not, exclusive too)
        self.running = 0  # admitted completions not yet settled
        self.table = SlotTable()
        self.loading = False
        self.down = False  # its last load failed or its /slots could not be sampled

    def __repr__(self) -> str:
        return f"<_Model {self.model_id} waiting={self.waiting} running={self.running}>"

    def append(self, job: Job) -> None:
        self.queue.append(job)
        self._index(job)

    def insert(self, job: Job) -> None:
        """Queue ``job`` in its ``seq`` order (a job moved here from a sibling)."""
        self.queue.insert(job)
        self._index(job)

    def _index(self, job: Job) -> None:
        session = job.session
        if session is not None:
            index = self.sessions.get(session)
            if index is None:
                index = _JobDeque(index=True, key=session, owner=self.sessions)
                self.sessions[session] = index
            index.insert(job)


class _Family:
    """The models that share turns: one model, or a replicated model's members."""

    __slots__ = ("key", "members")

    def __init__(self, key: str) -> None:
        self.key = key
        self.members: list[_Model] = []

    def __repr__(self) -> str:
        return f"<_Family {self.key} {[m.model_id for m in self.members]}>"

    @property
    def running(self) -> int:
        return sum(m.running for m in self.members)

    def has_queue(self) -> bool:
        return any(m.queue for m in self.members)

    def live(self, *, other_than: _Model) -> list[_Model]:
        """Members other than ``other_than`` that are not down."""
        return [m for m in self.members if m is not other_than and not m.down]
