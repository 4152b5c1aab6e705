"""Device readings: an NVML probe (nvidia-ml-py) and a static probe for tests.

A probe answers ``await probe.read(max_age)`` with a :class:`DeviceHealth`
snapshot no older than ``max_age`` seconds. It never raises for a missing
driver, library or GPU: the snapshot then says ``available=False`` with a
``reason``, and every consumer (the health gate, memory pressure) treats that
as "nothing to protect", so admission passes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any, Protocol

import trio

__all__ = [
    "DeviceHealth",
    "GpuReading",
    "NvmlProbe",
    "Probe",
    "ProbeStatistics",
    "StaticProbe",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU at one instant.

    ``temperature_c`` is ``None`` when the device does not report it (the
    health gate then ignores that device for thermal admission). Memory fields
    are bytes; a device whose memory cannot be read reports ``0`` total and is
    ignored by the memory-pressure sum.
    """

    index: int
    name: str
    temperature_c: float | None
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_pct: float | None = None
    power_w: float | None = None

    @property
    def memory_free_bytes(self) -> int:
        return max(0, self.memory_total_bytes - self.memory_used_bytes)


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    """A snapshot of every GPU, or the reason there is none.

    ``taken_at`` is on the Trio clock (what cache ages are measured with);
    ``taken_at_wall`` is ``time.time()`` for status pages.
    """

    readings: tuple[GpuReading, ...]
    available: bool
    reason: str | None
    taken_at: float
    taken_at_wall: float = field(default_factory=time.time)

    @property
    def max_temperature_c(self) -> float | None:
        temps = [r.temperature_c for r in self.readings if r.temperature_c is not None]
        return max(temps) if temps else None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view for ``/api/status``."""
        return {
            "available": self.available,
            "reason": self.reason,
            "taken_at_wall": self.taken_at_wall,
            "readings": [
                {
                    "index": r.index,
                    "name": r.name,
                    "temperature_c": r.temperature_c,
                    "memory_used_bytes": r.memory_used_bytes,
                    "memory_total_bytes": r.memory_total_bytes,
                    "utilization_pct": r.utilization_pct,
                    "power_w": r.power_w,
                }
                for r in self.readings
            ],
        }


@dataclass(frozen=True, slots=True)
class ProbeStatistics:
    """What an :class:`NvmlProbe` has done: whether NVML is up, how many refreshes it
    ran, and the last snapshot (None before the first read)."""

    initialized: bool
    refreshes: int
    last: DeviceHealth | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "initialized": self.initialized,
            "refreshes": self.refreshes,
            "last": None if self.last is None else self.last.as_dict(),
        }


class Probe(Protocol):
    """What the health gate reads. ``read`` must not raise for a missing GPU."""

    async def read(self, max_age: float) -> DeviceHealth: ...


def _unavailable(reason: str) -> DeviceHealth:
    return DeviceHealth(readings=(), available=False, reason=reason, taken_at=trio.current_time())


class NvmlProbe:
    """Reads every GPU through NVML, caching the snapshot for ``max_age``.

    NVML calls block, so each refresh runs in a worker thread; concurrent
    readers share one refresh. Initialization is retried on every refresh while
    it fails (a driver can appear after boot); once it succeeds it is kept
    until :meth:`aclose`. ``nvml`` injects a module with pynvml's interface
    (tests use it; by default ``pynvml`` is imported lazily).

    Cancellation: a refresh already running in its thread finishes (NVML calls
    are short); the cancelled reader gets ``Cancelled`` afterwards and the
    cache keeps the result for the next reader.
    """

    def __init__(self, *, nvml: ModuleType | None = None) -> None:
        self._nvml = nvml
        self._initialized = False
        self._cache: DeviceHealth | None = None
        self._lock = trio.Lock()
        self._refreshes = 0
        self._closed = False

    def __repr__(self) -> str:
        state = "uninitialized"
        if self._cache is not None:
            state = (
                f"{len(self._cache.readings)} GPU(s)"
                if self._cache.available
                else f"unavailable: {self._cache.reason}"
            )
        return f"<NvmlProbe {state} refreshes={self._refreshes}>"

    def statistics(self) -> ProbeStatistics:
        return ProbeStatistics(
            initialized=self._initialized, refreshes=self._refreshes, last=self._cache
        )

    async def read(self, max_age: float) -> DeviceHealth:
        """A snapshot no older than ``max_age`` seconds (never raises for a missing GPU)."""
        cached = self._fresh(max_age)
        if cached is not None:
            return cached
        async with self._lock:
            cached = self._fresh(max_age)
            if cached is not None:
                return cached
            if self._closed:
                health = _unavailable("probe closed")
            else:
                readings, reason = await trio.to_thread.run_sync(self._read_sync)
                now = trio.current_time()
                if reason is not None:
                    health = DeviceHealth((), False, reason, now)
                else:
                    health = DeviceHealth(tuple(readings), True, None, now)
            self._refreshes += 1
            self._cache = health
            return health

    async def aclose(self) -> None:
        """Shut NVML down (idempotent). Later reads say "probe closed"."""
        self._closed = True
        if self._initialized:
            self._initialized = False
            nvml = self._nvml
            if nvml is not None:
                await trio.to_thread.run_sync(_safe_shutdown, nvml)

    def _fresh(self, max_age: float) -> DeviceHealth | None:
        cache = self._cache
        if cache is not None and trio.current_time() - cache.taken_at <= max_age:
            return cache
        return None

    # --- worker thread -------------------------------------------------------------

    def _read_sync(self) -> tuple[list[GpuReading], str | None]:
        """Runs in a thread. Returns (readings, None) or ([], reason); never raises."""
        try:
            nvml = self._nvml
            if nvml is None:
                try:
                    import pynvml
                except ImportError as exc:  # pragma: no cover - a declared dependency
                    return [], f"nvidia-ml-py is not installed ({exc})"
                nvml = self._nvml = pynvml
            if not self._initialized:
                try:
                    nvml.nvmlInit()
                except Exception as exc:
                    return [], f"NVML unavailable: {_describe(exc)}"
                self._initialized = True
            try:
                count = int(nvml.nvmlDeviceGetCount())
            except Exception as exc:
                return [], f"NVML device count failed: {_describe(exc)}"
            if count == 0:
                return [], "NVML reports no GPU"
            readings = [_read_device(nvml, index) for index in range(count)]
            found = [r for r in readings if r is not None]
            if not found:
                return [], "no GPU could be read through NVML"
            return found, None
        except Exception as exc:  # defensive: a probe never raises
            log.exception("NVML probe failed")
            return [], f"NVML probe failed: {_describe(exc)}"


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _safe_shutdown(nvml: ModuleType) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:  # pragma: no cover - shutdown failures are irrelevant
        log.debug("nvmlShutdown failed", exc_info=True)


def _read_device(nvml: ModuleType, index: int) -> GpuReading | None:
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:
        log.warning("NVML: GPU %d unreadable: %s", index, _describe(exc))
        return None
    name = _optional(lambda: nvml.nvmlDeviceGetName(handle))
    if isinstance(name, bytes):
        name = name.decode("utf-8", "replace")
    temp = _optional(
        lambda: nvml.nvmlDeviceGetTemperature(handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
    )
    mem = _optional(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    util = _optional(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
    power_mw = _optional(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
    return GpuReading(
        index=index,
        name=str(name) if name is not None else f"GPU {index}",
        temperature_c=float(temp) if temp is not None else None,
        memory_used_bytes=int(getattr(mem, "used", 0)) if mem is not None else 0,
        memory_total_bytes=int(getattr(mem, "total", 0)) if mem is not None else 0,
        utilization_pct=float(util.gpu) if util is not None else None,
        power_w=float(power_mw) / 1000.0 if power_mw is not None else None,
    )


def _optional(call: Any) -> Any:
    try:
        return call()
    except Exception:
        return None


class StaticProbe:
    """A probe whose readings are set by hand (tests, and hosts without NVML).

    ``read`` returns the current readings stamped with the current Trio time;
    ``max_age`` is ignored, so a test sees every change at the next poll.
    """

    def __init__(
        self,
        readings: Sequence[GpuReading] = (),
        *,
        available: bool | None = None,
        reason: str | None = None,
    ) -> None:
        self._readings: tuple[GpuReading, ...] = tuple(readings)
        self._available = bool(self._readings) if available is None else available
        self._reason = reason
        self.reads = 0

    def __repr__(self) -> str:
        return f"<StaticProbe readings={len(self._readings)} available={self._available}>"

    def set_readings(self, readings: Sequence[GpuReading]) -> None:
        self._readings = tuple(readings)
        self._available = True
        self._reason = None

    def set_temperature(self, temperature_c: float | None, *, index: int | None = None) -> None:
        """Set one GPU's temperature (``index``) or every GPU's."""
        self._readings = tuple(
            replace(r, temperature_c=temperature_c) if index is None or r.index == index else r
            for r in self._readings
        )

    def set_memory(self, *, index: int, used_bytes: int, total_bytes: int | None = None) -> None:
        self._readings = tuple(
            replace(
                r,
                memory_used_bytes=used_bytes,
                memory_total_bytes=r.memory_total_bytes if total_bytes is None else total_bytes,
            )
            if r.index == index
            else r
            for r in self._readings
        )

    def set_unavailable(self, reason: str) -> None:
        self._readings = ()
        self._available = False
        self._reason = reason

    async def read(self, max_age: float) -> DeviceHealth:
        self.reads += 1
        await trio.lowlevel.checkpoint()
        if not self._available:
            return _unavailable(self._reason or "no GPU")
        return DeviceHealth(self._readings, True, None, trio.current_time())
