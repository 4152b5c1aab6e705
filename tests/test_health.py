"""NVML probe, thermal health gate (hysteresis, visible waits) and memory pressure."""

from __future__ import annotations

import types
from typing import Any

import pytest
import trio
import trio.testing

from gezel_trio.errors import ConfigError
from gezel_trio.gpu.health import (
    DeviceSafetyPolicy,
    HealthGate,
    ThermalLatch,
    memory_pressure_from,
)
from gezel_trio.gpu.probe import DeviceHealth, GpuReading, NvmlProbe, StaticProbe

GIB = 1024**3


def reading(
    index: int = 0, temp: float | None = 60.0, used: int = 0, total: int = 80 * GIB
) -> GpuReading:
    return GpuReading(index, f"GPU{index}", temp, used, total)


def health(*readings: GpuReading) -> DeviceHealth:
    return DeviceHealth(tuple(readings), True, None, 0.0)


# --- pure policy ---------------------------------------------------------------------


def test_policy_validation() -> None:
    p = DeviceSafetyPolicy()
    assert (p.temp_limit_c, p.margin_c, p.resume_below_c) == (85.0, 5.0, 80.0)
    with pytest.raises(ConfigError, match="temp_limit_c"):
        DeviceSafetyPolicy(temp_limit_c=0)
    with pytest.raises(ConfigError, match="margin_c"):
        DeviceSafetyPolicy(margin_c=-1)
    with pytest.raises(ConfigError, match="poll_interval"):
        DeviceSafetyPolicy(poll_interval=0)


def test_thermal_latch_hysteresis() -> None:
    policy = DeviceSafetyPolicy(temp_limit_c=85, margin_c=5)
    latch = ThermalLatch()
    seq = [(84.9, False), (85.0, True), (82.0, True), (80.0, True), (79.9, False), (84.0, False)]
    for temp, hot in seq:
        assert latch.update([reading(temp=temp)], policy) is hot, temp
    # The hottest GPU decides; a GPU without a temperature is ignored.
    assert latch.update([reading(0, 40.0), reading(1, 88.0), reading(2, None)], policy)
    assert latch.hottest is not None and latch.hottest.index == 1
    assert "GPU 1" in latch.reason(policy) and "88" in latch.reason(policy)
    assert not latch.update([reading(temp=None)], policy)  # nothing to protect


def test_memory_pressure_threshold_is_max_of_1gib_and_8_percent() -> None:
    total = 80 * GIB
    threshold = int(total * 0.08)  # 6.4 GiB > 1 GiB
    at = memory_pressure_from(health(reading(used=total - threshold, total=total)))
    assert at.pressured and at.free_bytes == threshold and at.total_bytes == total
    assert "6.4 GB free of 80.0 GB VRAM" in at.detail
    above = memory_pressure_from(health(reading(used=total - threshold - 1, total=total)))
    assert not above.pressured and above.free_bytes == threshold + 1
    # A small card: the 1 GiB floor wins over 8% (0.64 GiB).
    small = 8 * GIB
    assert memory_pressure_from(health(reading(used=small - GIB, total=small))).pressured
    assert not memory_pressure_from(health(reading(used=small - GIB - 1, total=small))).pressured


def test_memory_pressure_sums_gpus_and_ignores_bad_readings() -> None:
    # Summed as in the seed: 2 GiB free of 32 GiB <= max(1 GiB, 2.56 GiB) is pressure.
    two = health(
        reading(0, used=15 * GIB, total=16 * GIB), reading(1, used=15 * GIB, total=16 * GIB)
    )
    p = memory_pressure_from(two)
    assert p.pressured and p.free_bytes == 2 * GIB and p.total_bytes == 32 * GIB
    roomy = health(reading(0, used=15 * GIB, total=16 * GIB), reading(1, used=0, total=16 * GIB))
    assert not memory_pressure_from(roomy).pressured
    # A reading with no total is ignored, not counted as a full card.
    bad = health(reading(0, used=0, total=0), reading(1, used=GIB, total=16 * GIB))
    q = memory_pressure_from(bad)
    assert q.total_bytes == 16 * GIB and not q.pressured
    none = memory_pressure_from(DeviceHealth((), False, "NVML unavailable: x", 0.0))
    assert not none.pressured and none.free_bytes is None and "NVML unavailable" in none.detail
    assert not memory_pressure_from(None).pressured


