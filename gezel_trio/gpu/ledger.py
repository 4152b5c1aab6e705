"""The device capacity ledger: per-device byte reservations shared by every process.

Every gezel process on the machine (cooperating daemons) admits its engines
through one small SQLite file in the state dir. A reservation is a row
(device, bytes, owner, model, pid, process start); admission runs under
``BEGIN IMMEDIATE`` (SQLite's write lock, so two processes cannot both see the
same free bytes), reclaims the rows of dead processes first, and either
inserts the row or raises :class:`~gezel_trio.errors.NoCapacity` saying how
many bytes were needed, how many are free, and who holds the rest.

Liveness: a row's process is alive when ``os.kill(pid, 0)`` finds it, it is
not a zombie, and its start time (``/proc/<pid>/stat`` field 22 plus the boot
id) matches the one recorded, so a reused pid does not keep a dead process's
bytes. Where ``/proc`` is missing only ``os.kill`` is used.

Capacities are this process's view (device id -> budget bytes); admission on
a device is judged against the admitting process's budget for it. SQLite runs
in worker threads (``trio.to_thread``) with a fresh connection per operation.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from gezel_trio._trio import unwrapping
from gezel_trio.engine.procs import process_alive, process_start_token
from gezel_trio.engine.units import format_bytes
from gezel_trio.errors import ConfigError, NoCapacity
from gezel_trio.gpu.probe import DeviceHealth

__all__ = [
    "CPU_DEVICE",
    "DeviceLedger",
    "DeviceUsage",
    "LedgerHolder",
    "LedgerSnapshot",
    "ProcessIdentity",
    "Reservation",
    "default_capacities",
    "denial_message",
    "format_bytes",
    "gpu_device_id",
    "open_ledger",
    "process_alive",
    "process_start_token",
    "system_ram_bytes",
]

log = logging.getLogger(__name__)

CPU_DEVICE = "cpu"
#: How long scope-exit cleanup may take before it is abandoned.
RELEASE_TIMEOUT = 10.0
#: SQLite busy timeout: how long a writer waits for another process's lock.
BUSY_TIMEOUT = 10.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS reservations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    device TEXT NOT NULL,
    nbytes INTEGER NOT NULL CHECK (nbytes >= 0),
    owner TEXT NOT NULL,
    model TEXT NOT NULL,
    pid INTEGER NOT NULL,
    pid_start TEXT,
    instance TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS reservations_device ON reservations (device);
"""


# --- processes ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """Who a reservation belongs to: pid plus start token (see :func:`process_start_token`)."""

    pid: int
    start_token: str | None

    @classmethod
    def current(cls) -> ProcessIdentity:
        pid = os.getpid()
        return cls(pid, process_start_token(pid))


# --- capacities -----------------------------------------------------------------------


def gpu_device_id(index: int) -> str:
    """The ledger's name for GPU ``index`` (NVML order)."""
    return f"gpu:{index}"


def system_ram_bytes() -> int:
    """Physical RAM in bytes."""
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def default_capacities(
    health: DeviceHealth | None,
    *,
    ram_bytes: int | None = None,
    ram_fraction: float = 0.8,
) -> dict[str, int]:
    """Budgets for this machine: each GPU's total memory, and ``cpu`` from RAM.

    The ``cpu`` budget is ``ram_fraction`` of physical RAM (the rest is left to
    the OS and other programs). GPU budgets are the full device memory; the
    planner's overhead estimate covers the runtime's own allocations.
    """
    budgets: dict[str, int] = {}
    if health is not None and health.available:
        for r in health.readings:
            if r.memory_total_bytes > 0:
                budgets[gpu_device_id(r.index)] = r.memory_total_bytes
    ram = system_ram_bytes() if ram_bytes is None else ram_bytes
    budgets[CPU_DEVICE] = int(ram * ram_fraction)
    return budgets


# --- records --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LedgerHolder:
    """One reservation row, as status shows it."""

    id: int
    device: str
    nbytes: int
    owner: str
    model: str
    pid: int
    created_at: float


@dataclass(frozen=True, slots=True)
class DeviceUsage:
    device: str
    capacity: int
    reserved: int
    holders: tuple[LedgerHolder, ...]

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.reserved)


