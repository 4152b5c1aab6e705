"""The GPU arbiter: the operator's ``swap`` preference, leases and the stale-lease breaker.

A port of the seed's ``GpuArbiter`` (``seeds/000_*``, ``gpu-arbiter.js``).
Memory admission is not here: co-residency is admitted by bytes through the
device ledger (:mod:`gezel_trio.gpu.ledger`). The arbiter only

* evicts the *other* slot classes before a workload runs, when the policy is
  ``swap`` (``coexist`` never evicts),
* protects in-flight jobs from that eviction with leases
  (``async with arbiter.lease(slot_class)``),
* breaks a lease older than a ceiling (a leak), and
* passes every workload through the thermal :class:`HealthGate`.

Lease semantics (a deliberate extension of the seed, whose single
``activeLease`` string made a second request of the *same* class wait):

* Leases of one slot class **share**: a holder count. Concurrent requests of
  the resident model run together; a foreign class waits until the count is
  zero. A host serving many concurrent requests of one model needs this.
* **No starvation**: a same-class request joins a held lease only when no
  foreign-class lease request queued before it; otherwise it queues behind
  that request. Waiters are served in arrival order by class, so a busy model
  cannot keep another out forever (the seed got the same property by making
  every request wait).
* **Breaker**: every holder has its own age. A blocked request breaks the
  holders of other classes whose age reached ``stale_lease_ceiling``, with an
  error log. Blocked requests re-check at least every ``lease_wait_poll``
  seconds, because a leaked lease never sends a release. A broken holder's
  later release is a no-op (each holder has a token), so it cannot release
  someone else's lease.
* Leases taken under ``coexist`` are recorded too (they wait for nothing):
  after a switch to ``swap``, a foreign lease waits for them to finish rather
  than evicting an engine mid-generation.

Evictors must be idempotent: the seed's contract is that ``stop()`` on an
engine that is already stopped is a fast no-op, and the arbiter may call an
evictor every time a lease of another class is taken.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import trio

from gezel_trio.errors import ConfigError
from gezel_trio.gpu.health import DeviceSafetyPolicy, HealthGate, MemoryPressure
from gezel_trio.gpu.probe import DeviceHealth

__all__ = [
    "DEFAULT_LEASE_WAIT_POLL",
    "DEFAULT_STALE_LEASE_CEILING",
    "ArbiterStatistics",
    "Evictor",
    "GpuArbiter",
    "Lease",
    "LeaseBook",
    "LeaseHolder",
    "LeaseWaiter",
    "Policy",
    "PolicySetting",
    "resolve_policy",
]

log = logging.getLogger(__name__)

Policy = Literal["coexist", "swap"]
PolicySetting = Literal["auto", "coexist", "swap"]
Evictor = Callable[[], Awaitable[object]]

#: A lease older than this is assumed leaked, not slow (the seed's 90 minutes:
#: sized against the longest legitimate holder, not typical use).
DEFAULT_STALE_LEASE_CEILING = 90 * 60.0
#: How often a blocked request re-checks, so the breaker is reachable.
DEFAULT_LEASE_WAIT_POLL = 60.0


def resolve_policy(setting: str) -> Policy:
    """Map the user-facing setting to a concrete policy; ``auto`` is ``coexist``.

    Co-residency is admitted automatically by the device ledger at engine
    start; ``swap`` is only ever an explicit operator preference.
    """
    if setting == "coexist" or setting == "auto":
        return "coexist"
    if setting == "swap":
        return "swap"
    raise ConfigError(f"gpu policy must be one of 'auto', 'coexist', 'swap'; got {setting!r}")


# --- policy without I/O ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LeaseHolder:
    token: int
    slot_class: str
    since: float
    policy: Policy


@dataclass(frozen=True, slots=True)
class LeaseWaiter:
    ticket: int
    slot_class: str
    since: float
    #: True for a lease request (it will hold); False for a bare ``acquire``.
    takes_lease: bool


class LeaseBook:
    """Lease accounting: holders by token, waiters in arrival order. No I/O, no clock.

    Rules:

    * ``may_take(c, ticket)``: no holder of another class, and no lease request
      of another class queued before ``ticket`` (a new request counts as
      queued last).
    * ``blocked_acquire(c)``: a bare acquire waits only for holders of another
      class (the seed's ``waitForForeignLease``).
    * ``break_stale(now, ceiling, foreign_to=c)`` removes the holders of other
      classes whose age is at least ``ceiling``.
    """

    def __init__(self) -> None:
        self.holders: dict[int, LeaseHolder] = {}
        self.waiters: dict[int, LeaseWaiter] = {}
        self._ids = itertools.count(1)

    def __repr__(self) -> str:
        return f"<LeaseBook holders={self.counts()} waiters={len(self.waiters)}>"

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in self.holders.values():
            out[h.slot_class] = out.get(h.slot_class, 0) + 1
        return out

    def foreign_holders(self, slot_class: str) -> list[LeaseHolder]:
        return [h for h in self.holders.values() if h.slot_class != slot_class]

    def queued_ahead(self, slot_class: str, ticket: int | None) -> list[LeaseWaiter]:
        """Lease requests of other classes queued before ``ticket``."""
        ahead: list[LeaseWaiter] = []
        for w in self.waiters.values():
            if w.ticket == ticket:
                break
            if w.takes_lease and w.slot_class != slot_class:
                ahead.append(w)
        return ahead

    def may_take(self, slot_class: str, ticket: int | None = None) -> bool:
        return not self.foreign_holders(slot_class) and not self.queued_ahead(slot_class, ticket)

    def blocked_acquire(self, slot_class: str) -> bool:
        return bool(self.foreign_holders(slot_class))

    def enqueue(self, slot_class: str, now: float, *, takes_lease: bool) -> int:
        ticket = next(self._ids)
        self.waiters[ticket] = LeaseWaiter(ticket, slot_class, now, takes_lease)
        return ticket

    def dequeue(self, ticket: int) -> None:
        self.waiters.pop(ticket, None)

    def take(self, slot_class: str, now: float, *, policy: Policy) -> int:
        token = next(self._ids)
        self.holders[token] = LeaseHolder(token, slot_class, now, policy)
        return token

    def release(self, token: int) -> bool:
        """Drop a holder. False when it was already gone (broken earlier)."""
        return self.holders.pop(token, None) is not None

    def stale(self, now: float, ceiling: float, *, foreign_to: str) -> list[LeaseHolder]:
        return [h for h in self.foreign_holders(foreign_to) if now - h.since >= ceiling]

    def break_stale(self, now: float, ceiling: float, *, foreign_to: str) -> list[LeaseHolder]:
        broken = self.stale(now, ceiling, foreign_to=foreign_to)
        for h in broken:
            del self.holders[h.token]
        return broken

    def oldest_since(self) -> float | None:
        return min((h.since for h in self.holders.values()), default=None)


# --- the Trio layer ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lease:
    """What ``async with arbiter.lease(c) as lease`` yields."""

    slot_class: str
    token: int
    policy: Policy
    granted_at: float
    #: True when it joined a lease of its class that was already held.
    shared: bool


@dataclass(frozen=True, slots=True)
class ArbiterStatistics:
    policy: Policy
    #: The one class holding leases, or None when none (or several, under coexist).
    active_class: str | None
    #: Holder count per class.
    holders: dict[str, int]
    #: Trio time the oldest current holder took its lease.
    since: float | None
    waiters: tuple[LeaseWaiter, ...]
    evictors: dict[str, tuple[str, ...]]
    evictions: int
    eviction_errors: int
    broken_leases: int
    leases_granted: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "active_class": self.active_class,
            "holders": dict(self.holders),
            "since": self.since,
            "waiters": [
                {
                    "slot_class": w.slot_class,
                    "since": w.since,
                    "kind": "lease" if w.takes_lease else "acquire",
                }
                for w in self.waiters
            ],
            "evictors": {k: list(v) for k, v in self.evictors.items()},
            "evictions": self.evictions,
            "eviction_errors": self.eviction_errors,
            "broken_leases": self.broken_leases,
            "leases_granted": self.leases_granted,
        }


class GpuArbiter:
    """Thermal admission plus the operator's cross-slot ``swap`` preference.

    ``policy`` is ``"coexist"``, ``"swap"`` or ``"auto"`` (= coexist). The
    engine pool registers one evictor per (slot class, owner): typically the
    supervisor's ``stop``. With no evictor registered for a class there is
    nothing to evict, and ``acquire`` for it only passes the health gate.
    """

    def __init__(
        self,
        *,
        policy: PolicySetting | str = "coexist",
        health_gate: HealthGate | None = None,
        stale_lease_ceiling: float = DEFAULT_STALE_LEASE_CEILING,
        lease_wait_poll: float = DEFAULT_LEASE_WAIT_POLL,
    ) -> None:
        if not stale_lease_ceiling > 0:
            raise ConfigError(f"stale_lease_ceiling must be > 0, got {stale_lease_ceiling!r}")
        if not lease_wait_poll > 0:
            raise ConfigError(f"lease_wait_poll must be > 0, got {lease_wait_poll!r}")
        self._policy: Policy = resolve_policy(policy)
        self._gate = health_gate
        self._ceiling = float(stale_lease_ceiling)
        self._poll = float(lease_wait_poll)
        self._evictors: dict[str, dict[str, Evictor]] = {}
        self._book = LeaseBook()
        self._changed = trio.Event()
        self._evictions = 0
        self._eviction_errors = 0
        self._broken = 0
        self._granted = 0

    def __repr__(self) -> str:
        return (
            f"<GpuArbiter policy={self._policy} holders={self._book.counts()} "
            f"waiters={len(self._book.waiters)}>"
        )

    # --- configuration ------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def health_gate(self) -> HealthGate | None:
        return self._gate

    def set_policy(self, policy: PolicySetting | str) -> None:
        """Change the policy live. Switching to coexist wakes every waiter (they proceed).

        Nothing is loaded or evicted here: the new policy applies to the next
        ``acquire``/``lease``.
        """
        new = resolve_policy(policy)
        if new == self._policy:
            return
        log.info("gpu policy %s -> %s", self._policy, new)
        self._policy = new
        if new == "coexist":
            self._wake()

    def set_device_safety_policy(self, policy: DeviceSafetyPolicy) -> None:
        """Change the thermal thresholds live (no-op without a health gate)."""
        if self._gate is not None:
            self._gate.set_policy(policy)

    async def device_health(self, max_age: float = 1.0) -> DeviceHealth | None:
        """The latest device snapshot, or None without a health gate."""
        if self._gate is None:
            return None
        return await self._gate.device_health(max_age)

    async def memory_pressure(
        self, max_age: float = 1.0, devices: Collection[int] | None = None
    ) -> MemoryPressure:
        """The low-free-VRAM release hint over ``devices`` (NVML indices; None: every GPU);
        never pressured without a health gate."""
        if self._gate is None:
            return MemoryPressure(False, None, None, "no health gate")
        return await self._gate.memory_pressure(max_age, devices)

    # --- evictors ------------------------------------------------------------------

    def register_evictor(self, slot_class: str, evict: Evictor, owner_id: str = "default") -> None:
        """Register how to evict one engine of ``slot_class``.

        Re-registering the same (slot class, owner) replaces the old evictor;
        distinct owners of one class coexist (pool replicas) and are all evicted.
        """
        self._evictors.setdefault(slot_class, {})[owner_id] = evict

    def unregister_evictor(self, slot_class: str, owner_id: str = "default") -> None:
        """Forget one evictor (no-op when unknown)."""
        owners = self._evictors.get(slot_class)
        if owners is None:
            return
        owners.pop(owner_id, None)
        if not owners:
            del self._evictors[slot_class]

    # --- admission -----------------------------------------------------------------

    async def acquire(self, slot_class: str, devices: Collection[int] | None = None) -> None:
        """Make room for ``slot_class`` just before it uses the GPU; hold nothing.

        In ``swap``: wait while a lease of another class is held (breaking it
        once stale), then evict every other slot class, all owners, except a
        class that holds a lease at that moment. Evictor errors are logged and
        swallowed. In both policies, then pass the health gate.

        Cancellation: the wait or the eviction in progress is abandoned with
        ``Cancelled``; nothing is held.
        """
        if self._policy == "swap":
            ticket = self._book.enqueue(slot_class, trio.current_time(), takes_lease=False)
            try:
                proceed = await self._wait(slot_class, ticket, takes_lease=False)
            finally:
                self._book.dequeue(ticket)
            if proceed and self._policy == "swap":
                await self._evict_others(slot_class)
        await self._admit(slot_class, devices)

    @asynccontextmanager
    async def lease(
        self, slot_class: str, devices: Collection[int] | None = None
    ) -> AsyncIterator[Lease]:
        """Protect an in-flight job of ``slot_class`` from eviction for the block.

        ``coexist``: pass the health gate and enter at once. ``swap``: wait
        while another class holds a lease (or queued first), join or take the
        lease, evict every other class, pass the health gate.

        The lease is released exactly once at scope exit, whether the block
        returns, raises or is cancelled; cancelled while waiting, nothing is
        held and the queue moves on.
        """
        policy = self._policy
        shared = False
        token = -1
        if policy == "swap":
            ticket = self._book.enqueue(slot_class, trio.current_time(), takes_lease=True)
            took = False
            try:
                proceed = await self._wait(slot_class, ticket, takes_lease=True)
                if proceed:
                    shared = slot_class in self._book.counts()
                    token = self._book.take(slot_class, trio.current_time(), policy="swap")
                    took = True
            finally:
                self._book.dequeue(ticket)
                if not took:
                    # Someone queued behind this request may be free to go now.
                    self._wake()
            if not took:
                policy = "coexist"  # switched while waiting: nothing to protect against
        if policy == "coexist":
            await self._admit(slot_class, devices)
            shared = slot_class in self._book.counts()
            token = self._book.take(slot_class, trio.current_time(), policy="coexist")
        self._granted += 1
        lease = Lease(slot_class, token, policy, trio.current_time(), shared)
        try:
            if policy == "swap":
                await self._evict_others(slot_class)
                await self._admit(slot_class, devices)
            yield lease
        finally:
            self._release(lease)

    def is_held(self, lease: Lease) -> bool:
        """False once the lease is released or was broken as stale."""
        return lease.token in self._book.holders

    def _release(self, lease: Lease) -> None:
        if self._book.release(lease.token):
            self._wake()
        else:
            log.warning(
                "%s lease (token %d) released after it was broken as stale",
                lease.slot_class,
                lease.token,
            )

    async def _admit(self, slot_class: str, devices: Collection[int] | None = None) -> None:
        if self._gate is not None:
            await self._gate.admit(f"{slot_class} workload", devices)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _wait(self, slot_class: str, ticket: int, *, takes_lease: bool) -> bool:
        """Wait until ``slot_class`` may go. False when the policy left ``swap``."""
        first = True
        while True:
            if self._policy != "swap":
                return False
            book = self._book
            blocked = (
                not book.may_take(slot_class, ticket)
                if takes_lease
                else book.blocked_acquire(slot_class)
            )
            if not blocked:
                return True
            now = trio.current_time()
            broken = book.break_stale(now, self._ceiling, foreign_to=slot_class)
            if broken:
                for h in broken:
                    self._broken += 1
                    log.error(
                        "breaking stale %s lease held %ds (ceiling %ds): its holder never "
                        "released it. This is a leak: every GPU request of another class was "
                        "blocked behind it.",
                        h.slot_class,
                        round(now - h.since),
                        round(self._ceiling),
                    )
                self._wake()
                continue
            blockers = sorted(
                {h.slot_class for h in book.foreign_holders(slot_class)}
                | {w.slot_class for w in book.queued_ahead(slot_class, ticket)}
            )
            (log.info if first else log.debug)(
                "%s requested GPU: waiting for active %s job", slot_class, ", ".join(blockers)
            )
            first = False
            changed = self._changed
            with trio.move_on_after(min(self._poll, self._ceiling)):
                await changed.wait()

    async def _evict_others(self, slot_class: str) -> None:
        for other, owners in list(self._evictors.items()):
            if other == slot_class:
                continue
            for owner_id, evict in list(owners.items()):
                # Re-checked before every call: a lease may have been taken while an
                # earlier evictor ran, and a leased engine is never evicted.
                if other in self._book.counts():
                    log.warning(
                        "%s requested GPU: not evicting %s, it holds a lease", slot_class, other
                    )
                    break
                log.info("%s requested GPU: evicting %s (%s)", slot_class, other, owner_id)
                self._evictions += 1
                try:
                    await evict()
                except Exception as exc:
                    # The engine may be gone already; a real failure must not keep
                    # the requesting engine from running (the OS handles contention).
                    self._eviction_errors += 1
                    log.warning(
                        "evicting %s (%s) failed (continuing): %s",
                        other,
                        owner_id,
                        exc,
                        exc_info=True,
                    )

    def statistics(self) -> ArbiterStatistics:
        counts = self._book.counts()
        return ArbiterStatistics(
            policy=self._policy,
            active_class=next(iter(counts)) if len(counts) == 1 else None,
            holders=counts,
            since=self._book.oldest_since(),
            waiters=tuple(self._book.waiters.values()),
            evictors={k: tuple(v) for k, v in self._evictors.items()},
            evictions=self._evictions,
            eviction_errors=self._eviction_errors,
            broken_leases=self._broken,
            leases_granted=self._granted,
        )
