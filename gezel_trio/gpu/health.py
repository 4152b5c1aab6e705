"""Thermal admission and the low-free-VRAM signal, read through a :class:`Probe`.

The policy parts are plain: :class:`ThermalLatch` (hysteresis) and
:func:`memory_pressure_from` (the seed's free-memory rule) need no event loop.
:class:`HealthGate` wraps them with polling, waiting and status.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import trio

from gezel_trio.errors import ConfigError
from gezel_trio.gpu.probe import DeviceHealth, GpuReading, Probe

__all__ = [
    "GIB",
    "DeviceSafetyPolicy",
    "HealthGate",
    "HealthGateStatistics",
    "HealthWaiter",
    "MemoryPressure",
    "ThermalLatch",
    "memory_pressure_from",
]

log = logging.getLogger(__name__)

GIB = 1024**3
#: The seed's pressure floor: at most this much free is always pressure.
PRESSURE_FLOOR_BYTES = GIB
#: ...and so is at most this fraction of the summed total.
PRESSURE_FRACTION = 0.08


@dataclass(frozen=True, slots=True)
class DeviceSafetyPolicy:
    """Thermal thresholds, changeable at run time through :meth:`HealthGate.set_policy`.

    A workload waits while any GPU is at or above ``temp_limit_c`` and resumes
    only once every GPU is below ``temp_limit_c - margin_c``. A waiting workload
    re-reads the probe every ``poll_interval`` seconds.
    """

    temp_limit_c: float = 85.0
    margin_c: float = 5.0
    poll_interval: float = 2.0

    def __post_init__(self) -> None:
        if not self.temp_limit_c > 0:
            raise ConfigError(f"temp_limit_c must be > 0, got {self.temp_limit_c!r}")
        if not self.margin_c >= 0:
            raise ConfigError(f"margin_c must be >= 0, got {self.margin_c!r}")
        if not self.poll_interval > 0:
            raise ConfigError(f"poll_interval must be > 0, got {self.poll_interval!r}")

    @property
    def resume_below_c(self) -> float:
        return self.temp_limit_c - self.margin_c


class ThermalLatch:
    """Hysteresis over the hottest GPU; one latch per gate (the device is hot, not a caller).

    ``update`` sets the latch when the hottest reading is at or above the
    limit and clears it only when the hottest reading is below
    ``limit - margin``; in between it keeps its state. Readings without a
    temperature, or no readings at all, clear it (nothing to protect).
    """

    def __init__(self) -> None:
        self.hot = False
        self.hottest: GpuReading | None = None

    def __repr__(self) -> str:
        return f"<ThermalLatch hot={self.hot}>"

    def update(self, readings: Iterable[GpuReading], policy: DeviceSafetyPolicy) -> bool:
        with_temp = [r for r in readings if r.temperature_c is not None]
        if not with_temp:
            self.hot = False
            self.hottest = None
            return False
        hottest = max(with_temp, key=lambda r: r.temperature_c or 0.0)
        temp = hottest.temperature_c or 0.0
        self.hottest = hottest
        if temp >= policy.temp_limit_c:
            self.hot = True
        elif temp < policy.resume_below_c:
            self.hot = False
        return self.hot

    def reason(self, policy: DeviceSafetyPolicy) -> str:
        r = self.hottest
        if r is None:
            return "no temperature reading"
        return (
            f"GPU {r.index} ({r.name}) at {r.temperature_c:g} C; limit {policy.temp_limit_c:g} C, "
            f"resumes below {policy.resume_below_c:g} C"
        )


@dataclass(frozen=True, slots=True)
class MemoryPressure:
    """The seed's low-free-VRAM signal: a release hint for idle engines, not a denial.

    ``free_bytes``/``total_bytes`` are ``None`` when there are no usable
    readings (then never pressured). ``detail`` is a human line for status.
    """

    pressured: bool
    free_bytes: int | None
    total_bytes: int | None
    detail: str


def memory_pressure_from(
    health: DeviceHealth | None, devices: Collection[int] | None = None
) -> MemoryPressure:
    """Pressured when free <= max(1 GiB, 8% of total), summed over every GPU, or over the
    GPUs ``devices`` names (NVML indices: the ones an engine runs on).

    As in the seed, readings with a non-positive total or a negative used value
    are ignored; with no usable readings the answer is "not pressured".
    """
    if health is None:
        return MemoryPressure(False, None, None, "no health gate")
    usable = [
        r
        for r in health.readings
        if r.memory_total_bytes > 0
        and r.memory_used_bytes >= 0
        and (devices is None or r.index in devices)
    ]
    if not usable:
        why = health.reason or "no GPU memory readings"
        return MemoryPressure(False, None, None, f"no GPU memory readings ({why})")
    total = sum(r.memory_total_bytes for r in usable)
    used = sum(r.memory_used_bytes for r in usable)
    free = max(0, total - used)
    threshold = max(PRESSURE_FLOOR_BYTES, int(total * PRESSURE_FRACTION))
    pressured = free <= threshold
    detail = f"{free / GIB:.1f} GB free of {total / GIB:.1f} GB VRAM"
    if pressured:
        detail += f" (at or below the {threshold / GIB:.1f} GB threshold)"
    return MemoryPressure(pressured, free, total, detail)


@dataclass(frozen=True, slots=True)
class HealthWaiter:
    """A workload parked by the thermal gate: who, since when (Trio clock), why."""

    what: str
    since: float
    reason: str


@dataclass(frozen=True, slots=True)
class HealthGateStatistics:
    policy: DeviceSafetyPolicy
    hot: bool
    max_temperature_c: float | None
    waiters: tuple[HealthWaiter, ...]
    admitted: int
    waited: int
    last: DeviceHealth | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": {
                "temp_limit_c": self.policy.temp_limit_c,
                "margin_c": self.policy.margin_c,
                "poll_interval": self.policy.poll_interval,
            },
            "hot": self.hot,
            "max_temperature_c": self.max_temperature_c,
            "waiters": [
                {"what": w.what, "since": w.since, "reason": w.reason} for w in self.waiters
            ],
            "admitted": self.admitted,
            "waited": self.waited,
            "device": None if self.last is None else self.last.as_dict(),
        }


class HealthGate:
    """Thermal admission over a probe, with hysteresis and visible waits.

    ``admit`` returns at once while the devices are cool or unavailable. While
    the latch is hot it parks the caller, re-reading the probe every
    ``policy.poll_interval`` seconds, until the hottest GPU is below
    ``limit - margin``. :meth:`set_policy` applies at once and wakes every
    waiter to re-evaluate.
    """

    def __init__(self, probe: Probe, *, policy: DeviceSafetyPolicy | None = None) -> None:
        self._probe = probe
        self._policy = policy or DeviceSafetyPolicy()
        self._latch = ThermalLatch()
        self._latches: dict[int, ThermalLatch] = {}  # per GPU (NVML index)
        self._changed = trio.Event()
        self._waiters: dict[int, HealthWaiter] = {}
        self._next_waiter = 0
        self._admitted = 0
        self._waited = 0
        self._last: DeviceHealth | None = None

    def __repr__(self) -> str:
        return (
            f"<HealthGate limit={self._policy.temp_limit_c:g}C margin={self._policy.margin_c:g}C "
            f"hot={self._latch.hot} waiters={len(self._waiters)}>"
        )

    @property
    def policy(self) -> DeviceSafetyPolicy:
        return self._policy

    def set_policy(self, policy: DeviceSafetyPolicy) -> None:
        """Replace the thresholds; every waiter re-reads the probe and re-evaluates."""
        if policy != self._policy:
            log.info("device safety policy %s -> %s", self._policy, policy)
        self._policy = policy
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def device_health(self, max_age: float = 1.0) -> DeviceHealth:
        """The probe's snapshot, no older than ``max_age`` seconds."""
        health = await self._probe.read(max_age)
        self._last = health
        return health

    async def memory_pressure(
        self, max_age: float = 1.0, devices: Collection[int] | None = None
    ) -> MemoryPressure:
        """The seed's low-free-VRAM signal (see :func:`memory_pressure_from`)."""
        return memory_pressure_from(await self.device_health(max_age), devices)

    def _evaluate(self, health: DeviceHealth, devices: Collection[int] | None = None) -> bool:
        """True when the caller must wait: one of ``devices`` (every GPU when None) is hot.
        Each GPU has its own latch, so a hot GPU holds only the engines that run on it."""
        if not health.available:
            self._latch.update((), self._policy)
            for latch in self._latches.values():
                latch.update((), self._policy)
            return False
        self._latch.update(health.readings, self._policy)  # the hottest, for status
        hot = False
        for r in health.readings:
            latch = self._latches.setdefault(r.index, ThermalLatch())
            if latch.update((r,), self._policy) and (devices is None or r.index in devices):
                hot = True
        return hot

    def _reason(self, devices: Collection[int] | None) -> str:
        for index, latch in sorted(self._latches.items()):
            if latch.hot and (devices is None or index in devices):
                return latch.reason(self._policy)
        return self._latch.reason(self._policy)

    async def admit(self, what: str, devices: Collection[int] | None = None) -> None:
        """Return once the GPUs ``what`` runs on (NVML indices; None: every GPU) are cool
        enough.

        Cancellation: the wait ends with ``Cancelled`` and the caller's entry
        leaves ``statistics().waiters``; nothing else is held.
        """
        policy = self._policy
        if not self._evaluate(await self.device_health(policy.poll_interval), devices):
            self._admitted += 1
            return
        key = self._next_waiter
        self._next_waiter += 1
        since = trio.current_time()
        self._waiters[key] = HealthWaiter(what, since, self._reason(devices))
        self._waited += 1
        log.warning("%s waits for the GPU to cool: %s", what, self._reason(devices))
        try:
            while True:
                changed = self._changed
                with trio.move_on_after(self._policy.poll_interval):
                    await changed.wait()
                health = await self.device_health(self._policy.poll_interval / 2)
                if not self._evaluate(health, devices):
                    break
                self._waiters[key] = HealthWaiter(what, since, self._reason(devices))
        finally:
            del self._waiters[key]
        log.info("%s admitted after %.1f s thermal wait", what, trio.current_time() - since)
        self._admitted += 1

    def statistics(self) -> HealthGateStatistics:
        return HealthGateStatistics(
            policy=self._policy,
            hot=self._latch.hot,
            max_temperature_c=None if self._last is None else self._last.max_temperature_c,
            waiters=tuple(self._waiters.values()),
            admitted=self._admitted,
            waited=self._waited,
            last=self._last,
        )