@dataclass(frozen=True, slots=True)
class LedgerSnapshot:
    devices: dict[str, DeviceUsage]
    #: Reservations of dead processes removed while taking this snapshot.
    reclaimed: tuple[LedgerHolder, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            name: {
                "capacity": u.capacity,
                "reserved": u.reserved,
                "free": u.free,
                "holders": [
                    {
                        "id": h.id,
                        "nbytes": h.nbytes,
                        "owner": h.owner,
                        "model": h.model,
                        "pid": h.pid,
                        "created_at": h.created_at,
                    }
                    for h in u.holders
                ],
            }
            for name, u in self.devices.items()
        }


@dataclass(frozen=True, slots=True)
class Reservation:
    """What ``async with ledger.reservation(...) as r`` yields."""

    id: int
    device: str
    nbytes: int
    owner: str
    model: str
    pid: int


def denial_message(
    *,
    device: str,
    nbytes: int,
    owner: str,
    model: str,
    capacity: int,
    holders: list[LedgerHolder] | tuple[LedgerHolder, ...],
) -> str:
    """The NoCapacity text: bytes needed, bytes free, and who holds the rest."""
    reserved = sum(h.nbytes for h in holders)
    free = max(0, capacity - reserved)
    msg = (
        f"cannot reserve {format_bytes(nbytes)} on {device} for model {model!r} "
        f"(owner {owner!r}): {format_bytes(free)} free of {format_bytes(capacity)}"
    )
    if holders:
        held = "; ".join(
            f"pid {h.pid} (model {h.model!r}, owner {h.owner!r}) holds {format_bytes(h.nbytes)}"
            for h in holders
        )
        msg += f"; held by: {held}"
    elif nbytes > capacity:
        msg += "; the model needs more than the whole device budget"
    return msg


def _denial(
    device: str, nbytes: int, owner: str, model: str, capacity: int, holders: list[LedgerHolder]
) -> NoCapacity:
    reserved = sum(h.nbytes for h in holders)
    return NoCapacity(
        denial_message(
            device=device,
            nbytes=nbytes,
            owner=owner,
            model=model,
            capacity=capacity,
            holders=holders,
        ),
        detail={
            "device": device,
            "needed_bytes": nbytes,
            "free_bytes": max(0, capacity - reserved),
            "capacity_bytes": capacity,
            "holders": [
                {"pid": h.pid, "model": h.model, "owner": h.owner, "nbytes": h.nbytes}
                for h in holders
            ],
        },
    )


# --- the ledger -----------------------------------------------------------------------


@dataclass(slots=True)
class _Counters:
    admitted: int = 0
    denied: int = 0
    released: int = 0
    reclaimed: int = 0
    held: dict[int, Reservation] = field(default_factory=dict)