# --- the gate -------------------------------------------------------------------------


async def test_admit_passes_at_once_when_cool(autojump_clock: object) -> None:
    gate = HealthGate(StaticProbe([reading(temp=84.9)]))
    t0 = trio.current_time()
    await gate.admit("chat")
    assert trio.current_time() == t0
    stats = gate.statistics()
    assert stats.admitted == 1 and stats.waited == 0 and not stats.hot


async def test_admit_waits_while_hot_and_resumes_below_limit_minus_margin(
    autojump_clock: object,
) -> None:
    probe = StaticProbe([reading(0, 60.0), reading(1, 90.0)])
    gate = HealthGate(probe, policy=DeviceSafetyPolicy(poll_interval=2.0))
    t0 = trio.current_time()
    admitted: list[float] = []

    async def job() -> None:
        await gate.admit("llama workload")
        admitted.append(trio.current_time() - t0)

    async with trio.open_nursery() as n:
        n.start_soon(job)
        await trio.sleep(1)
        stats = gate.statistics()
        assert stats.hot and stats.max_temperature_c == 90.0
        [w] = stats.waiters
        assert w.what == "llama workload" and w.since == t0
        assert "GPU 1" in w.reason and "90" in w.reason and "80" in w.reason
        await trio.sleep(4)
        probe.set_temperature(82.0, index=1)  # below the limit, not below limit - margin
        await trio.sleep(6)
        assert admitted == []
        assert "82" in gate.statistics().waiters[0].reason
        probe.set_temperature(79.0, index=1)  # t = 11
    # Polls at 2, 4, ..., 12: the first poll after 11 admits.
    assert admitted == [12.0]
    stats = gate.statistics()
    assert stats.waiters == () and stats.waited == 1 and stats.admitted == 1


async def test_latch_is_shared_by_new_callers(autojump_clock: object) -> None:
    probe = StaticProbe([reading(temp=86.0)])
    gate = HealthGate(probe, policy=DeviceSafetyPolicy(poll_interval=1.0))
    with trio.move_on_after(0.5):
        await gate.admit("first")
    probe.set_temperature(82.0)
    # Still hot by hysteresis: a new caller at 82 C waits too.
    t0 = trio.current_time()
    with trio.move_on_after(3) as scope:
        await gate.admit("second")
    assert scope.cancelled_caught
    probe.set_temperature(79.0)
    await gate.admit("third")  # 79 < 80 clears the latch at its first read
    probe.set_temperature(84.0)
    t1 = trio.current_time()
    await gate.admit("fourth")  # cool latch: 84 < 85 passes
    assert trio.current_time() == t1
    assert t1 - t0 == 3.0
    assert gate.statistics().waiters == ()


async def test_set_policy_wakes_waiters_at_once(autojump_clock: object) -> None:
    probe = StaticProbe([reading(temp=86.0)])
    gate = HealthGate(probe, policy=DeviceSafetyPolicy(poll_interval=10.0))
    t0 = trio.current_time()
    done: list[float] = []

    async def job() -> None:
        await gate.admit("x")
        done.append(trio.current_time() - t0)

    async with trio.open_nursery() as n:
        n.start_soon(job)
        await trio.sleep(1)
        gate.set_policy(DeviceSafetyPolicy(temp_limit_c=90.0, margin_c=2.0, poll_interval=10.0))
        await trio.testing.wait_all_tasks_blocked()
        assert done == [1.0]  # not 10: the change woke the waiter
    assert gate.policy.temp_limit_c == 90.0


async def test_cancelled_waiter_leaves_no_trace(autojump_clock: object) -> None:
    gate = HealthGate(StaticProbe([reading(temp=99.0)]))
    with trio.move_on_after(5) as scope:
        await gate.admit("doomed")
    assert scope.cancelled_caught
    assert gate.statistics().waiters == ()


async def test_unavailable_probe_admits_and_is_not_pressured(autojump_clock: object) -> None:
    probe = StaticProbe()
    probe.set_unavailable("NVML unavailable: no driver")
    gate = HealthGate(probe)
    t0 = trio.current_time()
    await gate.admit("x")
    assert trio.current_time() == t0
    p = await gate.memory_pressure()
    assert not p.pressured and "no driver" in p.detail
    d = gate.statistics().as_dict()
    assert d["device"]["available"] is False and d["device"]["reason"].endswith("no driver")


