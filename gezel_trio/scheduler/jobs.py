"""What the scheduler is asked for and what it gives: job kinds, residency modes,
a ``/slots`` sample, a grant, a lane's synchronous view, a job's state.

Plain values with no I/O, shared by the policy (:mod:`.policy`) and the Trio layer
(:mod:`.dispatcher`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, Protocol

__all__ = [
    "EXCLUSIVE_KINDS",
    "JOB_KINDS",
    "RESIDENCIES",
    "Grant",
    "JobKind",
    "JobState",
    "LaneInfo",
    "Residency",
    "SlotMeasurement",
]

JobKind = Literal["completion", "calibrate", "sweep", "benchmark"]
Residency = Literal["swap", "coexist"]
JOB_KINDS: frozenset[str] = frozenset({"completion", "calibrate", "sweep", "benchmark"})
EXCLUSIVE_KINDS: frozenset[str] = JOB_KINDS - {"completion"}
RESIDENCIES: frozenset[str] = frozenset({"swap", "coexist"})


def _nothing() -> None:
    """What ``Grant.answered`` does for a grant that needs no word of its answer."""


@dataclass(frozen=True, slots=True)
class SlotMeasurement:
    """One sample of an engine's ``GET /slots``.

    ``idle`` is the number of free sequence slots; ``ids`` names them, or is
    ``None`` when the engine reports only a count (then nothing can be pinned).
    """

    idle: int
    ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Grant:
    """What the holder of a slot is given once it may send its request.

    ``slot_id`` is the pin to send upstream as ``id_slot`` (``None`` for exclusive
    jobs, for embeddings, which hold every slot, and for calls that use no slot);
    ``blind``: a job on a slot that may hold another job's KV (a keyless job, or an
    owner's job handed a slot without an erase); the caller must send it with
    ``cache_prompt`` off, so the engine reuses nothing the slot holds, and call
    ``answered`` once the engine's first token came, or its whole answer counting the
    prompt it read (the engine then cleared the slot and it holds the job's own KV;
    without that call the slot stays unknown).
    ``erased`` says an acknowledged erase or restore of that slot preceded this
    grant; ``queue_wait_s`` is the time from the request to this grant (engine
    switch and preparation included); ``prepare_calls`` counts the upstream calls
    made on the request's critical path before its own (save, restore, erase);
    ``generation`` is the engine generation the slot was prepared on;
    ``restored_tokens`` how many tokens of the session's parked KV were restored
    into the slot for this job (0: none), for the caller to verify against the
    completion's cached tokens; ``lead_tokens`` how many tokens of the caller's lead
    snapshot the slot holds for it (restored, or prefilled and saved just now; 0:
    none), which the completion should reuse whole (see :mod:`gezel_trio.kv.lead`).
    """

    model_id: str
    slot_id: int | None
    erased: bool
    queue_wait_s: float
    blind: bool = False
    prepare_calls: int = 0
    generation: int | None = None
    restored_tokens: int = 0
    lead_tokens: int = 0
    answered: Callable[[], None] = field(default=_nothing, repr=False, compare=False)


class LaneInfo(Protocol):
    """The synchronous view of a lane the policy reads (no I/O)."""

    @property
    def model_id(self) -> str: ...

    @property
    def display_name(self) -> str: ...

    @property
    def parallel(self) -> int:
        """Admission ceiling (1 after a failed calibration)."""
        ...

    @property
    def slot_count(self) -> int:
        """The engine's slots (``--parallel``): the size of its slot table."""
        ...

    @property
    def generation(self) -> int: ...

    @property
    def sole_client(self) -> bool:
        """True for an engine the host spawned: nobody else sends it work, so free
        slots come from the table; False for an external engine (measured)."""
        ...

    @property
    def family(self) -> str | None:
        """The replicated model this lane is a member of (None: a model of its own)."""
        ...


class JobState(Enum):
    QUEUED = "queued"  # submitted, not admitted (possibly claimed by a turn)
    RUNNING = "running"  # admitted: counted against capacity until settled
    DONE = "done"  # settled after running (finished, failed or cancelled)
    CANCELLED = "cancelled"  # left the queue before admission
    FAILED = "failed"  # failed by the scheduler before admission (engine, shutdown)