class DeviceLedger:
    """Per-device byte reservations in a SQLite file shared across processes.

    Construct it through :func:`open_ledger` (which creates the schema and
    removes this instance's leftovers on exit). ``identity`` overrides the
    recorded process (tests; default: this process).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacities: Mapping[str, int],
        identity: ProcessIdentity | None = None,
    ) -> None:
        for dev, cap in capacities.items():
            if not isinstance(cap, int) or cap < 0:
                raise ConfigError(f"ledger capacity for {dev!r} must be an int >= 0, got {cap!r}")
        self._path = Path(path)
        self._capacities = dict(capacities)
        self._identity = identity or ProcessIdentity.current()
        self._instance = uuid.uuid4().hex
        self._counters = _Counters()

    def __repr__(self) -> str:
        return (
            f"<DeviceLedger {str(self._path)!r} devices={sorted(self._capacities)} "
            f"held={len(self._counters.held)}>"
        )

    @property
    def path(self) -> Path:
        return self._path

    @property
    def capacities(self) -> dict[str, int]:
        return dict(self._capacities)

    def set_capacity(self, device: str, nbytes: int) -> None:
        """Change this process's budget for ``device`` (applies to the next admission)."""
        if nbytes < 0:
            raise ConfigError(f"ledger capacity for {device!r} must be >= 0, got {nbytes!r}")
        self._capacities[device] = nbytes

    # --- sqlite, in worker threads ------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self._path, timeout=BUSY_TIMEOUT, isolation_level=None)
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def _init_sync(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        conn = self._connect()
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(_SCHEMA)
        finally:
            conn.close()

    def _reclaim_locked(self, conn: sqlite3.Connection) -> list[LedgerHolder]:
        rows = conn.execute(
            "SELECT id, device, nbytes, owner, model, pid, pid_start, created_at FROM reservations"
        ).fetchall()
        verdict: dict[tuple[int, str | None], bool] = {}
        dead: list[LedgerHolder] = []
        me = (self._identity.pid, self._identity.start_token)
        for rid, dev, nb, owner, model, pid, start, created in rows:
            key = (int(pid), start)
            if key not in verdict:
                verdict[key] = key == me or process_alive(*key)
            if not verdict[key]:
                dead.append(LedgerHolder(rid, dev, nb, owner, model, pid, created))
        for h in dead:
            conn.execute("DELETE FROM reservations WHERE id = ?", (h.id,))
            log.warning(
                "ledger: reclaimed %s on %s of dead pid %d (model %r, owner %r)",
                format_bytes(h.nbytes),
                h.device,
                h.pid,
                h.model,
                h.owner,
            )
        return dead

    @staticmethod
    def _holders_locked(conn: sqlite3.Connection, device: str | None) -> list[LedgerHolder]:
        sql = "SELECT id, device, nbytes, owner, model, pid, created_at FROM reservations"
        args: tuple[str, ...] = ()
        if device is not None:
            sql += " WHERE device = ?"
            args = (device,)
        return [LedgerHolder(*row) for row in conn.execute(sql + " ORDER BY id", args)]

    def _reserve_sync(
        self, device: str, nbytes: int, owner: str, model: str
    ) -> tuple[int | None, int, NoCapacity | None]:
        """(row id, reclaimed count, None) when admitted; (None, reclaimed, error) when not."""
        capacity = self._capacities[device]
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                reclaimed = len(self._reclaim_locked(conn))
                holders = self._holders_locked(conn, device)
                reserved = sum(h.nbytes for h in holders)
                if nbytes > capacity - reserved:
                    conn.execute("COMMIT")  # keep the reclaim
                    return None, reclaimed, _denial(device, nbytes, owner, model, capacity, holders)
                cur = conn.execute(
                    "INSERT INTO reservations "
                    "(device, nbytes, owner, model, pid, pid_start, instance, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        device,
                        nbytes,
                        owner,
                        model,
                        self._identity.pid,
                        self._identity.start_token,
                        self._instance,
                        time.time(),
                    ),
                )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            return cur.lastrowid, reclaimed, None
        finally:
            conn.close()

    def _release_sync(self, rowid: int) -> bool:
        conn = self._connect()
        try:
            cur = conn.execute("DELETE FROM reservations WHERE id = ?", (rowid,))
            return cur.rowcount > 0
        finally:
            conn.close()

    def _resize_sync(self, rowid: int, nbytes: int) -> bool:
        conn = self._connect()
        try:
            cur = conn.execute("UPDATE reservations SET nbytes = ? WHERE id = ?", (nbytes, rowid))
            return cur.rowcount > 0
        finally:
            conn.close()

    def _release_instance_sync(self) -> int:
        conn = self._connect()
        try:
            cur = conn.execute("DELETE FROM reservations WHERE instance = ?", (self._instance,))
            return cur.rowcount
        finally:
            conn.close()

    def _snapshot_sync(self) -> LedgerSnapshot:
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                reclaimed = self._reclaim_locked(conn)
                holders = self._holders_locked(conn, None)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        finally:
            conn.close()
        by_device: dict[str, list[LedgerHolder]] = {d: [] for d in self._capacities}
        for h in holders:
            by_device.setdefault(h.device, []).append(h)
        devices = {
            d: DeviceUsage(
                device=d,
                capacity=self._capacities.get(d, 0),
                reserved=sum(h.nbytes for h in hs),
                holders=tuple(hs),
            )
            for d, hs in by_device.items()
        }
        return LedgerSnapshot(devices, tuple(reclaimed))

    # --- the Trio API --------------------------------------------------------------

    async def initialize(self) -> None:
        """Create the state dir and schema (idempotent; :func:`open_ledger` calls it)."""
        await trio.to_thread.run_sync(self._init_sync)

    async def reserve(self, device: str, nbytes: int, *, owner: str, model: str) -> Reservation:
        """Admit ``nbytes`` on ``device`` or raise :class:`NoCapacity`; the caller must release.

        Prefer :meth:`reservation`. Cancellation: the SQLite transaction runs
        to its end in its thread; if it admitted, the row is released again
        before ``Cancelled`` propagates, so a cancelled reserve holds nothing.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if device not in self._capacities:
            known = ", ".join(sorted(self._capacities)) or "none"
            raise NoCapacity(
                f"cannot reserve {format_bytes(nbytes)} for model {model!r}: device {device!r} "
                f"has no budget in this ledger (known devices: {known})",
                detail={"device": device, "needed_bytes": nbytes},
            )
        rowid, reclaimed, denied = await trio.to_thread.run_sync(
            self._reserve_sync, device, nbytes, owner, model
        )
        self._counters.reclaimed += reclaimed
        if denied is not None:
            self._counters.denied += 1
            raise denied
        assert rowid is not None
        res = Reservation(rowid, device, nbytes, owner, model, self._identity.pid)
        self._counters.admitted += 1
        self._counters.held[rowid] = res
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
        except BaseException:
            await self.release(res)
            raise
        return res

    async def release(self, reservation: Reservation) -> None:
        """Give the bytes back (idempotent); shielded with a deadline, so it runs on cancel."""
        if self._counters.held.pop(reservation.id, None) is None:
            return
        with trio.move_on_after(RELEASE_TIMEOUT, shield=True):
            await trio.to_thread.run_sync(self._release_sync, reservation.id)
            self._counters.released += 1

    async def resize(self, reservation: Reservation, nbytes: int) -> Reservation:
        """Hold ``nbytes`` instead of what ``reservation`` holds (a footprint measured
        after it was estimated): what the process uses is a fact, so a larger figure is
        recorded even past the device's budget. Returns the updated reservation (the
        same row, released as before); one already released stays released.
        Cancellation: the update runs to its end in its thread."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if reservation.id not in self._counters.held:
            return reservation
        if not await trio.to_thread.run_sync(self._resize_sync, reservation.id, nbytes):
            return reservation
        resized = dataclasses.replace(reservation, nbytes=nbytes)
        if reservation.id in self._counters.held:
            self._counters.held[reservation.id] = resized
        return resized

    @asynccontextmanager
    async def reservation(
        self, device: str, nbytes: int, *, owner: str, model: str
    ) -> AsyncIterator[Reservation]:
        """Hold ``nbytes`` on ``device`` for the block; released at scope exit, cancellation too.

        Raises :class:`NoCapacity` (bytes needed, bytes free, who holds the
        rest: pid, model and owner per holder) when it does not fit.
        """
        res = await self.reserve(device, nbytes, owner=owner, model=model)
        try:
            yield res
        finally:
            await self.release(res)

    async def snapshot(self) -> LedgerSnapshot:
        """Every device's budget, reserved bytes and holders (all processes), after reclaiming."""
        snap = await trio.to_thread.run_sync(self._snapshot_sync)
        self._counters.reclaimed += len(snap.reclaimed)
        return snap

    async def reserved_bytes(self, device: str, *, exclude_owner: str | None = None) -> int:
        """Bytes reserved on ``device`` by everyone (optionally not counting one owner)."""
        snap = await self.snapshot()
        usage = snap.devices.get(device)
        if usage is None:
            return 0
        return sum(h.nbytes for h in usage.holders if h.owner != exclude_owner)

    async def aclose(self) -> None:
        """Release whatever this instance still holds (shielded, with a deadline)."""
        self._counters.held.clear()
        with trio.move_on_after(RELEASE_TIMEOUT, shield=True):
            await trio.to_thread.run_sync(self._release_instance_sync)

    def statistics(self) -> LedgerStats:
        c = self._counters
        return LedgerStats(
            path=str(self._path),
            pid=self._identity.pid,
            capacities=dict(self._capacities),
            held=len(c.held),
            held_bytes=sum(r.nbytes for r in c.held.values()),
            admitted=c.admitted,
            denied=c.denied,
            released=c.released,
            reclaimed=c.reclaimed,
        )


@dataclass(frozen=True, slots=True)
class LedgerStats:
    """This process's view of the ledger, for ``/api/status``."""

    path: str
    pid: int
    capacities: dict[str, int]
    held: int
    held_bytes: int
    admitted: int
    denied: int
    released: int
    reclaimed: int

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "capacities": dict(self.capacities)}


@asynccontextmanager
async def open_ledger(
    path: str | os.PathLike[str],
    *,
    capacities: Mapping[str, int],
    identity: ProcessIdentity | None = None,
) -> AsyncIterator[DeviceLedger]:
    """Open (creating if needed) the shared ledger at ``path``.

    On exit, cancellation included, any reservation this instance still holds
    is released (shielded, with a deadline), so a leaked scope cannot keep
    bytes past the ledger. Errors leave as themselves, never as an exception
    group (one raised by the block is unwrapped too).
    """
    ledger = DeviceLedger(path, capacities=capacities, identity=identity)
    await ledger.initialize()
    async with unwrapping():
        try:
            yield ledger
        finally:
            await ledger.aclose()