async def test_probe_going_away_releases_waiters(autojump_clock: object) -> None:
    probe = StaticProbe([reading(temp=95.0)])
    gate = HealthGate(probe, policy=DeviceSafetyPolicy(poll_interval=1.0))
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(gate.admit, "x")
        await trio.sleep(2.5)
        probe.set_unavailable("GPU fell off the bus")
    assert trio.current_time() - t0 == 3.0
    assert not gate.statistics().hot


# --- the real NVML probe ---------------------------------------------------------------


def _nvml_works_here() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except Exception:
        return False
    try:
        return int(pynvml.nvmlDeviceGetCount()) > 0
    finally:
        pynvml.nvmlShutdown()


async def test_real_probe_degrades_gracefully_or_reads() -> None:
    probe = NvmlProbe()
    first = await probe.read(60.0)
    if _nvml_works_here():
        assert first.available and first.reason is None and first.readings
        r = first.readings[0]
        assert r.memory_total_bytes > 0 and r.name
    else:
        # No driver or no GPU (this machine): unavailable with a reason, never an error.
        assert not first.available and first.readings == ()
        assert first.reason and "NVML" in first.reason
        gate = HealthGate(probe)
        await gate.admit("anything")  # admission passes
        assert not (await gate.memory_pressure(60.0)).pressured
    again = await probe.read(60.0)
    assert again is first  # cached within max age
    assert probe.statistics().refreshes == 1
    await probe.aclose()
    closed = await probe.read(0.0)
    assert not closed.available and closed.reason == "probe closed"


class FakeNvml(types.ModuleType):
    """pynvml's interface with scripted answers."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, *, init_error: Exception | None = None, count: int = 2) -> None:
        super().__init__("fake_pynvml")
        self.init_error = init_error
        self.count = count
        self.inits = 0
        self.shutdowns = 0
        self.temps = [55, 91]

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return f"Fake H{h}00".encode()

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return self.temps[h]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return types.SimpleNamespace(used=(h + 1) * GIB, total=80 * GIB, free=0)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        if h == 1:
            raise RuntimeError("not supported")
        return types.SimpleNamespace(gpu=37, memory=5)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return 312_500  # milliwatts


async def test_nvml_probe_parses_readings(autojump_clock: object) -> None:
    nvml = FakeNvml()
    probe = NvmlProbe(nvml=nvml)
    h = await probe.read(1.0)
    assert h.available and h.reason is None
    r0, r1 = h.readings
    assert r0 == GpuReading(0, "Fake H000", 55.0, GIB, 80 * GIB, 37.0, 312.5)
    assert r1.temperature_c == 91.0 and r1.utilization_pct is None  # optional field failed
    assert h.max_temperature_c == 91.0
    nvml.temps = [50, 50]
    assert (await probe.read(1.0)).max_temperature_c == 91.0  # cached
    await trio.sleep(1.5)
    assert (await probe.read(1.0)).max_temperature_c == 50.0  # refreshed after max age
    await probe.aclose()
    assert nvml.shutdowns == 1 and nvml.inits == 1


async def test_nvml_probe_init_failure_is_retried(autojump_clock: object) -> None:
    nvml = FakeNvml(init_error=RuntimeError("NVML Shared Library Not Found"))
    probe = NvmlProbe(nvml=nvml)
    h = await probe.read(1.0)
    assert not h.available and "NVML Shared Library Not Found" in (h.reason or "")
    nvml.init_error = None  # the driver appears
    await trio.sleep(2)
    h = await probe.read(1.0)
    assert h.available and len(h.readings) == 2 and nvml.inits == 2


async def test_nvml_probe_without_gpus(autojump_clock: object) -> None:
    probe = NvmlProbe(nvml=FakeNvml(count=0))
    h = await probe.read(1.0)
    assert not h.available and h.reason == "NVML reports no GPU"


async def test_concurrent_reads_share_one_refresh(autojump_clock: object) -> None:
    probe = NvmlProbe(nvml=FakeNvml())
    results: list[DeviceHealth] = []

    async def read() -> None:
        results.append(await probe.read(5.0))

    async with trio.open_nursery() as n:
        for _ in range(5):
            n.start_soon(read)
    assert len(results) == 5 and all(r is results[0] for r in results)
    assert probe.statistics().refreshes == 1
