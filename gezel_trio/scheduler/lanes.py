"""What the scheduler needs from one model's engine: the lane protocols (an engine,
one that can park KV), and a call abandoned when the engine fails."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

import trio

from gezel_trio._trio import unwrapping
from gezel_trio.kv.lead import Lead, LeadStart
from gezel_trio.kv.prefix import Prefix
from gezel_trio.scheduler.jobs import LaneInfo, SlotMeasurement

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = ["EngineLane", "LeadLane", "ParkingLane", "can_lead", "can_park", "unless_failed"]

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

    def lent_copy(self, caller: str, session: str, prefix: Prefix) -> tuple[str, Prefix] | None:
        """The parked copy of another owner of ``caller`` that a request of ``session``
        with blocks ``prefix`` may start from (its owner and blocks; None: none)."""
        ...

    def is_current(self, session: str, blocks: Prefix) -> bool:
        """Whether a parked copy of ``session`` holds exactly ``blocks``."""
        ...

    def note_miss(self) -> None:
        """A keyed job found its session neither in its slot nor parked."""
        ...

    async def park_slot(
        self,
        slot_id: int,
        session: str,
        blocks: Prefix = (),
        *,
        within: float = math.inf,
        share_caller: str | None = None,
    ) -> int:
        """Save the slot's KV for ``session`` as a copy of ``blocks``: the tokens saved
        (0: the slot was empty); ``share_caller``: the caller whose other owners may
        start from it (None: nobody). Raises when it fails or takes longer than ``within`` seconds
        (a failure, logged with its reason); cancellation is no failure."""
        ...

    async def unpark_slot(
        self,
        slot_id: int,
        session: str,
        prefix: Prefix | None = None,
        *,
        within: float = math.inf,
        lent_to: str | None = None,
    ) -> int:
        """Restore ``session``'s parked copy for ``prefix`` into the slot: the tokens
        restored (0: none). ``lent_to`` (a caller): the copy :meth:`lent_copy` names
        for a request of ``session`` instead. Raises when it fails or takes longer than
        ``within`` seconds (logged with its reason); cancellation is no failure."""
        ...


@runtime_checkable
class LeadLane(Protocol):
    """A lane that can start a slot from its caller's lead snapshot (see
    :mod:`gezel_trio.kv.lead`): for a model that cannot cut a slot back."""

    @property
    def leads_enabled(self) -> bool:
        """False once a lead proved not to be a prefix of its request (the model's
        template renders it otherwise), or without KV parking."""
        ...

    async def start_lead(self, slot_id: int, lead: Lead, *, within: float = math.inf) -> LeadStart:
        """Make the slot hold exactly ``lead`` (a caller's, :meth:`Lead.for_caller`):
        restore its snapshot, or prefill the lead alone (the engine empties the slot
        first) and save it as one; restore and save each within ``within`` seconds (the
        prefill is the request's own work, done one call early). 0 tokens: it failed
        (logged) and the slot is unknown; a failed save alone still leaves the lead in
        the slot. Cancellation leaves the slot unknown."""
        ...


_PARKING_TYPES: dict[type, bool] = {}
_LEAD_TYPES: dict[type, bool] = {}


def can_park(lane: object) -> TypeIs[ParkingLane]:
    """Whether ``lane`` is a :class:`ParkingLane`. A runtime protocol check reads every
    member of the protocol; this asks once per type (what it checks is the type's)."""
    kind = type(lane)
    known = _PARKING_TYPES.get(kind)
    if known is None:
        known = _PARKING_TYPES[kind] = isinstance(lane, ParkingLane)
    return known


def can_lead(lane: object) -> TypeIs[LeadLane]:
    """Whether ``lane`` is a :class:`LeadLane` (asked once per type, as
    :func:`can_park`)."""
    kind = type(lane)
    known = _LEAD_TYPES.get(kind)
    if known is None:
        known = _LEAD_TYPES[kind] = isinstance(lane, LeadLane)
    return known


class EngineLane(LaneInfo, Protocol):
    """What the scheduler needs from one model's engine."""

    @property
    def ready(self) -> bool:
        """The engine is running and answering (requests can be sent now)."""
        ...

    async def ensure_resident(self) -> None:
        """Start or switch the engine lazily; raises project errors (EngineFailed, NoCapacity)."""
        ...

    def resident_now(self) -> bool:
        """Whether :meth:`ensure_resident` has nothing to do now: the engine is ready
        and nothing about it is left to note. The dispatcher then admits in the same
        pass, with no load task (the lease still passes the GPU's gate)."""
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


async def unless_failed(lane: EngineLane, call: Callable[[], Awaitable[T]]) -> tuple[T] | None:
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
